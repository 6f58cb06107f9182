"""Counting the kernels a forward launches (ATen operations that do work, views excluded).

On a GPU, an eager forward that is bound by the host pays for every launch, and a
graph-replayed one still pays a few microseconds of device time per kernel, so the count
is a machine-independent measure of what a token-merging method adds to a forward.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that only allocate or relabel memory launch no kernel
_FREE = frozenset({"aten.empty.memory_format", "aten.empty_strided.default", "aten.lift_fresh.default",
                   "aten._unsafe_view.default"})


class KernelCounter(TorchDispatchMode):
    """Counts, by name, the ATen ops that run under it and launch a kernel.

    A view op counts only when it had to copy (``reshape`` of a non-viewable layout, say).
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
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
