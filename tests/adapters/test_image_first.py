"""Image-first sites (``layouts.IMAGE_FIRST``, Z-Image's ``[image; caption]``): the first N
tokens of a call merge and the suffix passes whole, and per-batch rotary tables whose first
N rows are the image's get the rows of the destinations, then the suffix's rows whole."""

from __future__ import annotations

import pytest
import torch

from toma.adapters.engine import RotaryToTileOrder, rotary_rows
from toma.adapters.attention import key_bias
from toma.adapters.layouts import IMAGE_FIRST, Fit, InMask, Span
from toma.adapters.merging import _gather_rotary, open_call
from toma.adapters.spec import Rotary, Site, gather_rows
from toma.adapters.state import PlanCache, TileState
from toma.config import ToMAConfig
from toma.core.tiling import tile_order

GRID = (1, 4, 4)
N, TEXT, C = 16, 5, 8
SITE = Site("attention", "attn", rotary=Rotary("freqs_cis", None, gather=gather_rows), layout=IMAGE_FIRST)


def opened(x: torch.Tensor):
    """The merge of an image-first call on ``x`` at ratio 0.5, each sample with its own plan."""
    cache = PlanCache(ToMAConfig(ratio=0.5, tile_size=2))
    cache.begin_forward(GRID, 0.5)
    merged = open_call(cache, TileState(cache), SITE, x, GRID, 0.5)
    assert merged is not None and merged.layout == IMAGE_FIRST and merged.text == TEXT
    assert not torch.equal(merged.plan.dest_tokens[0], merged.plan.dest_tokens[1])
    return merged


def sequence() -> torch.Tensor:
    return torch.randn(2, N + TEXT, C, generator=torch.Generator().manual_seed(0))


def test_the_first_tokens_merge_and_the_suffix_passes_whole():
    x = sequence()
    merged = opened(x)
    plan = merged.plan
    m = merged.merge(x)
    k = plan.num_merged
    assert m.shape == (2, k + TEXT, C) and k < N
    assert torch.equal(m[:, :k], plan.merge(x[:, :N], False))  # the plan saw the image tokens only
    assert torch.equal(m[:, k:], x[:, N:])  # the caption, bitwise, after them
    y = m * 2
    out = merged.unmerge(y)
    assert out.shape == x.shape
    assert torch.equal(out[:, :N], plan.unmerge(y[:, :k], False)) and torch.equal(out[:, N:], y[:, k:])


def test_a_call_shorter_than_the_grid_does_not_merge():
    cache = PlanCache(ToMAConfig(ratio=0.5, tile_size=2))
    cache.begin_forward(GRID, 0.5)
    assert open_call(cache, TileState(cache), SITE, torch.randn(2, N - 1, C), GRID, 0.5) is None


@pytest.mark.parametrize("table_batch", [1, 2])
def test_rotary_rows_are_the_destinations_then_the_suffix(table_batch):
    merged = opened(sequence())
    g = torch.Generator().manual_seed(1)
    table = torch.polar(torch.ones(table_batch, N + TEXT, 3), torch.randn(table_batch, N + TEXT, 3, generator=g))
    _, kwargs, samples = _gather_rotary(SITE.rotary, merged, ("x",), {"freqs_cis": table})
    assert samples is None  # a per-batch table: one call for the batch
    got = kwargs["freqs_cis"]
    dest = merged.plan.dest_tokens
    assert got.shape == (2, dest.shape[1] + TEXT, 3)
    for b in range(2):  # brute force, row by row
        rows = table[0 if table_batch == 1 else b]
        assert torch.equal(got[b], torch.stack([rows[int(i)] for i in dest[b]] + list(rows[N:])))


@pytest.mark.parametrize(
    "options",
    [
        {"rotary": Rotary("freqs_cis", None, shared=True)},
        {"span": Span(call="attn", until="proj_out")},
    ],
)
def test_image_first_refuses_what_it_cannot_lay_out(options):
    with pytest.raises(ValueError, match="image-first"):
        Site("attention", "attn", layout=IMAGE_FIRST, **options)


def tiles():
    """The 2x2 tile layout of ``GRID``."""
    cache = PlanCache(ToMAConfig(ratio=0.5, tile_size=2))
    cache.begin_forward(GRID, 0.5)
    return cache.layout(*GRID)


@pytest.mark.parametrize("runs", [1, 2])
def test_image_first_tables_put_their_image_rows_in_tile_order(runs):
    # a rope module's (N + text, ...) table (HiDream's): its first runs * N rows go to tile
    # order, run by run, and the text rows after them keep their places
    layout = tiles()
    text = 3
    rows = rotary_rows(layout, text, torch.device("cpu"), runs, image_first=True)
    ids = torch.arange(N)[None, :, None]
    tiled = tile_order(ids, layout).flatten()
    expected = [int(i) + r * N for r in range(runs) for i in tiled] + list(range(runs * N, runs * N + text))
    assert rows.tolist() == expected
    assert sorted(expected[:N]) == list(range(N)) and expected[:N] != list(range(N))  # a real reordering


def test_a_rope_module_with_one_table_gets_its_image_rows_reordered():
    # the hook on a rope module that returns one tensor, not a tuple (HiDream's pe_embedder):
    # the tensor comes back reordered, still a tensor
    cache = PlanCache(ToMAConfig(ratio=0.5, tile_size=2))
    cache.begin_forward(GRID, 0.5)
    order = TileState(cache)
    order.layout = cache.layout(*GRID)
    table = torch.randn(2, N + TEXT, 1, 3)
    hook = RotaryToTileOrder(order, 1, image_first=True)
    out = hook.post_forward(torch.nn.Identity(), table)
    rows = rotary_rows(order.layout, TEXT, torch.device("cpu"), image_first=True)
    assert isinstance(out, torch.Tensor) and torch.equal(out, table[:, rows])


@pytest.mark.parametrize(
    "options",
    [
        {"bias": InMask(("attention_mask", None), key_bias)},
        {"span": Span(call="attn", until="proj_out")},
    ],
)
def test_a_mask_of_the_models_own_elsewhere_takes_no_bias_and_no_span(options):
    with pytest.raises(ValueError, match="slot of its own"):
        Site("attention", "attn", fit=Fit(lambda mask, n, k: mask, slot=("hidden_states_masks", 1)), **options)


@pytest.mark.parametrize("table_batch, dest_batch", [(1, 2), (2, 1), (2, 2)])
def test_gather_rows_takes_rows_of_any_shape(table_batch, dest_batch):
    # Kandinsky 5's rotations are (B, N, 1, D/2, 2, 2), ERNIE-Image's angles (B, N, 1, D)
    g = torch.Generator().manual_seed(2)
    table = torch.randn(table_batch, N, 1, 3, 2, 2, generator=g)
    dest = torch.stack([torch.randperm(N, generator=g)[:6] for _ in range(dest_batch)])
    got = gather_rows(table, dest)
    assert got.shape == (max(table_batch, dest_batch), 6, 1, 3, 2, 2)
    for b in range(got.shape[0]):
        rows = table[0 if table_batch == 1 else b]
        assert torch.equal(got[b], torch.stack([rows[int(i)] for i in dest[0 if dest_batch == 1 else b]]))
