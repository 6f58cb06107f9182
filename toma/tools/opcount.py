"""Counting the kernels a forward launches (ATen operations that do work, views excluded).

On a GPU, an eager forward that is bound by the host pays for every launch, and a
graph-replayed one still pays a few microseconds of device time per kernel, so the count
is a machine-independent measure of what a token-merging method adds to a forward.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that only allocate or relabel memory launch no kernel
_FREE = frozenset(
    {
        "aten.empty.memory_format",
        "aten.empty_strided.default",
        "aten.empty_like.default",
        "aten.lift_fresh.default",
        "aten._unsafe_view.default",
    }
)


class KernelCounter(TorchDispatchMode):
    """Counts, by name, the ATen ops that run under it and launch a kernel.

    A view op counts only when it had to copy (``reshape`` of a non-viewable layout, say).
    Launches of ToMA's Triton kernels (:mod:`toma.kernels`) count as one each, as
    ``triton::<kernel>``, and what runs inside them does not count (under
    ``TRITON_INTERPRET=1`` the interpreter copies tensors with ATen ops of its own).
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self._inside_triton = 0
        self._wrapped: list[Any] = []

    def __enter__(self) -> "KernelCounter":
        # wrapped on the kernel objects for the duration only, and only once triton is loaded
        ops = sys.modules.get("toma.kernels.triton_ops")
        for kernel in [] if ops is None else ops.KERNELS:
            kernel.run = self._counting(kernel)
            self._wrapped.append(kernel)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for kernel in self._wrapped:
            del kernel.run  # the class's run again
        self._wrapped.clear()
        return super().__exit__(*exc)

    def _counting(self, kernel: Any) -> Callable[..., Any]:
        run = kernel.run
        name = f"triton::{getattr(kernel, '__name__', None) or kernel.fn.__name__}"

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.ops[name] += 1
            self._inside_triton += 1
            try:
                return run(*args, **kwargs)
            finally:
                self._inside_triton -= 1

        return counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if self._inside_triton:
            return out
        name = str(func).removeprefix("aten.")
        if not func.is_view:
            if str(func) not in _FREE:
                self.ops[name] += 1
        elif _copied(out, args):
            self.ops[f"{name} (copy)"] += 1
        return out


def count_kernels(call: Callable[[], Any]) -> Counter[str]:
    """Kernel-launching ops of one ``call()``, by op name."""
    with KernelCounter() as counter:
        call()
    return counter.ops


def _copied(out: Any, args: tuple) -> bool:
    first = args[0] if args else None
    if not isinstance(out, torch.Tensor) or not isinstance(first, torch.Tensor) or out.device.type == "meta":
        return False
    return out.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
