"""What the doctor reports about the machine: versions, the device and its target row, the kernel path."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from typing import Any

import torch

from toma.kernels.targets import target_for


def package_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None (nothing is imported)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, Any]:
    """toma, Python, torch with its CUDA or ROCm build, triton and diffusers."""
    from toma import __version__

    triton = None
    for dist in ("triton", "pytorch-triton-rocm", "pytorch-triton"):
        triton = package_version(dist)
        if triton:
            break
    return {
        "toma": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "triton": triton,
        "diffusers": package_version("diffusers"),
        "platform": platform.platform(),
    }


def format_versions(v: dict[str, Any]) -> str:
    """One line of versions."""
    build = f"CUDA {v['cuda']}" if v["cuda"] else f"ROCm {v['hip']}" if v["hip"] else "CPU-only build"
    return (
        f"toma {v['toma']}, python {v['python']}, torch {v['torch']} ({build}), "
        f"triton {v['triton'] or 'not installed'}, diffusers {v['diffusers'] or 'not installed'}"
    )


def resolve_device(name: str) -> torch.device:
    """``--device``: ``auto`` is the current GPU if torch sees one, else the CPU; a named GPU must exist."""
    text = name.strip().lower()
    if text == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device: expected cpu, cuda, cuda:N or auto, got {name!r}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device: toma's GPU path runs on CUDA or ROCm devices (cuda, cuda:N); got {name!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch sees no GPU ({no_gpu_reason()})")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"--device {name}: torch sees {torch.cuda.device_count()} GPU(s), cuda:0 to "
            f"cuda:{torch.cuda.device_count() - 1}"
        )
    return torch.device("cuda", index)


def no_gpu_reason() -> str:
    """Why torch sees no GPU, as far as can be told from here."""
    if not torch.version.cuda and not getattr(torch.version, "hip", None):
        return f"this torch ({torch.__version__}) is a CPU-only build"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", os.environ.get("HIP_VISIBLE_DEVICES"))
    hint = f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm {torch.version.hip}"
    return f"torch is built for {build} but torch.cuda.is_available() is False (no GPU, or no usable driver{hint})"


def device_info(device: torch.device) -> dict[str, Any]:
    """Name, compute capability or AMD ISA, memory, and the toma target table's row with its
    shared memory per block (and the device's own figure where torch reports one)."""
    if device.type != "cuda":
        return {
            "type": device.type,
            "name": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "no_gpu": no_gpu_reason() if not torch.cuda.is_available() else None,
        }
    props = torch.cuda.get_device_properties(device)
    arch = getattr(props, "gcnArchName", None) if getattr(torch.version, "hip", None) else None
    capability = (props.major, props.minor)
    row = target_for(capability=None if arch else capability, arch=arch)
    info: dict[str, Any] = {
        "type": "cuda",
        "index": device.index,
        "name": props.name,
        "capability": None if arch else f"{props.major}.{props.minor}",
        "arch": arch,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
        "shared_per_block_optin": getattr(props, "shared_memory_per_block_optin", None),
        "target": None,
    }
    if row is not None:
        info["target"] = {"name": row.name, "example": row.example, "shared": row.shared, "warp": row.warp}
    return info


def format_device(info: dict[str, Any]) -> list[str]:
    """The device's lines."""
    if info["type"] != "cuda":
        line = f"{info['type']} ({info['name'] or 'unknown CPU'}, {info['threads']} torch threads)"
        return [line + (f"; no GPU: {info['no_gpu']}" if info.get("no_gpu") else "")]
    what = f"gcnArchName {info['arch']}" if info["arch"] else f"compute capability {info['capability']}"
    lines = [f"cuda:{info['index']} {info['name']} ({what}, {info['memory_gib']} GiB, {info['multiprocessors']} SMs)"]
    row, own = info["target"], info["shared_per_block_optin"]
    own_text = f"; the device reports {own // 1024} KB" if own else ""
    if row is None:
        lines.append(
            "target:   not in toma's GPU target table (toma.kernels.targets): the kernels are not compiled "
            f"ahead of time for it; the fit check still reads the device's limit{own_text}"
        )
    else:
        lines.append(
            f"target:   {row['name']} ({row['example']}): {row['shared'] // 1024} KB shared memory per block, "
            f"warp {row['warp']}{own_text}"
        )
        if own and own != row["shared"]:
            lines.append(
                f"          note: the table says {row['shared']} bytes, the device {own}: "
                "the kernels' fit check uses the device's figure"
            )
    return lines


def interpreter_on() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1`` when triton loaded)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_loaded() -> bool:
    """Whether triton is imported in this process already (its interpreter switch is then fixed)."""
    return "triton" in sys.modules
