"""Plans of activations whose squares leave the range of their dtype.

Cosine similarity does not depend on a token's scale, so neither should a plan. But a dot
product of fp16 tokens near 6e4 overflows fp16 (the squares alone reach 3.6e9), and one of
bf16 or fp32 tokens beyond about 1e19 overflows float32 (and so bf16, which has its range);
tokens below about 1e-12 fall under the normalisation's floor. Each of these gives zero
similarities somewhere, and a plan that merges at random.

The tokens here come in well-separated clusters, so that the greedy decides every pick by
a wide margin and the roundings of fp16 and bf16 cannot flip one: the plan at any scale and
in any of these dtypes must choose what the float32 plan of the unscaled tokens chooses.
"""

from __future__ import annotations

import functools

import pytest
import torch

from toma.config import ToMAConfig
from toma.core.merge import assignment, cosine_similarity, destination_mass, merge, merge_weights, unmerge
from toma.core import plan as plan_module
from toma.core.plan import build_plan, finite_or_zero, finite_similarity
from toma.adapters.state import PlanCache
from toma.core.selection import facility_location
from toma.core.tiling import make_layout, to_tiles

GRID = (8, 8)  # four 4x4 tiles, each keeping 8 of its 16 tokens at ratio 0.5
CHANNELS = 32
DELTA = 0.5  # a cluster member's offset from its centre, in units of the centre's length


@functools.cache  # built once (eight QR factorisations): every test reads, none writes
def clustered_tokens(batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, list[list[set[int]]]]:
    """Raster tokens ``(batch, 64, CHANNELS)`` of norm about 1 and, per sample and tile, the
    slots the greedy must pick.

    Each tile holds four clusters of three (a centre ``c`` and ``c +- DELTA * v``, with
    ``v`` orthogonal to ``c``) and four lone tokens, all along orthogonal directions, rotated
    at random and put in random slots. The greedy's gains (toma.core.selection: sums of
    similarities to the cover) then differ by wide margins at every step: a centre
    gains 0.29 more than its cluster's members (cosines 0.89 to the centre, 0.6 between
    members), the four centres come first, then the four lone tokens, each gaining 1 where a
    covered member gains 0.11. Rounding to bf16 (8 bits) moves a cosine by about 1e-2 at
    most, far less than any of these.
    """
    g = torch.Generator().manual_seed(seed)
    layout = make_layout(*GRID, (4, 4), 0.5)
    tokens = torch.empty(batch, layout.num_tiles, layout.tile_area, CHANNELS)
    picks: list[list[set[int]]] = []
    eye = torch.eye(CHANNELS)
    for b in range(batch):
        picks.append([])
        for t in range(layout.num_tiles):
            rows, chosen = [], []
            for c in range(4):  # directions 0-3: centres, 4-7: their offsets, 8-11: lone tokens
                centre, offset = eye[c], DELTA * eye[4 + c]
                chosen.append(len(rows))
                rows += [centre, centre + offset, centre - offset]
            for c in range(4):
                chosen.append(len(rows))
                rows.append(eye[8 + c])
            rotation, _ = torch.linalg.qr(torch.randn(CHANNELS, CHANNELS, generator=g))
            slots = torch.randperm(16, generator=g)  # row i goes to slot slots[i]
            tokens[b, t, slots] = torch.stack(rows) @ rotation
            picks[-1].append({int(slots[i]) for i in chosen})
    # tiles back to raster order: the inverse of to_tiles for this unpadded layout
    raster = tokens.view(batch, layout.gh, layout.gw, 4, 4, CHANNELS).permute(0, 1, 3, 2, 4, 5)
    return raster.reshape(batch, layout.num_tokens, CHANNELS), picks


def at_scale(x: torch.Tensor, scale: float, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """``x`` with each token scaled by ``scale`` times a factor in [0.5, 1] (cosines do not
    change), in ``dtype``; every value stays finite there (fp16: |x| < 65504)."""
    g = torch.Generator().manual_seed(seed)
    factors = 0.5 + 0.5 * torch.rand(*x.shape[:-1], 1, generator=g, dtype=torch.float64)
    out = (x.double() * factors * scale).to(dtype)
    assert torch.isfinite(out).all()
    return out


# (dtype, scale): fp16 near its largest values (65504), whose squares overflow fp16; bf16 and
# fp32 whose squares overflow float32, and whose norms fall under 1e-12; bf16 at fp16's scale
CASES = [
    (torch.float16, 6.5e4),
    (torch.bfloat16, 6.5e4),
    (torch.bfloat16, 1e25),
    (torch.bfloat16, 1e37),
    (torch.bfloat16, 1e-20),
    (torch.float32, 1e25),
    (torch.float32, 1e-25),
    (torch.float32, 1.0),
]
IDS = [f"{str(d).split('.')[-1]}-{s:g}" for d, s in CASES]


def tile_picks(dest: torch.Tensor) -> list[list[set[int]]]:
    return [[set(tile.tolist()) for tile in sample] for sample in dest]


def test_the_clusters_give_the_picks_they_were_built_for():
    # the reference itself: float32 tokens of norm 1
    x, picks = clustered_tokens()
    layout = make_layout(*GRID, (4, 4), 0.5)
    plan = build_plan(to_tiles(x, layout), layout, torch.float32, selection="facility", temperature=0.001)
    assert tile_picks(plan.dest) == picks
    assert sorted(plan.mass[0].tolist()) == [1.0] * 16 + [3.0] * 16  # each cluster into its centre


@pytest.mark.parametrize("dtype,scale", CASES, ids=IDS)
def test_similarities_do_not_overflow(dtype, scale):
    x, _ = clustered_tokens()
    layout = make_layout(*GRID, (4, 4), 0.5)
    ref = cosine_similarity(to_tiles(x, layout))
    sim = cosine_similarity(to_tiles(at_scale(x, scale, dtype), layout))
    assert sim.dtype == torch.float32 and torch.isfinite(sim).all()
    # rounding each component by a relative u moves a cosine by at most about 4u (u = 2**-11
    # for fp16, 2**-8 for bf16): twice that here; float32's rounding of the sums over 32
    # channels stays under 1e-5. Over 40 seeds the largest moves were a tenth of these.
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(sim, ref, rtol=0, atol=tol)


@pytest.mark.parametrize("dtype,scale", CASES, ids=IDS)
@pytest.mark.parametrize("temperature", [1e-3, 0.0])
def test_plans_pick_what_the_float32_plan_picks(dtype, scale, temperature):
    x, picks = clustered_tokens()
    layout = make_layout(*GRID, (4, 4), 0.5)
    config = ToMAConfig(ratio=0.5, temperature=temperature)
    ref = build_plan(
        to_tiles(x, layout), layout, torch.float32, selection=config.selection, temperature=config.temperature
    )
    xs = at_scale(x, scale, dtype)
    plan = build_plan(to_tiles(xs, layout), layout, dtype, selection=config.selection, temperature=config.temperature)
    assert tile_picks(plan.dest) == picks == tile_picks(ref.dest)
    for t in (plan.merge_w, plan.unmerge_w, plan.mass, plan.log_mass):
        assert torch.isfinite(t).all()
    # every token belongs to its cluster's centre by a cosine margin of 0.89 (over 890
    # temperatures), so the soft assignment is the hard one to float32's precision: the
    # masses are exactly 3 and 1
    assert torch.equal(plan.mass.sort(-1).values, ref.mass.sort(-1).values)
    # merged tokens are means of tokens that fit the dtype, and unmerged ones copies of those
    merged = plan.merge(xs)
    out = plan.unmerge(merged)
    assert merged.dtype == out.dtype == dtype and torch.isfinite(merged).all() and torch.isfinite(out).all()


@pytest.mark.parametrize("dtype,scale", CASES, ids=IDS)
def test_plan_cache_plans_pick_what_the_float32_plan_picks(dtype, scale):
    x, picks = clustered_tokens()
    xs = at_scale(x, scale, dtype)
    cache = PlanCache(ToMAConfig(ratio=0.5))
    # tile order (the layout divides the grid), as the families run it, and raster order
    for tiled in (True, False):
        cache.begin_forward((1, *GRID), None)
        layout = cache.tile_order_layout((1, *GRID))
        tokens = to_tiles(xs, layout).flatten(1, 2) if tiled else xs
        plan = cache.get(tokens, (1, *GRID), "group", tiled=tiled)
        assert plan.dtype == dtype and tile_picks(plan.dest) == picks
        assert torch.isfinite(plan.log_mass).all() and torch.isfinite(plan.merge(tokens, tiled=tiled)).all()


@pytest.mark.parametrize("dtype,scale", CASES, ids=IDS)
def test_the_core_functions_step_by_step(dtype, scale):
    # similarity, greedy, assignment, weights, merge and unmerge, as build_plan chains them
    x, picks = clustered_tokens()
    layout = make_layout(*GRID, (4, 4), 0.5)
    tiles = to_tiles(at_scale(x, scale, dtype), layout)
    sim = cosine_similarity(tiles)
    dest = facility_location(sim, layout.slots)
    assert tile_picks(dest) == picks
    a = assignment(sim, dest, 1e-3)
    mass = destination_mass(a)
    weights = merge_weights(a, mass).to(dtype)
    merged = merge(tiles, weights)
    out = unmerge(merged, a.to(dtype).transpose(-1, -2))
    assert all(torch.isfinite(t).all() for t in (a, mass, weights, merged, out))
    # the assignment is hard (margins of 890 temperatures: the rest underflow to 0)
    assert torch.equal(a, (a > 0.5).float())
    # so each token comes back as its cluster's mean: that of float64 but for the dtype's
    # rounding of the weights (1/3) and of the sums, about 2 units of its last place
    # relative to the token's largest component; 4 allowed (fp32: its matmul's rounding, 1e-6)
    ref = unmerge(merge(tiles.double(), merge_weights(a, mass).double()), a.double().transpose(-1, -2))
    error = ((out.double() - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()
    assert error <= {torch.float16: 4 * 2**-11, torch.bfloat16: 4 * 2**-8, torch.float32: 1e-6}[dtype], error


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_tokens_in_range_give_bitwise_the_unscaled_similarities(dtype):
    # the scaling is by powers of two, which is exact: where the squares fit float32 it
    # changes no bit of what normalising the tokens as they are gives
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 16, 40, generator=g, dtype=torch.float64)
    x = (x * torch.logspace(-6, 8, 16, dtype=torch.float64)[:, None]).to(dtype)  # a scale per token
    unit = torch.nn.functional.normalize(x.float(), dim=-1)
    assert torch.equal(cosine_similarity(x), unit @ unit.transpose(-1, -2))


def full_path_spy(monkeypatch) -> list[torch.Tensor]:
    """Record each call of the full path (cleaning, then scaling) in finite_similarity."""
    calls: list[torch.Tensor] = []
    real = plan_module.finite_or_zero
    monkeypatch.setattr(plan_module, "finite_or_zero", lambda x: calls.append(x) or real(x))
    return calls


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_cpu_shortcut_gives_bitwise_the_full_paths_similarities(dtype, monkeypatch):
    # tokens in range are normalised as they are, with no cleaning or scaling pass: a
    # speed-up only, so every bit must match what the full path gives
    g = torch.Generator().manual_seed(5)
    spread = (-3, 4) if dtype == torch.float16 else (-6, 8)  # norms up to 1e4 * sqrt(40): fp16's range
    x = torch.randn(2, 6, 16, 40, generator=g, dtype=torch.float64)
    x = (x * torch.logspace(*spread, 16, dtype=torch.float64)[:, None]).to(dtype)
    full = cosine_similarity(finite_or_zero(x))
    calls = full_path_spy(monkeypatch)
    assert torch.equal(finite_similarity(x), full)
    assert calls == []  # the shortcut ran


@pytest.mark.parametrize("bad", ["nan", "inf", "zero", "tiny", "huge"])
def test_tokens_out_of_range_take_the_full_path(bad, monkeypatch):
    # one such token anywhere sends the whole call down the full path, whose cleaning and
    # scaling it needs: a zero row could be an underflowed tiny one, a huge one's squares
    # may overflow
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 6, 16, 40, generator=g)
    if bad in ("nan", "inf"):
        x[1, 2, 3, 7] = float(bad)
    else:
        x[1, 2, 3] *= {"zero": 0.0, "tiny": 1e-12, "huge": 1e12}[bad]
    full = cosine_similarity(finite_or_zero(x))
    calls = full_path_spy(monkeypatch)
    sim = finite_similarity(x)
    assert len(calls) == 1 and torch.equal(sim, full) and torch.isfinite(sim).all()
    if bad == "tiny":  # the scaled path keeps its direction: a unit self-similarity
        assert sim[1, 2, 3, 3].item() == pytest.approx(1.0, abs=1e-6)
