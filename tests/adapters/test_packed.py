"""Packed sequences (``FamilySpec.packed``: MiniMax H3, Ideogram 4): a sequence ``[prefix; image]``
that enters and leaves the blocks whole has its last N tokens put in tile order and back,
the prefix in place, and so do the per-row inputs over it (``position_inputs``)."""

from __future__ import annotations

import torch

from toma.adapters.engine import _positions_to_block_order
from toma.adapters.state import PlanCache, TileState
from toma.config import ToMAConfig
from toma.core.tiling import tile_order

GRID = (1, 4, 8)
N, PREFIX = 32, 7


def order(packed: bool) -> TileState:
    """A forward's token order in 2x2 tiles on GRID, packed or not."""
    cache = PlanCache(ToMAConfig(ratio=0.5, tile_size=2))
    cache.begin_forward(GRID, None)
    state = TileState(cache)
    state.layout = cache.tile_order_layout(GRID, torch.device("cpu"))
    state.packed = packed
    assert state.layout is not None
    return state


def test_a_packed_sequence_reorders_its_image_part_only_and_back_exactly():
    state = order(packed=True)
    x = torch.randn(2, PREFIX + N, 3, generator=torch.Generator().manual_seed(0))
    y = state.convert(x, enter=True)
    assert torch.equal(y[:, :PREFIX], x[:, :PREFIX])
    assert torch.equal(y[:, PREFIX:], tile_order(x[:, PREFIX:], state.layout))
    assert not torch.equal(y, x) and torch.equal(state.convert(y, enter=False), x)
    image = x[:, PREFIX:]  # the image alone (an unconditional call) reorders as before
    assert torch.equal(state.convert(image, enter=True), tile_order(image, state.layout))


def test_the_one_buffer_reorder_equals_the_concatenation_it_replaced():
    # reorder_after_prefix writes [prefix; reordered image] in one pass: bitwise the prefix
    # concatenated with tile_order's (and raster_order's) image, on a frame grid of 2x2 tiles
    # and on a video grid of 2x2x2 tiles, batch 2, from a non-contiguous input too
    from toma.core.tiling import make_layout, raster_order, reorder_after_prefix

    g = torch.Generator().manual_seed(1)
    for (t, h, w), tile in (((1, 4, 8), (2, 2)), ((4, 4, 6), (2, 2, 2))):
        layout = make_layout(h, w, tile, 0.5, t=t)
        n = layout.num_tokens
        x = torch.randn(2, 3, PREFIX + n, generator=g).transpose(1, 2)  # (2, S, 3), not contiguous
        for enter, reorder in ((True, tile_order), (False, raster_order)):
            want = torch.cat([x[:, :PREFIX], reorder(x[:, PREFIX:], layout)], dim=1)
            got = reorder_after_prefix(x, layout, enter)
            assert torch.equal(got, want) and got.is_contiguous()
        assert torch.equal(reorder_after_prefix(reorder_after_prefix(x, layout, True), layout, False), x)


def test_without_packed_a_longer_sequence_keeps_the_models_order():
    # the engine's rule before packed sequences, kept for every other family: a tensor that
    # is not the image's N tokens is not the blocks' sequence
    state = order(packed=False)
    x = torch.randn(2, PREFIX + N, 3)
    assert state.convert(x, enter=True) is x


class Call(torch.nn.Module):
    """A forward whose per-row inputs are named, for the reordering of the call's arguments."""

    def forward(self, hidden_states, position_ids=None, tags=None):
        return hidden_states


def test_per_row_inputs_over_the_packed_sequence_follow_the_image_rows():
    state, module = order(packed=True), Call()
    ids = torch.arange((PREFIX + N) * 3).reshape(PREFIX + N, 3)
    tags = torch.arange(PREFIX + N)
    batched = ids[None].expand(2, -1, -1)
    image = tile_order(torch.arange(N)[None, :, None], state.layout)[0, :, 0] + PREFIX
    rows = torch.cat([torch.arange(PREFIX), image])  # the prefix in place, then the image's rows in tile order
    _, kw = _positions_to_block_order(module, "position_ids", ids, state, (), {"position_ids": ids})
    assert torch.equal(kw["position_ids"], ids[rows])
    _, kw = _positions_to_block_order(module, "tags", tags, state, (), {"tags": tags})
    assert torch.equal(kw["tags"], tags[rows])
    args, _ = _positions_to_block_order(module, "position_ids", batched, state, (None, batched), {})
    assert torch.equal(args[1], batched[:, rows])
    unpacked = order(packed=False)  # not packed: rows over more than the image are not the image's
    _, kw = _positions_to_block_order(module, "tags", tags, unpacked, (), {"tags": tags})
    assert kw["tags"] is tags
