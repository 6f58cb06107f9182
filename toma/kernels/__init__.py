"""Optional fused kernels for CUDA (Triton), with the torch path as fallback and reference.

Plans built for CUDA tensors use :mod:`toma.kernels.triton_ops` when triton can be
imported: one launch per plan for the greedy and the merge weights, and merges and
unmerges that read and write raster order directly. The environment variable
``TOMA_KERNELS`` chooses:

* ``auto`` (default): Triton on CUDA when triton is installed, torch elsewhere;
* ``torch``: always the torch path (to compare, or to work around a Triton problem);
* ``triton``: always Triton, an error where it cannot run; on the CPU it needs
  ``TRITON_INTERPRET=1`` (the interpreter, for tests).

Under ``torch.compile`` the torch path is used: the compiler fuses it itself. The kernels
have no backward: a merge or unmerge whose input needs a gradient runs the torch path
(plans never need one).
"""

from __future__ import annotations

import importlib.util
import os

import torch

KERNELS_ENV = "TOMA_KERNELS"
KERNEL_MODES = ("auto", "torch", "triton")


def kernel_mode() -> str:
    """The ``TOMA_KERNELS`` setting, checked: one of :data:`KERNEL_MODES`."""
    mode = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNELS_ENV} must be one of {', '.join(KERNEL_MODES)}; got {os.environ[KERNELS_ENV]!r}")
    return mode


def triton_available() -> bool:
    """Whether triton can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(device: torch.device) -> bool:
    """Whether plans and merges for tensors on ``device`` run the Triton kernels."""
    if torch.compiler.is_compiling():
        return False
    mode = kernel_mode()
    if mode == "torch":
        return False
    if mode == "auto":
        return device.type == "cuda" and triton_available()
    if not triton_available():
        raise RuntimeError(f"{KERNELS_ENV}=triton, but triton is not installed (pip install triton)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{KERNELS_ENV}=triton on a {device.type} tensor: Triton runs on CUDA, or on the CPU under TRITON_INTERPRET=1"
        )
    return True
