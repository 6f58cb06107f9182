"""Merged MLPs under diffusers' feed-forward chunking.

A block with chunking on (``set_chunk_feed_forward`` / ``enable_forward_chunking``) calls
its MLP once per slice of the batch (``dim=0``) or of the tokens (``dim=1``). A slice of the
tokens cannot be merged, and a slice of the batch would look up another sample's plan. So
while a merged block runs, toma takes the chunking over: the block's own chunking is
switched off, the MLP is called once with every token, and its merge hook merges them and
then runs the MLP over the merged tokens in slices of the same size along the same
dimension. The MLP treats tokens (and samples) independently, so the result is the one
without chunking, and the memory the user asked to save stays saved.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from toma.adapters import _private
from toma.adapters.base import CHUNK_HOOK_NAME, Hook, Patched
from toma.adapters.merging import hidden_states_of, with_hidden_states


class ChunkState:
    """The chunking a block asked for, handed from the block's hook to its MLP's."""

    def __init__(self) -> None:
        self.size: int | None = None  # slice length while the block runs, None: no chunking
        self.dim = 0
        self._taken: tuple[int, int] | None = None  # the block's own setting, while taken over


class BlockChunkHook(Hook):
    """On a block with feed-forward chunking: switches it off for the block's call and
    records it for the MLP's :class:`Chunked` call; restores it afterwards."""

    def __init__(self, state: ChunkState) -> None:
        self.state = state

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        state = self.state
        if state._taken is not None:  # the previous call raised before post_forward
            _set_chunking(module, *state._taken)
        state._taken = None
        state.size = getattr(module, _private.CHUNK_SIZE, None)
        if state.size is not None:
            state.dim = getattr(module, _private.CHUNK_DIM, 0)
            state._taken = (state.size, state.dim)
            setattr(module, _private.CHUNK_SIZE, None)
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        state = self.state
        if state._taken is not None:
            _set_chunking(module, *state._taken)
            state._taken = None
        state.size = None
        return output


def _set_chunking(block: torch.nn.Module, size: int | None, dim: int) -> None:
    setattr(block, _private.CHUNK_SIZE, size)
    setattr(block, _private.CHUNK_DIM, dim)


class Chunked:
    """A call strategy for an MLP whose block may chunk it (see the module docstring): runs
    the MLP over the (merged) tokens in the slices the block asked for."""

    def __init__(self, state: ChunkState) -> None:
        self.state = state

    def __call__(self, forward: Callable, hook: Any, *args: Any, **kwargs: Any) -> Any:
        x = hidden_states_of(args, kwargs)
        size = self.state.size
        if size is None or x is None:
            return forward(*args, **kwargs)
        outputs = []
        for piece in x.split(size, dim=self.state.dim):
            a, k = with_hidden_states(args, kwargs, piece)
            outputs.append(forward(*a, **k))
        return torch.cat(outputs, dim=self.state.dim)


def chunkable_block(model: torch.nn.Module, target: Patched, path: str) -> torch.nn.Module | None:
    """The block that may chunk ``target``'s MLP (``path`` is the MLP's name inside it), or None."""
    name = target.name
    if not name.endswith("." + path):
        return None
    block = model.get_submodule(name[: -len(path) - 1])
    if not hasattr(block, _private.CHUNK_SIZE) or block.get_submodule(path) is not target.module:
        return None
    return block


def take_over_chunking(block: torch.nn.Module, ledger: Any) -> ChunkState:
    """Register the block's chunking hook in ``ledger`` (a :class:`~toma.adapters.ledger.Ledger`);
    returns the state its MLP's hook reads."""
    state = ChunkState()
    ledger.hook(block, BlockChunkHook(state), CHUNK_HOOK_NAME)
    return state
