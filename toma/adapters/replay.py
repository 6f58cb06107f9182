"""Checkpointed blocks recomputed in the backward pass merge as their forward did.

Gradient checkpointing runs a block's forward again during backward. The block's merges
read the forward's state: the plans, grid and token orders in the model's
:class:`~toma.adapters.state.ForwardState`. It holds what the *latest* forward left there,
so a forward between a forward and its backward (a teacher or target prediction under
``no_grad``, as distillation loops make) would hand the recomputed blocks another call's
plans: gradients silently off, by up to a few percent.

A :class:`ReplayHook` on every block with merged sub-modules keeps, after each forward that
autograd may recompute (gradients on, or an input that requires them), a copy of that
forward state keyed by the block's input tensor. A recomputation reaches the block with the
same input tensor (checkpointing keeps it), inside the backward pass; the hook then swaps
the copy in as the cache's forward state, runs the block, and swaps the live one back. A
copy lives as long as its input tensor, which autograd frees with the graph.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from toma.adapters.base import REPLAY_HOOK_NAME, Hook
from toma.adapters.merging import hidden_states_of
from toma.adapters.state import ForwardState, PlanCache

__all__ = ["REPLAY_HOOK_NAME", "Replay", "ReplayHook", "attach_replay"]


class Replay:
    """The per-model record of the state each block's forward merged with (see the module docstring).

    Args:
        cache: the patched model's plan cache, whose ``forward`` state is recorded.
    """

    def __init__(self, cache: PlanCache) -> None:
        self.cache = cache
        self._records: dict[tuple, tuple[weakref.ref, ForwardState]] = {}

    def _swap(self, state: ForwardState) -> ForwardState:
        live, self.cache.forward = self.cache.forward, state
        return live

    def run(self, forward: Any, x: Any, args: tuple, kwargs: dict) -> Any:
        """``forward(*args, **kwargs)`` for a block whose input hidden states are ``x``: on
        the forward state recorded for it if this is its recomputation, else recording it when
        gradients are on."""
        # a reentrant checkpoint runs the forward under no_grad, on inputs that require grad
        if (
            not isinstance(x, torch.Tensor)
            or not (torch.is_grad_enabled() or x.requires_grad)
            or torch.compiler.is_compiling()
        ):
            return forward(*args, **kwargs)
        key = _key(x)
        if key is None:
            return forward(*args, **kwargs)
        found = self._records.get(key)
        # inside the backward pass, the same data again: checkpointing recomputes (a reentrant
        # checkpoint passes a detached view of it, still alive in the checkpoint's context)
        if found is not None and found[0]() is not None and _in_backward():
            live = self._swap(found[1])
            try:
                return forward(*args, **kwargs)
            finally:
                self._swap(live)
        out = forward(*args, **kwargs)
        records = self._records

        def drop(ref: weakref.ref, key: tuple = key) -> None:
            if records.get(key, (None,))[0] is ref:
                del records[key]

        records[key] = (weakref.ref(x, drop), self.cache.forward.copy())
        return out


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread (where
    checkpoints recompute). A torch without the private query counts as always: a block's
    input tensor only comes back while its record lives when it is recomputed."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is None or task() != -1


def _key(x: torch.Tensor) -> tuple | None:
    """Where ``x``'s data lives; None for tensors without plain storage (e.g. subclasses)."""
    try:
        return (x.device, x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride())
    except (RuntimeError, NotImplementedError):
        return None


class ReplayHook(Hook):
    """On a block with merged sub-modules: runs it through :meth:`Replay.run`."""

    def __init__(self, replay: Replay) -> None:
        self.replay = replay

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.replay.run(self.fn_ref.original_forward, hidden_states_of(args, kwargs), args, kwargs)


def attach_replay(model: torch.nn.Module, blocks: list[str], cache: PlanCache, ledger: Any) -> list[torch.nn.Module]:
    """Register a :class:`ReplayHook` on each block named in ``blocks``, outermost (after
    every other toma hook on it, so that its recorded state covers them all), in ``ledger``
    (a :class:`~toma.adapters.ledger.Ledger`); returns the blocks."""
    replay = Replay(cache)
    hooked = []
    for name in dict.fromkeys(blocks):
        try:
            hooked.append(model.get_submodule(name))
        except AttributeError:  # targets named outside the model's tree (as some tests make)
            continue
    for block in hooked:
        ledger.hook(block, ReplayHook(replay), REPLAY_HOOK_NAME, innermost=False)
    return hooked
