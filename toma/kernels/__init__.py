"""Optional fused kernels for CUDA and ROCm (Triton), with the torch path as fallback and reference.

Plans built for GPU tensors use :mod:`toma.kernels.triton_ops` when triton can be
imported: one launch per plan for the greedy and the merge weights, and merges and
unmerges that read and write raster order directly. The environment variable
``TOMA_KERNELS`` chooses:

* ``auto`` (default): Triton on CUDA/ROCm devices when triton is installed, torch
  elsewhere. A kernel that cannot run never breaks a generation: if importing triton
  fails, or compiling or launching a kernel raises (a compile error, out of resources,
  a driver error at first use), toma warns once, naming the error, and that kernel takes
  the torch path for the rest of the process. A launch whose block shape does not fit
  the device's shared memory takes the torch path too, decided before it is launched.
  Each device's kernels are tried once on tiny inputs at its first use, so that a
  toolchain or driver problem is found before the first real merge.
* ``torch``: always the torch path (to compare, or to work around a Triton problem);
* ``triton``: always Triton, and every kernel error is raised (an explicit request); on
  the CPU it needs ``TRITON_INTERPRET=1`` (the interpreter, for tests).

Only errors raised while launching can be recovered. A kernel fault reported later by
the device (an illegal memory access, say) surfaces at the next synchronisation, where
nothing can be undone; ``TOMA_KERNELS=torch`` avoids the kernels altogether.

Under ``torch.compile`` the torch path is used: the compiler fuses it itself. The kernels
have no backward: a merge or unmerge whose input needs a gradient runs the torch path
(plans never need one). Kernels launch on their tensors' own device (``cuda:1``, a
``device_map`` shard, one rank per GPU), whatever the current device is.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from typing import Any, Callable

import torch

KERNELS_ENV = "TOMA_KERNELS"
KERNEL_MODES = ("auto", "torch", "triton")
KERNEL_NAMES = ("plan", "merge", "unmerge")

# callables given (name, kernel, args, constexprs) before each launch: the compile check
# records the signatures of the launches the tests make (toma.kernels.aot)
LAUNCH_OBSERVERS: list[Callable[[str, Any, tuple, dict], None]] = []

# device types on which ``auto`` picks the kernels (ROCm builds of torch say "cuda" too);
# the fallback tests add "cpu" here to run ``auto`` through the interpreter
AUTO_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


def kernel_mode() -> str:
    """The ``TOMA_KERNELS`` setting, checked: one of :data:`KERNEL_MODES`."""
    mode = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNELS_ENV} must be one of {', '.join(KERNEL_MODES)}; got {os.environ[KERNELS_ENV]!r}")
    return mode


def triton_available() -> bool:
    """Whether triton is installed (without importing it)."""
    return importlib.util.find_spec("triton") is not None


class KernelHealth:
    """Which kernels this process may launch, per device: lives as long as the process.

    A kernel that raised is off for the rest of the process (the same error would come
    back at every launch); launches that do not fit a device are refused one block shape
    at a time. Each message is given once.
    """

    def __init__(self) -> None:
        self.broken: dict[str, str] = {}  # kernel name -> the error that turned it off
        self.probed: set[tuple[str, int | None]] = set()
        self.said: set[str] = set()
        # (kernel, constexprs, activation dtype, device) -> whether its block fits the device
        self.fits: dict[tuple, bool] = {}

    def reset(self) -> None:
        """Forget every failure and probe (for tests, or after fixing the environment)."""
        self.broken.clear()
        self.probed.clear()
        self.said.clear()
        self.fits.clear()

    def usable(self, name: str) -> bool:
        return name not in self.broken

    def fail(self, name: str, err: BaseException) -> None:
        """Turn kernel ``name`` off after ``err``, saying so once."""
        reason = f"{type(err).__name__}: {err}".strip()
        first_line = reason.splitlines()[0] if reason else type(err).__name__
        self.broken[name] = first_line
        self.say(
            f"toma: the Triton {name} kernel failed ({first_line}); it takes the torch path for the rest of "
            f"this process. Set {KERNELS_ENV}=torch to skip the kernels, or {KERNELS_ENV}=triton to see the error."
        )

    def say(self, message: str) -> None:
        if message not in self.said:
            self.said.add(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


HEALTH = KernelHealth()


def _device_key(device: torch.device) -> tuple[str, int | None]:
    return device.type, device.index


def _ready(device: torch.device) -> bool:
    """``auto`` mode: whether any kernel can run on ``device``; imports triton and tries
    each kernel once per device on its first use."""
    key = _device_key(device)
    if key not in HEALTH.probed:
        HEALTH.probed.add(key)
        try:
            ops = importlib.import_module("toma.kernels.triton_ops")
        except Exception as err:  # a broken install, a missing driver library: torch it is
            for name in KERNEL_NAMES:
                HEALTH.broken[name] = f"import failed: {type(err).__name__}: {err}"
            HEALTH.say(
                f"toma: triton could not be imported ({type(err).__name__}: {err}); merges take the torch path. "
                f"Set {KERNELS_ENV}=torch to skip the kernels."
            )
            return False
        ops.probe(device)
    return any(HEALTH.usable(name) for name in KERNEL_NAMES)


def use_triton(device: torch.device) -> bool:
    """Whether plans and merges for tensors on ``device`` run the Triton kernels (each
    kernel may still take the torch path on its own, see :func:`kernel_usable`)."""
    if torch.compiler.is_compiling():
        return False
    mode = kernel_mode()
    if mode == "torch":
        return False
    if mode == "auto":
        return device.type in AUTO_DEVICE_TYPES and triton_available() and _ready(device)
    if not triton_available():
        raise RuntimeError(f"{KERNELS_ENV}=triton, but triton is not installed (pip install triton)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{KERNELS_ENV}=triton on a {device.type} tensor: Triton runs on CUDA, or on the CPU under "
            "TRITON_INTERPRET=1"
        )
    return True


def kernel_usable(name: str) -> bool:
    """Whether kernel ``name`` (one of :data:`KERNEL_NAMES`) has not been turned off by an error."""
    return HEALTH.usable(name)


def merges_from_raster(device: torch.device) -> bool:
    """Whether merges of tokens on ``device`` read and write raster order themselves (the
    merge and unmerge kernels run), so that tokens need not be kept in tile order."""
    return use_triton(device) and HEALTH.usable("merge") and HEALTH.usable("unmerge")


def describe_path(device: torch.device) -> tuple[str, str]:
    """``(path, why)`` for tensors on ``device``: ``path`` is ``"triton"``, ``"triton (partly)"``
    or ``"torch"``, and ``why`` says what decided it (for ``toma doctor``)."""
    try:
        mode = kernel_mode()
    except ValueError as err:
        return "torch", str(err)
    if mode == "torch":
        return "torch", f"{KERNELS_ENV}=torch"
    if not triton_available():
        return "torch", "triton is not installed"
    if mode == "auto" and device.type not in AUTO_DEVICE_TYPES:
        return "torch", f"{KERNELS_ENV}=auto runs the kernels on GPUs only; this is a {device.type} device"
    try:
        on = use_triton(device)
    except RuntimeError as err:
        return "torch", str(err)
    broken = {n: HEALTH.broken[n] for n in KERNEL_NAMES if n in HEALTH.broken}
    if not on:
        return "torch", "every kernel failed: " + "; ".join(f"{n}: {e}" for n, e in broken.items())
    if broken:
        return "triton (partly)", "turned off after an error: " + "; ".join(f"{n}: {e}" for n, e in broken.items())
    return "triton", f"{KERNELS_ENV}={mode}" + (" and triton is installed" if mode == "auto" else "")
