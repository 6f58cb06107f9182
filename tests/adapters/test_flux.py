"""Flux adapter on a tiny FluxTransformer2DModel."""

from __future__ import annotations

import pytest
import torch

import toma
from tests.tiny_models import flux_inputs, make_flux
from tests.tiny_models import kontext_inputs
from toma.adapters.families.flux import default_blocks
from toma.adapters.grids import ids_grid


def run(model, **kw):
    with torch.no_grad():
        return model(**kw).sample


def record_q(model):
    seen: dict[str, list[int]] = {}
    handles = []
    for name, m in model.named_modules():
        if name.endswith(".attn"):
            handles.append(
                m.to_q.register_forward_hook(lambda mod, a, o, n=name: seen.setdefault(n, []).append(a[0].shape[1]))
            )
    return seen, handles


def test_default_blocks_mirror_the_reference():
    assert default_blocks(19) == tuple(range(5, 19))
    assert default_blocks(38) == tuple(range(5, 38))
    assert default_blocks(2) == (1,)


def test_image_grid_from_ids():
    assert ids_grid(flux_inputs(1, 6, 10)["img_ids"]) == (6, 10)


def test_ratio_zero_and_remove_bitwise(flux):
    kw = flux_inputs(2, 8, 8)
    ref = run(flux, **kw)
    toma.apply_toma(flux, ratio=0.0)
    assert torch.equal(run(flux, **kw), ref)
    toma.apply_toma(flux, ratio=0.5)
    out = run(flux, **kw)
    assert out.shape == ref.shape and not torch.equal(out, ref)
    toma.remove_toma(flux)
    assert torch.equal(run(flux, **kw), ref)
    assert all(type(b.attn.processor).__name__ == "FluxAttnProcessor" for b in flux.transformer_blocks)


def test_only_image_tokens_are_merged(flux):
    text = 5
    kw = flux_inputs(1, 8, 8, text=text)
    patch = toma.apply_toma(flux, ratio=0.5, flux_double_blocks=(0, 1), flux_single_blocks=(1,))
    assert [p.name for p in patch.patched] == [
        "transformer_blocks.0.attn",
        "transformer_blocks.1.attn",
        "single_transformer_blocks.1",
    ]
    seen, handles = record_q(flux)
    ctx_seen: list[int] = []
    handles.append(
        flux.transformer_blocks[0].attn.add_q_proj.register_forward_hook(lambda m, a, o: ctx_seen.append(a[0].shape[1]))
    )
    run(flux, **kw)
    for h in handles:
        h.remove()
    assert seen["transformer_blocks.0.attn"] == [32]  # 64 image tokens -> 32
    assert ctx_seen == [text]  # text stream untouched
    assert seen["single_transformer_blocks.0.attn"] == [text + 64]  # not merged
    assert seen["single_transformer_blocks.1.attn"] == [text + 32]


def test_merged_tokens_take_their_destinations_rotary_position(flux):
    """With every token its own destination and hard assignment, merging is a permutation.

    Attention is permutation-equivariant when each token keeps its rotary position, so
    the output must equal the unmerged model's: this fails if positions are not gathered
    at the destinations.
    """
    kw = flux_inputs(2, 4, 6)
    ref = run(flux, **kw)
    # ratio 0.05 on 2x2 tiles keeps all 4 tokens of each tile, reordered by the greedy
    patch = toma.apply_toma(
        flux, ratio=0.05, tile_size=2, temperature=0, flux_double_blocks=(0, 1), flux_single_blocks=(0, 1)
    )
    out = run(flux, **kw)
    plans = [p for _, p in patch.cache._plans.values()]
    assert plans and all(p.num_merged == 24 for p in plans)
    assert any(not torch.equal(p.dest_tokens, torch.arange(24).expand_as(p.dest_tokens)) for p in plans)
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("h,w", [(6, 10), (7, 5)])
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_grids_and_batches(h, w, batch):
    model = make_flux()
    kw = flux_inputs(batch, h, w)
    ref = run(model, **kw)
    patch = toma.apply_toma(model, ratio=0.5, flux_double_blocks=(0, 1), flux_single_blocks=(0, 1))
    out = run(model, **kw)
    assert out.shape == ref.shape and torch.isfinite(out).all() and not torch.equal(out, ref)
    layout = patch.cache.layout(h, w)
    assert all(p.num_merged == layout.num_merged for _, p in patch.cache._plans.values())
    toma.remove_toma(model)
    assert torch.equal(run(model, **kw), ref)


def test_batch_element_independent_unless_shared(flux):
    kw = flux_inputs(2, 8, 8)
    other = flux_inputs(2, 8, 8, seed=7)["hidden_states"]
    swap1 = {**kw, "hidden_states": torch.stack([kw["hidden_states"][0], other[1]])}
    swap0 = {**kw, "hidden_states": torch.stack([other[0], kw["hidden_states"][1]])}
    toma.apply_toma(flux, ratio=0.5)
    base = run(flux, **kw)
    # per-element plans: an element's output does not depend on the other element
    assert torch.allclose(base[0], run(flux, **swap1)[0], atol=1e-6)
    assert torch.allclose(base[1], run(flux, **swap0)[1], atol=1e-6)
    patch = toma.apply_toma(flux, ratio=0.5, share_batch_plan=True)
    shared = run(flux, **kw)
    assert all(p.merge_w.shape[0] == 1 for _, p in patch.cache._plans.values())
    assert torch.allclose(shared[0], base[0], atol=1e-6)  # element 0's plan is its own
    # element 1 follows element 0's plan, so changing element 0 changes element 1
    assert not torch.allclose(shared[1], run(flux, **swap0)[1], atol=1e-3)


def test_bf16(flux):
    kw = flux_inputs(2, 8, 8)
    toma.apply_toma(flux, ratio=0.5)
    out32 = run(flux, **kw)
    flux.to(torch.bfloat16)
    out = run(flux, **flux_inputs(2, 8, 8, dtype=torch.bfloat16)).float()
    assert torch.isfinite(out).all()
    assert (out - out32).abs().max() < 0.1 * out32.abs().max() + 0.1


@pytest.mark.parametrize("proportional", [False, True])
def test_tile_order_forward_matches_raster_order(flux, monkeypatch, proportional, tile_orders):
    # From the patch embedding to the final norm the image tokens run in tile order (with
    # their rotary rows): the same maths as raster order with per-block reordering.

    kw = flux_inputs(2, 8, 12)
    with torch.no_grad():
        ref = flux(**kw).sample
    conversions = tile_orders
    toma.apply_toma(
        flux, ratio=0.5, flux_double_blocks=(0, 1), flux_single_blocks=(0, 1), proportional_attention=proportional
    )
    with torch.no_grad():
        tiled = flux(**kw).sample
        assert len(conversions) == 2  # the hidden states, once; the rotary row order, once per grid
        tiled_again = flux(**kw).sample
        assert len(conversions) == 3  # the rotary order is kept
        monkeypatch.setattr(toma.adapters.state.PlanCache, "tile_order_layout", lambda self, grid, device=None: None)
        raster = flux(**kw).sample
    assert len(conversions) == 3
    assert torch.equal(tiled, tiled_again)
    assert not torch.allclose(tiled, ref, rtol=1e-4, atol=1e-5)
    assert torch.allclose(tiled, raster, rtol=1e-4, atol=1e-5)
    toma.remove_toma(flux)


def test_controlnet_residuals_keep_raster_order(flux, tile_orders):
    kw = flux_inputs(1, 8, 8)
    residual = [torch.randn(1, 64, flux.inner_dim)]
    toma.apply_toma(flux, ratio=0.5, flux_double_blocks=(0, 1), flux_single_blocks=(0, 1))
    with torch.no_grad():
        plain = flux(**kw, controlnet_block_samples=residual).sample
        assert torch.equal(flux(**kw, controlnet_block_samples=residual).sample, plain)
    assert tile_orders == []  # a controlled forward is never reordered
    toma.remove_toma(flux)


@pytest.mark.parametrize("proportional", [False, True])
@pytest.mark.parametrize("tiled", [True, False], ids=["tile-order", "raster"])
def test_kontext_reference_tokens_pass_whole(monkeypatch, tiled, proportional):
    # A reference image's tokens follow the generated image's; they pass whole, like text.
    # With every token its own destination and hard assignment, merging is a permutation,
    # so the output equals the unpatched model's: reference tokens, their rotary rows and
    # their mask columns must all stay with them through the reorderings.
    kw = kontext_inputs(2, 4, 6, 2, 4)
    model = make_flux()
    blocks = dict(flux_double_blocks=(0, 1), flux_single_blocks=(0, 1), proportional_attention=proportional)
    if not tiled:
        monkeypatch.setattr(toma.adapters.state.PlanCache, "tile_order_layout", lambda self, grid, device=None: None)
    with torch.no_grad():
        ref = model(**kw).sample
        patch = toma.apply_toma(model, ratio=0.05, tile_size=2, temperature=0, **blocks)
        out = model(**kw).sample
        assert patch.cache.base_grid == (1, 4, 6) and all(p.num_merged == 24 for _, p in patch.cache._plans.values())
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        toma.remove_toma(model)
        toma.apply_toma(model, ratio=0.5, **blocks)  # 24 image tokens -> 12, the 8 reference ones whole
        queries = []
        model.transformer_blocks[0].attn.to_q.register_forward_pre_hook(lambda m, a: queries.append(a[0].shape[1]))
        merged = model(**kw).sample
        assert set(queries) == {8 + 12} and merged.shape == ref.shape and torch.isfinite(merged).all()
        toma.remove_toma(model)
        assert torch.equal(model(**kw).sample, ref)
