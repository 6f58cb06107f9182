"""The Triton kernels (toma.kernels) against the torch path, run by the Triton interpreter.

Skipped where triton is not installed. The interpreter runs the kernels on CPU tensors
with numpy, one program at a time, so the cases are small.

Tolerances: the kernels and torch sum the same float32 products in different orders.
For weights that sum to 1 over at most 16 terms of unit-scale tokens, each result is off
by a few units in the last place of its largest term: 1e-6 (float32 eps is 1.2e-7) for
the weights, 1e-5 for merged and unmerged tokens. Destinations are compared exactly.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")  # conftest.py has set TRITON_INTERPRET=1 before triton loaded

from toma.config import ToMAConfig  # noqa: E402
from toma.core.merge import assignment, cosine_similarity, destination_mass, merge_weights  # noqa: E402
from toma.core.plan import build_fused_plan, build_plan
from toma.adapters.state import PlanCache  # noqa: E402
from toma.core.selection import facility_location  # noqa: E402
from toma.core.tiling import kernel_index, layout_index, make_layout, tile_order, to_tiles  # noqa: E402
from toma.kernels import KERNELS_ENV, use_triton  # noqa: E402
from toma.kernels.triton_ops import plan_tiles  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TRITON_INTERPRET was set to something else before triton loaded", allow_module_level=True)


def tokens(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def run_plan_kernel(tiles: torch.Tensor, k: int, temperature: float, mask=None, keep=None):
    """The plan kernel on tiles ``(G, T, n, C)`` read in tile order; also returns its similarities."""
    g, t, n, _ = tiles.shape
    src = torch.arange(t * n, dtype=torch.int32).view(t, n)
    return plan_tiles(tiles.flatten(1, 2), src, k, temperature, torch.float32, mask, keep, save_sim=True)


@pytest.mark.parametrize("n,k", [(16, 8), (9, 3), (16, 1), (12, 11), (25, 13)])
def test_plan_kernel_picks_the_torch_greedy_destinations(n, k):
    tiles = tokens(2, 6, n, 5, seed=n * 31 + k)
    dest, a, mw, mass, log_mass, sim = run_plan_kernel(tiles, k, 0.1)
    # the similarities: one float32 Gram matrix, normalised after rather than before
    assert torch.allclose(sim, cosine_similarity(tiles), atol=1e-6, rtol=0)
    # on the same similarities, exactly the torch greedy's picks (same scores, same ties)
    assert torch.equal(dest, facility_location(sim, k))
    ref = assignment(sim, dest, 0.1)
    assert torch.allclose(a, ref, atol=1e-6, rtol=0)
    assert torch.allclose(mw, merge_weights(ref), atol=1e-6, rtol=0)
    assert torch.allclose(mass, destination_mass(ref).squeeze(-1), atol=1e-5, rtol=0)
    assert torch.allclose(log_mass, mass.log(), atol=1e-6, rtol=0)


def test_plan_kernel_ties_and_duplicates():
    # 16 tokens with only 3 distinct directions (and one zero and one non-finite token):
    # most gains tie exactly, and after 3 picks every remaining candidate gains nothing;
    # the lowest unpicked index must win each time
    base = tokens(1, 3, 4, seed=1)
    x = base[:, torch.tensor([0, 1, 2, 1, 0, 2, 2, 1, 0, 0, 1, 2, 1, 0, 2, 1])].clone()
    x[0, 5] = 0.0
    x[0, 9, 2] = float("nan")
    dest, *_, sim = run_plan_kernel(x[:, None], 8, 0.001)
    clean = torch.nan_to_num(x, nan=0.0)
    assert torch.allclose(sim, cosine_similarity(clean)[:, None], atol=1e-6, rtol=0)
    assert torch.equal(dest, facility_location(sim, 8))
    assert len(set(dest.flatten().tolist())) == 8


def test_plan_kernel_on_padded_tiles_with_fewer_real_tokens_than_slots():
    # 5x6 grid, 4x4 tiles: edge tiles hold 4, 8 and 2 real tokens and keep fewer slots;
    # the last tile runs out of real candidates (as in the torch path, picks go to slot 0)
    layout = make_layout(5, 6, (4, 4), 0.25)
    index = layout_index(layout)
    tiles = to_tiles(tokens(2, 30, 6, seed=2), layout)
    kidx = kernel_index(layout)
    for temperature in (0.0, 0.05):
        dest, a, mw, mass, log_mass, sim = run_plan_kernel(
            tiles, layout.slots, temperature, index.token_mask, kidx.keep
        )
        assert torch.equal(dest, facility_location(sim, layout.slots, index.token_mask))
        ref = assignment(sim, dest, temperature, index.token_mask, index.slot_mask)
        if temperature == 0:
            assert torch.equal(a, ref)
        else:
            assert torch.allclose(a, ref, atol=1e-6, rtol=0)
        assert torch.allclose(mw, merge_weights(ref), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "h,w,ratio,batch,share", [(8, 8, 0.5, 2, False), (6, 10, 0.5, 2, True), (5, 7, 0.75, 1, False)]
)
def test_fused_merge_and_unmerge_match_the_torch_path(h, w, ratio, batch, share):
    layout = make_layout(h, w, (4, 4), ratio)
    x = tokens(batch, h * w, 40, seed=h * w)  # 40 channels: a partial channel block
    src = x[:1] if share else x
    index, kidx = layout_index(layout), kernel_index(layout)
    fused = build_fused_plan(src, False, layout, x.dtype, index, kidx, temperature=0.001)
    torch_path = dataclasses.replace(fused, kernels=None)  # the same weights, applied by torch
    merged = torch_path.merge(x)
    assert torch.allclose(fused.merge(x), merged, atol=1e-5, rtol=0)
    assert torch.allclose(fused.unmerge(merged), torch_path.unmerge(merged), atol=1e-5, rtol=0)
    if not layout.padded:  # tokens kept in tile order, as the adapters run unpadded grids
        tiled = tile_order(x, layout)
        assert torch.allclose(fused.merge(tiled, tiled=True), merged, atol=1e-5, rtol=0)
        assert torch.allclose(
            fused.unmerge(merged, tiled=True), torch_path.unmerge(merged, tiled=True), atol=1e-5, rtol=0
        )
    # with the block's residual added in the same launch: the float32 sum rounded once,
    # as the separate add rounds it
    res = tokens(batch, h * w, 40, seed=h * w + 1)
    unmerged = fused.unmerge(merged)
    assert torch.equal(fused.unmerge(merged, residual=res), unmerged + res)
    assert torch.allclose(torch_path.unmerge(merged, residual=res), unmerged + res, atol=1e-5, rtol=0)
    if not layout.padded:  # the torch path's baddbmm in tile order
        res_t = tile_order(res, layout)
        tiled_sum = fused.unmerge(merged, tiled=True) + res_t
        assert torch.equal(fused.unmerge(merged, tiled=True, residual=res_t), tiled_sum)
        assert torch.allclose(torch_path.unmerge(merged, tiled=True, residual=res_t), tiled_sum, atol=1e-5, rtol=0)
    # the plan read from raster order is the plan read from tiles
    from_tiles = build_plan(
        to_tiles(src, layout), layout, x.dtype, selection="facility", temperature=0.001, index=index, kernels=kidx
    )
    assert torch.equal(from_tiles.dest, fused.dest) and torch.equal(from_tiles.merge_w, fused.merge_w)


def test_fused_merge_reads_a_strided_slice_and_half_precision():
    # Flux merges the image part of a text+image sequence: a slice, not contiguous
    layout = make_layout(4, 8, (4, 4), 0.5)
    full = tokens(2, 5 + 32, 16, seed=7)
    x = full[:, 5:]
    index, kidx = layout_index(layout), kernel_index(layout)
    fused = build_fused_plan(x, False, layout, x.dtype, index, kidx, temperature=0.001)
    contiguous = build_fused_plan(x.contiguous(), False, layout, x.dtype, index, kidx, temperature=0.001)
    assert torch.equal(fused.merge_w, contiguous.merge_w)
    assert torch.allclose(fused.merge(x), dataclasses.replace(fused, kernels=None).merge(x), atol=1e-5, rtol=0)
    half = x.half()
    fused_h = build_fused_plan(half, False, layout, half.dtype, index, kidx, temperature=0.001)
    torch_h = dataclasses.replace(fused_h, kernels=None)
    assert fused_h.merge_w.dtype == torch.float16
    # fp16 outputs: each within one fp16 rounding (eps 2**-10) of unit-scale tokens, plus
    # float32 summation-order noise
    merged = torch_h.merge(half)
    assert fused_h.merge(half).dtype == torch.float16
    assert torch.allclose(fused_h.merge(half).float(), merged.float(), atol=4e-3, rtol=0)
    assert torch.allclose(fused_h.unmerge(merged).float(), torch_h.unmerge(merged).float(), atol=4e-3, rtol=0)
    # a float32 residual under half-precision tokens: the add promotes, as the block's own would
    res = tokens(2, 32, 16, seed=8)
    for plan in (fused_h, torch_h):
        out = plan.unmerge(merged, residual=res)
        assert out.dtype == torch.float32 and torch.equal(out, plan.unmerge(merged) + res)


def test_plan_cache_switch(monkeypatch):
    x = tokens(1, 64, 8, seed=3)
    # the two paths' similarities differ by float32 rounding (~1e-7), which the weights
    # amplify by 1 / temperature: 0.1 keeps that well inside the 1e-5 compared below
    config = ToMAConfig(temperature=0.1)
    monkeypatch.setenv(KERNELS_ENV, "triton")
    cache = PlanCache(config)
    cache.begin_forward((8, 8), None)
    fused = cache.get(x, (8, 8), group="g")
    assert fused.kernels is not None and cache.tile_order_layout((8, 8), x.device) is None
    monkeypatch.setenv(KERNELS_ENV, "torch")
    cache = PlanCache(config)
    cache.begin_forward((8, 8), None)
    ref = cache.get(x, (8, 8), group="g")
    assert ref.kernels is None and cache.tile_order_layout((8, 8), x.device) is not None
    assert torch.equal(fused.dest, ref.dest)
    assert torch.allclose(fused.unmerge(fused.merge(x)), ref.unmerge(ref.merge(x)), atol=1e-5, rtol=0)
    monkeypatch.setenv(KERNELS_ENV, "auto")
    assert not use_triton(torch.device("cpu"))  # auto: CUDA only
    monkeypatch.setenv(KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match="TOMA_KERNELS must be one of auto, torch, triton"):
        use_triton(torch.device("cpu"))


def test_forced_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        use_triton(torch.device("cpu"))


@pytest.mark.parametrize(
    "family,h,w", [("sdxl", 16, 16), ("sdxl", 10, 14), ("sd3", 16, 16)]
)  # tile order / padded raster order on torch
def test_forward_with_the_kernels_matches_the_torch_path(monkeypatch, family, h, w):
    from tiny_models import make_sd3, make_sdxl_unet, sd3_inputs, unet_inputs

    model = make_sdxl_unet() if family == "sdxl" else make_sd3()
    kw = unet_inputs(2, h, w, sdxl=True) if family == "sdxl" else sd3_inputs(2, h, w)
    # the same plans; merges differ by float32 summation order only (~1e-7 per op on
    # unit-scale activations; under 1e-6 seen through the blocks of these random models),
    # while merging itself moves the output by ~1e-2
    assert_kernels_match_torch_path(monkeypatch, model, kw, {})


def assert_kernels_match_torch_path(monkeypatch, model, kw, options):
    """ToMA's output on the Triton path is the torch path's within 1e-5, and merging moves it."""
    import toma

    out = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv(KERNELS_ENV, mode)
        toma.apply_toma(model, ratio=0.5, **options)
        with torch.no_grad():
            out[mode] = model(**kw).sample
        toma.remove_toma(model)
    assert torch.allclose(out["triton"], out["torch"], atol=1e-5, rtol=0)
    with torch.no_grad():
        assert (out["torch"] - model(**kw).sample).abs().max() > 1e-3


def test_merges_that_need_a_gradient_take_the_torch_path():
    layout = make_layout(8, 8, (4, 4), 0.5)
    x = tokens(1, 64, 16, seed=9)
    plan = build_fused_plan(x, False, layout, x.dtype, layout_index(layout), kernel_index(layout), temperature=0.001)
    leaf = x.clone().requires_grad_(True)
    out = plan.unmerge(plan.merge(leaf))
    out.sum().backward()
    # the torch path's gradient: d/dx sum(U M x) = M^T U^T 1 per channel
    ref = dataclasses.replace(plan, kernels=None)
    leaf_ref = x.clone().requires_grad_(True)
    ref.unmerge(ref.merge(leaf_ref)).sum().backward()
    assert leaf.grad is not None and torch.equal(leaf.grad, leaf_ref.grad)


def test_kontext_call_on_the_triton_path_matches_the_torch_path(monkeypatch):
    # an editing call (reference tokens after the image's) merges from raster order with
    # the kernels, the reference passing whole: the torch path's output up to summation order
    from tiny_models import make_flux
    from tiny_models import kontext_inputs

    blocks = dict(flux_double_blocks=(0, 1), flux_single_blocks=(0, 1))
    assert_kernels_match_torch_path(monkeypatch, make_flux(), kontext_inputs(2, 8, 8, 4, 4), blocks)


@pytest.mark.parametrize("power", [80, -90])
def test_plan_kernel_is_exact_for_tokens_far_out_of_range(power):
    # 2**80 and 2**-90 are exact scales in float32: squares past float32's range (2**160),
    # or norms under normalize's 1e-12 floor, must not change the plan, since cosine
    # similarity does not see a token's scale. The kernel divides each row by its power of
    # two first, so its results are bitwise those of the unscaled tokens.
    tiles = tokens(2, 4, 16, 24, seed=11)
    ref = run_plan_kernel(tiles, 8, 0.05)
    far = run_plan_kernel(tiles * 2.0**power, 8, 0.05)
    for got, want in zip(far, ref):
        assert torch.equal(got, want)
