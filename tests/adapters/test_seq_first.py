"""Sequence-first sites (``layouts.SeqFirst``, ERNIE-Image's MLP on ``(S, B, C)``): a call
merges and unmerges as its ``(B, S, C)`` transpose would, and the module gets its merged
tokens sequence-first."""

from __future__ import annotations

import pytest
import torch

from toma.adapters.base import HOOK_NAME, register_innermost
from toma.adapters.attention import key_bias
from toma.adapters.layouts import ALONE, IMAGE_FIRST, InMask, SeqFirst, Span, ViaCall
from toma.adapters.merging import MergeHook
from toma.adapters.spec import Site
from toma.adapters.state import PlanCache, TileState
from toma.config import ToMAConfig

GRID = (1, 4, 4)
N, TEXT, C = 16, 5, 8


class Recorder(torch.nn.Module):
    """A token-wise layer that keeps the shape of what it was called on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(C, C)
        self.seen: list[tuple[int, ...]] = []

    def forward(self, x):
        self.seen.append(tuple(x.shape))
        return torch.nn.functional.gelu(self.proj(x))


def hooked(cache: PlanCache, site: Site) -> Recorder:
    module = Recorder()
    register_innermost(module, MergeHook(cache, 1, TileState(cache), site), HOOK_NAME)
    return module


def test_a_sequence_first_call_merges_as_its_batch_first_transpose():
    cache = PlanCache(ToMAConfig(ratio=0.5, tile_size=2))
    cache.begin_forward(GRID, 0.5)
    x = torch.randn(N + TEXT, 2, C, generator=torch.Generator().manual_seed(1))  # [image; text], (S, B, C)
    seq = hooked(cache, Site("mlp", "mlp", layout=SeqFirst(IMAGE_FIRST)))
    batch = hooked(cache, Site("mlp", "mlp", layout=IMAGE_FIRST))  # the same plan: one group, one forward
    with torch.no_grad():
        out = seq(x)
        ref = batch(x.transpose(0, 1).contiguous())
    [plan] = [p for _, p in cache._plans.values()]
    k = plan.num_merged
    assert k < N and not torch.equal(plan.dest_tokens[0], plan.dest_tokens[1])  # a plan per sample
    assert seq.seen == [(k + TEXT, 2, C)] and batch.seen == [(2, k + TEXT, C)]
    assert out.shape == x.shape
    assert torch.equal(out, ref.transpose(0, 1))


def test_without_seq_first_such_a_call_is_not_taken_for_tokens():
    # (S, B, C) read as batch-first has B "tokens", fewer than the grid's: nothing merges
    cache = PlanCache(ToMAConfig(ratio=0.5, tile_size=2))
    cache.begin_forward(GRID, 0.5)
    x = torch.randn(N + TEXT, 2, C, generator=torch.Generator().manual_seed(1))
    module = hooked(cache, Site("mlp", "mlp", layout=IMAGE_FIRST))
    with torch.no_grad(), pytest.warns(UserWarning, match="on 2 of the 16 tokens"):  # taken for a slice
        out = module(x)
    assert module.seen == [tuple(x.shape)] and not cache._plans
    assert torch.equal(out, torch.nn.functional.gelu(module.proj(x)))


@pytest.mark.parametrize(
    "options",
    [
        {"bias": InMask(("attention_mask", None), key_bias)},
        {"bias": ViaCall(lambda *a, **k: None, key_bias)},
        {"span": Span(call="a", until="b")},
    ],
)
def test_seq_first_refuses_a_key_bias_and_spans(options):
    with pytest.raises(ValueError, match="sequence-first"):
        Site("mlp", "attn", layout=SeqFirst(ALONE), **options)
