"""Per-batch rotary tables at text-first sites (Ideogram 4's packed ``[pad; text; image]``):
the last N tokens of a call merge, and tables ``(B, text + N, ...)`` keep their text rows
whole, then take the rows of the destinations. Shared tables (one for the batch) are
``toma.adapters.merging._sample_rows``' and tested through the conformance suite."""

from __future__ import annotations

import pytest
import torch

from toma.adapters.layouts import ALONE, TEXT_FIRST
from toma.adapters.merging import MergedCall, _gather_rotary, open_call
from toma.adapters.spec import Rotary, Site, gather_rows
from toma.adapters.state import PlanCache, TileState
from toma.config import ToMAConfig

GRID = (1, 4, 4)
N, TEXT, C = 16, 5, 8
SITE = Site("attention", "attn", rotary=Rotary("rope", None, gather=gather_rows), layout=TEXT_FIRST)


def opened(x: torch.Tensor):
    """The merge of a text-first call on ``x`` at ratio 0.5, each sample with its own plan."""
    cache = PlanCache(ToMAConfig(ratio=0.5, tile_size=2))
    cache.begin_forward(GRID, 0.5)
    merged = open_call(cache, TileState(cache), SITE, x, GRID, 0.5)
    assert merged is not None and merged.layout == TEXT_FIRST and merged.text == TEXT
    assert not torch.equal(merged.plan.dest_tokens[0], merged.plan.dest_tokens[1])
    return merged


@pytest.mark.parametrize("table_batch", [1, 2])
def test_text_rows_lead_whole_then_the_destinations_rows(table_batch):
    merged = opened(torch.randn(2, TEXT + N, C, generator=torch.Generator().manual_seed(0)))
    g = torch.Generator().manual_seed(1)
    cos, sin = (torch.randn(table_batch, TEXT + N, 6, generator=g) for _ in range(2))
    _, kwargs, samples = _gather_rotary(SITE.rotary, merged, ("x",), {"rope": (cos, sin)})
    assert samples is None  # a per-batch table: one call for the batch
    dest = merged.plan.dest_tokens
    for table, got in zip((cos, sin), kwargs["rope"]):
        assert got.shape == (2, TEXT + dest.shape[1], 6)
        for b in range(2):  # brute force, row by row
            rows = table[0 if table_batch == 1 else b]
            assert torch.equal(got[b], torch.stack(list(rows[:TEXT]) + [rows[TEXT + int(i)] for i in dest[b]]))


def test_outside_a_text_first_layout_the_gather_sees_the_whole_table():
    # sites whose image is alone (conditioning tokens leading it): the family's gather gets
    # every row (here gather_rows indexes the first N rows, the text's among them)
    opened_call = opened(torch.randn(2, TEXT + N, C, generator=torch.Generator().manual_seed(0)))
    merged = MergedCall(opened_call.plan, opened_call.tiled, opened_call.text, opened_call.tokens, ALONE)
    table = torch.randn(1, TEXT + N, 6, generator=torch.Generator().manual_seed(1))
    _, kwargs, _ = _gather_rotary(SITE.rotary, merged, ("x",), {"rope": table})
    assert torch.equal(kwargs["rope"], gather_rows(table, merged.plan.dest_tokens))
