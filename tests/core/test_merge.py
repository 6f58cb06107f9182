"""Tiling, merge and unmerge operators."""

from __future__ import annotations

import pytest
import torch

from toma.config import ToMAConfig
from toma.core.merge import NEGLIGIBLE_WEIGHT, assignment, cosine_similarity, merge, merge_weights, unmerge
from toma.core.plan import build_plan
from toma.core.selection import facility_location, grid_selection
from toma.core.tiling import from_tiles, make_layout, raster_order, slot_raster_index, tile_order, to_tiles, token_mask


@pytest.mark.parametrize("h,w,tile", [(8, 8, (4, 4)), (6, 10, (4, 4)), (7, 5, (2, 3)), (3, 3, (4, 4)), (1, 9, (1, 4))])
def test_tiles_round_trip(h, w, tile):
    layout = make_layout(h, w, tile, 0.5)
    x = torch.randn(2, h * w, 3)
    tiles = to_tiles(x, layout)
    assert tiles.shape == (2, layout.num_tiles, layout.tile_area, 3)
    assert torch.equal(from_tiles(tiles, layout), x)


def test_tile_holds_a_spatial_window():
    layout = make_layout(8, 8, (4, 4), 0.5)
    x = torch.arange(64.0).reshape(1, 64, 1)
    tiles = to_tiles(x, layout)
    assert tiles[0, 1, :, 0].tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31]


def test_keep_counts():
    assert make_layout(64, 64, (4, 4), 0.5).num_merged == 2048
    layout = make_layout(6, 5, (4, 4), 0.5)  # tiles with 16, 4, 8 and 2 real tokens
    assert layout.keep == (8, 2, 4, 1)
    assert make_layout(4, 4, (4, 4), 0.99).keep == (1,)


@pytest.mark.parametrize(
    "t,h,w,tile", [(4, 8, 8, (2, 4, 4)), (3, 6, 5, (2, 4, 4)), (1, 5, 7, (2, 4, 4)), (5, 3, 3, (3, 2, 2))]
)
def test_spatio_temporal_tiles_round_trip_and_window(t, h, w, tile):
    layout = make_layout(h, w, tile, 0.5, t=t)
    x = torch.arange(float(t * h * w)).reshape(1, -1, 1).repeat(2, 1, 1)
    tiles = to_tiles(x, layout)
    assert tiles.shape == (2, layout.num_tiles, layout.tile_area, 1)
    assert torch.equal(from_tiles(tiles, layout), x)
    # brute force: tile (f, i, j) holds the raster tokens of its window, slots in (t, h, w) order
    tt, th, tw = layout.tt, layout.th, layout.tw
    index = 0
    for f in range(layout.gt):
        for i in range(layout.gh):
            for j in range(layout.gw):
                real = torch.tensor(
                    [
                        (ff * h + ii) * w + jj
                        for ff in range(f * tt, f * tt + tt)
                        for ii in range(i * th, i * th + th)
                        for jj in range(j * tw, j * tw + tw)
                        if ff < t and ii < h and jj < w
                    ],
                    dtype=torch.float32,
                )
                got = tiles[0, index, :, 0]
                mask = token_mask(layout)
                got = got if mask is None else got[mask[index]]
                assert torch.equal(got, real)
                assert layout.keep[index] == max(1, min(len(real), int(len(real) * 0.5 + 0.5)))
                index += 1
    if not layout.padded:
        assert torch.equal(raster_order(tile_order(x, layout), layout), x)
        assert torch.equal(tile_order(x, layout)[0, :, 0].long(), slot_raster_index(layout))


@pytest.mark.parametrize("h,w,tile", [(8, 12, (4, 4)), (16, 16, (2, 4)), (12, 8, (4, 2))])
def test_image_flattens_straight_into_tile_order(h, w, tile):
    # the values of tile_order on the image's raster tokens, in one copy; and back, contiguous
    from toma.core.tiling import image_to_tile_order, tile_order_to_image

    layout = make_layout(h, w, tile, 0.5)
    image = torch.randn(2, 5, h, w)
    tokens = image_to_tile_order(image, layout)
    assert torch.equal(tokens, tile_order(image.permute(0, 2, 3, 1).reshape(2, h * w, 5), layout))
    back = tile_order_to_image(tokens, layout)
    assert torch.equal(back, image) and back.is_contiguous()
    with pytest.raises(ValueError, match="one-frame layout of that grid without padding"):
        image_to_tile_order(torch.randn(1, 5, h + 1, w), layout)
    with pytest.raises(ValueError, match="padded"):
        image_to_tile_order(torch.randn(1, 5, 10, 14), make_layout(10, 14, (4, 4), 0.5))


def test_spatio_temporal_grid_selection_picks_real_distinct_slots():
    layout = make_layout(3, 5, (2, 2, 2), 0.5, t=3)
    picks, mask = grid_selection(layout), token_mask(layout)
    for tile, keep in enumerate(layout.keep):
        chosen = picks[tile, :keep].tolist()
        assert len(set(chosen)) == keep and all(bool(mask[tile, i]) for i in chosen)


def hard_plan(x: torch.Tensor, h: int, w: int, tile=(4, 4), ratio=0.5):
    layout = make_layout(h, w, tile, ratio)
    cfg = ToMAConfig(ratio=ratio, tile_size=tile, temperature=0)
    return build_plan(to_tiles(x, layout), layout, x.dtype, selection=cfg.selection, temperature=cfg.temperature)


@pytest.mark.parametrize("h,w", [(8, 8), (6, 10), (5, 7)])
def test_hard_assignment_unmerge_returns_destinations_exactly(h, w):
    x = torch.randn(2, h * w, 16, dtype=torch.float64)
    plan = hard_plan(x, h, w)
    merged = plan.merge(x)
    assert merged.shape == (2, plan.num_merged, 16)
    back = plan.unmerge(merged)
    # each token receives exactly its destination's merged value
    assert back.shape == x.shape
    for b in range(2):
        dest = plan.dest_tokens[b]
        assert torch.equal(back[b, dest], merged[b])
    # merge after unmerge is the identity (unmerge is the pseudo-inverse of merge)
    y = torch.randn_like(merged)
    assert torch.allclose(plan.merge(plan.unmerge(y)), y, atol=1e-12)


def test_hard_assignment_exact_on_piecewise_constant_tokens():
    # tokens that equal their destination are reproduced exactly by unmerge(merge(x))
    h = w = 8
    x = torch.randn(1, h * w, 4, dtype=torch.float64)
    plan = hard_plan(x, h, w)
    dest = plan.dest_tokens[0]
    x_dest = x[:, dest]
    assert torch.equal(plan.unmerge(plan.merge(x))[:, dest], plan.merge(x))
    clustered = plan.unmerge(x_dest)  # every token replaced by its destination
    assert torch.allclose(plan.unmerge(plan.merge(clustered)), clustered, atol=1e-12)


def test_merge_rows_and_unmerge_rows_sum_to_one():
    x = torch.randn(3, 6 * 10, 8)
    layout = make_layout(6, 10, (4, 4), 0.5)
    plan = build_plan(to_tiles(x, layout), layout, x.dtype, selection="facility", temperature=0.001)
    valid = plan.merge_w.sum(-1)
    used = torch.tensor(layout.keep)[None, :, None] > torch.arange(layout.slots)[None, None, :]
    assert torch.allclose(valid[used.expand_as(valid)], torch.ones(1), atol=1e-5)
    assert torch.all(valid[~used.expand_as(valid)] == 0)
    real = to_tiles(torch.ones(1, 60, 1), layout)[0, :, :, 0].bool()
    rows = plan.unmerge_w.sum(-1)
    assert torch.allclose(rows[real.expand_as(rows)], torch.ones(1), atol=1e-5)


def test_soft_assignment_is_softmax_over_destinations():
    tiles = torch.randn(2, 3, 16, 8)
    sim = cosine_similarity(tiles)
    dest = facility_location(sim, 8)
    a = assignment(sim, dest, 0.1)
    logits = torch.stack([sim[i, j][dest[i, j]] for i in range(2) for j in range(3)]).reshape(2, 3, 8, 16)
    assert torch.allclose(a, torch.softmax(logits / 0.1, dim=-2), atol=1e-6)
    assert torch.allclose(merge(tiles, merge_weights(a)).sum(-2), (merge_weights(a) @ tiles).sum(-2))
    assert unmerge(torch.ones(2, 3, 8, 1), a.transpose(-1, -2)).allclose(torch.ones(2, 3, 16, 1), atol=1e-5)


def test_cpu_plans_hold_no_subnormal_weights():
    # at the default temperature (1e-3) a softmax weight of a token 0.087-0.104 less similar
    # to a destination than to its own is a subnormal float, which slows the CPU's matmuls:
    # the plan's weights must hold none
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 32 * 48, 64, generator=g)
    layout = make_layout(32, 48, (4, 4), 0.5)
    tiles = to_tiles(x, layout)
    sim = cosine_similarity(tiles)
    dest = facility_location(sim, layout.slots)
    logits = sim.gather(-2, dest.unsqueeze(-1).expand(*dest.shape, sim.shape[-1]))
    raw = torch.softmax(logits / 1e-3, dim=-2)
    tiny = torch.finfo(torch.float32).tiny
    assert ((raw > 0) & (raw < tiny)).any()  # the softmax alone does make subnormals here
    plan = build_plan(tiles, layout, torch.float32, selection="facility", temperature=1e-3)
    for w in (plan.merge_w, plan.unmerge_w):
        assert not ((w > 0) & (w < tiny)).any()
    # what was dropped (weights under 2**-100) moves no merged token by more than 2**-96
    # of the largest token it absorbs; float32's rounding alone is 2**-24 of it
    a = assignment(sim, dest, 1e-3)
    assert torch.equal(a, raw.masked_fill(raw < NEGLIGIBLE_WEIGHT, 0.0))
    exact = merge(tiles.double(), merge_weights(raw.double()))
    moved = (merge(tiles.double(), merge_weights(a.double())) - exact).abs().amax(-1)
    assert (moved <= 2.0**-96 * tiles.double().abs().amax((-2, -1))[..., None]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weights_finite(dtype):
    x = (torch.randn(1, 64, 8) * 300).to(dtype)  # large activations, tiny temperature
    layout = make_layout(8, 8, (4, 4), 0.5)
    plan = build_plan(to_tiles(x, layout), layout, dtype, selection="facility", temperature=1e-4)
    out = plan.unmerge(plan.merge(x))
    assert plan.merge_w.dtype == dtype and out.dtype == dtype
    assert torch.isfinite(plan.merge_w).all() and torch.isfinite(out).all()


@pytest.mark.parametrize("temperature", [1e-37, 3e-38, 1e-38, 1e-39])
def test_tiny_temperatures_give_the_hard_assignment(temperature):
    # both sides of the switch from softmax(logits / t) to the explicitly shifted softmax
    # (at t * float32 max = 4, about 1.2e-38): either way a tiny temperature is the argmax
    tiles = torch.randn(2, 3, 16, 8, generator=torch.Generator().manual_seed(5))
    sim = cosine_similarity(tiles)
    dest = facility_location(sim, 8)
    a = assignment(sim, dest, temperature)
    assert torch.equal(a, assignment(sim, dest, 0.0))


@pytest.mark.parametrize("grid, tile", [((3, 6, 10), (2, 4, 4)), ((1, 7, 9), (1, 4, 4))])
def test_padded_grids_move_by_one_gather_each_way(grid, tile):
    # a padded layout's tokens go to tiles by one gather (padded slots then copy their
    # nearest real token, which plans mask out) and back by another; the plan's merge and
    # unmerge equal those through the pad-and-permute copies, bit for bit
    from dataclasses import replace

    from toma.config import ToMAConfig
    from toma.adapters.state import PlanCache
    from toma.core.tiling import from_tiles, layout_index, to_tiles

    t, h, w = grid
    cache = PlanCache(ToMAConfig(ratio=0.5, tile_size=tile[1:], tile_frames=tile[0]), tile[0])
    layout = cache.layout(t, h, w)
    assert layout.padded
    index = layout_index(layout)
    x = torch.randn(2, t * h * w, 8, generator=torch.Generator().manual_seed(0))
    real = index.token_mask
    assert torch.equal(to_tiles(x, layout, index.gather_index)[:, real], to_tiles(x, layout)[:, real])
    tiles = torch.randn(2, layout.num_tiles, layout.tile_area, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(from_tiles(tiles, layout, index.scatter_index), from_tiles(tiles, layout))
    plan = cache.get(x, grid, group="g")
    assert plan.index is not None and plan.index.gather_index is not None
    for selection in ("facility", "grid"):  # the padded slots' contents change no plan
        config = ToMAConfig(ratio=0.5, tile_size=tile[1:], tile_frames=tile[0], selection=selection)
        zero_padded = build_plan(
            to_tiles(x, layout), layout, x.dtype, selection=config.selection, temperature=config.temperature
        )
        gathered = build_plan(
            to_tiles(x, layout, index.gather_index),
            layout,
            x.dtype,
            selection=config.selection,
            temperature=config.temperature,
        )
        assert torch.equal(zero_padded.dest, gathered.dest) and torch.equal(zero_padded.merge_w, gathered.merge_w)
    slow = replace(plan, index=None)
    merged = plan.merge(x)
    assert torch.equal(merged, slow.merge(x))
    assert torch.equal(plan.unmerge(merged), slow.unmerge(merged))
