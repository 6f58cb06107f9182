"""Transformer families on the adapter engine (SD3, Wan) on tiny models with random weights."""

from __future__ import annotations

import math

import pytest
import torch

import toma
from tests.cases import duplicated_video
from tests.tiny_models import (
    ltx_inputs,
    make_ltx,
    make_pixart,
    make_sd3,
    make_wan,
    pixart_inputs,
    sd3_inputs,
    wan_inputs,
)

ALL_SD3 = {"blocks": {"transformer_blocks": range(4)}}
ALL_WAN = {"blocks": {"blocks": range(3)}}
ALL_3 = {"blocks": {"transformer_blocks": range(3)}}


def run(model, **kw):
    with torch.no_grad():
        return model(**kw).sample


def count_queries(model, suffixes):
    """Token counts reaching ``to_q`` of every attention whose name ends with one of ``suffixes``."""
    seen: list[int] = []
    handles = [
        m.to_q.register_forward_hook(lambda mod, a, o: seen.append(a[0].shape[1]))
        for name, m in model.named_modules()
        if name.endswith(suffixes) and hasattr(m, "to_q")
    ]
    return seen, handles


FAMILIES = {  # family -> (model maker, inputs(batch, latent height, latent width), every block)
    "sd3": (make_sd3, lambda b=2, h=16, w=20: sd3_inputs(b, h, w), ALL_SD3),
    "wan": (make_wan, lambda b=2, h=12, w=16: wan_inputs(b, 4, h, w), ALL_WAN),
    "pixart": (make_pixart, lambda b=2, h=16, w=20: pixart_inputs(b, h, w), ALL_3),
    "ltx": (make_ltx, lambda b=2, h=12, w=16: ltx_inputs(b, 4, h // 2, w // 2), ALL_3),
}


def test_sd3_default_skips_the_first_blocks():
    model = make_sd3(layers=12, dual=())
    patch = toma.apply_toma(model, ratio=0.5)
    assert [p.name for p in patch.patched] == [f"transformer_blocks.{i}.attn" for i in range(5, 12)]
    assert all(s.reason == "not among the merged blocks" for s in patch.skipped)


def test_wan_merges_video_self_attention_and_keeps_text_whole():
    model = make_wan()
    kw = wan_inputs(1, 4, 12, 16, text=5)  # 4 x 6 x 8 tokens
    patch = toma.apply_toma(model, ratio=0.5, merge_crossattn=True, tile_size=4, **ALL_WAN)
    queries, handles = count_queries(model, (".attn1", ".attn2"))
    keys: list[int] = []
    handles += [b.attn2.to_k.register_forward_hook(lambda m, a, o: keys.append(a[0].shape[1])) for b in model.blocks]
    run(model, **kw)
    for h in handles:
        h.remove()
    layout = patch.cache.layout(4, 6, 8)
    assert (layout.tt, layout.th, layout.tw) == (1, 4, 4)  # 2-D tiles by default
    assert queries == [layout.num_merged] * 6 == [96] * 6
    assert keys == [5] * 3  # cross-attention keys are the text, whole


@pytest.mark.parametrize("frames,h,w", [(1, 12, 16), (3, 10, 14), (5, 8, 20)])
@pytest.mark.parametrize("tile_frames", [None, 2])  # the default 2-D tiles, and 2-frame tiles that pad odd counts
def test_wan_frames_and_grids_the_tiles_do_not_divide(frames, h, w, tile_frames):
    model = make_wan()
    kw = wan_inputs(2, frames, h, w)
    ref = run(model, **kw)
    patch = toma.apply_toma(model, ratio=0.5, tile_frames=tile_frames, **ALL_WAN)
    queries, handles = count_queries(model, (".attn1",))
    out = run(model, **kw)
    for handle in handles:
        handle.remove()
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert queries == [patch.cache.layout(frames, h // 2, w // 2).num_merged] * 3


def test_wan_proportional_attention_is_exact_on_duplicate_tokens():
    # 4 distinct tokens per tile and 4 destinations: merging loses nothing, and with the
    # log(mass) bias the kept copy of the 5-fold token draws the attention its 5 copies
    # did, so merged self-attention computes what unmerged self-attention does
    model = make_wan(layers=2)
    model.rope.freqs_cos.fill_(1.0)  # no positions: copies are duplicates for attention too
    model.rope.freqs_sin.fill_(0.0)
    kw = wan_inputs(1, 2, 8, 8)
    kw["hidden_states"] = duplicated_video()
    ref = run(model, **kw)
    options = dict(ratio=0.5, tile_size=2, tile_frames=2, blocks={"blocks": range(2)})
    toma.apply_toma(model, proportional_attention=True, **options)
    exact = run(model, **kw)
    toma.apply_toma(model, proportional_attention=False, **options)
    plain = run(model, **kw)
    torch.testing.assert_close(exact, ref, rtol=1e-4, atol=1e-5)
    assert (plain - ref).abs().max() > 1e-3  # without the bias the 5-fold token is under-weighted


def test_proportional_attention_is_refused_where_a_site_cannot_take_the_bias(monkeypatch):
    # every family's attention takes the bias today; a spec whose site declares neither a
    # mask nor a bias route is refused under True, with the module named, and runs without
    # the bias under None
    import dataclasses

    from toma.adapters.families import sd3
    from toma.adapters.spec import Site

    spec = dataclasses.replace(sd3.SPEC, sites=lambda stack, block: [Site("attn", "attn")])
    monkeypatch.setattr(sd3, "SPEC", spec)
    with pytest.raises(ValueError, match=r"needs an attention mask, which sd3.s transformer_blocks.3.attn cannot"):
        toma.apply_toma(make_sd3(layers=6), proportional_attention=True)
    toma.apply_toma(make_sd3(layers=6), proportional_attention=None)


def test_unknown_stack_and_index_are_clear_errors():
    model = make_wan()
    with pytest.raises(ValueError, match="does not have; its block stacks are \\['blocks'\\]"):
        toma.apply_toma(model, blocks={"transformer_blocks": [0]})
    with pytest.raises(ValueError, match=r"blocks\['blocks'\] must hold indices in \[0, 2\]"):
        toma.apply_toma(model, blocks={"blocks": [3]})
    # options of other kinds of model would do nothing here: refused, not ignored
    with pytest.raises(ValueError, match="mlp_levels applies to UNets only"):
        toma.apply_toma(model, merge_mlp=True, levels=2, mlp_levels=(2,))
    with pytest.raises(ValueError, match="levels applies to UNets only"):
        toma.apply_toma(model, levels=2)
    with pytest.raises(ValueError, match="tile_frames applies to video families only"):
        toma.apply_toma(make_sd3(), tile_frames=2)
    toma.apply_toma(make_sd3(), tile_frames=1)  # 1 is what image families do anyway
    assert toma.get_toma(model) is None and not hasattr(model, "_diffusers_hook")


def test_sd3_controlnet_residuals_stay_in_raster_order(tile_orders):
    model = make_sd3()
    kw = sd3_inputs(1, 16, 16)
    toma.apply_toma(model, ratio=0.5, **ALL_SD3)
    residuals = [torch.randn(1, 64, model.inner_dim, generator=torch.Generator().manual_seed(3))] * 2
    out = run(model, **kw, block_controlnet_hidden_states=residuals)
    assert tile_orders == [] and torch.isfinite(out).all()
    toma.remove_toma(model)
    unmerged = run(model, **kw, block_controlnet_hidden_states=residuals)
    assert not torch.equal(out, unmerged)  # merged all the same, in raster order


def test_kept_token_count_follows_ratio():
    model = make_wan()
    for ratio in (0.25, 0.75):
        toma.apply_toma(model, ratio=ratio, **ALL_WAN)
        queries, handles = count_queries(model, (".attn1",))
        run(model, **wan_inputs(1, 4, 16, 16))
        for h in handles:
            h.remove()
        # 4 x 8 x 8 tokens in 2 x 4 x 4 tiles of 32: each keeps round(32 * (1 - ratio))
        assert queries == [8 * math.floor(32 * (1 - ratio) + 0.5)] * 3


@pytest.mark.parametrize("family", ["pixart", "ltx"])
def test_cross_attention_queries_merge_under_a_text_mask(family):
    # the text mask covers the keys (text, whole): merged queries keep it
    make, inputs, blocks = FAMILIES[family]
    model, kw = make(), inputs(1, 16, 16)
    ref = run(model, **kw)
    patch = toma.apply_toma(model, ratio=0.5, merge_attn=False, merge_crossattn=True, **blocks)
    queries, handles = count_queries(model, (".attn2",))
    keys: list[int] = []
    handles += [
        b.attn2.to_k.register_forward_hook(lambda m, a, o: keys.append(a[0].shape[1])) for b in model.transformer_blocks
    ]
    out = run(model, **kw)
    for h in handles:
        h.remove()
    kept = patch.cache.layout(*((4, 8, 8) if family == "ltx" else (1, 8, 8))).num_merged
    assert queries == [kept] * 3 and keys == [5] * 3
    assert torch.isfinite(out).all() and not torch.equal(out, ref)


def test_known_unsupported_families_are_refused_with_why():
    from diffusers import SanaTransformer2DModel

    torch.manual_seed(0)
    model = SanaTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=16,
        sample_size=8,
        patch_size=1,
    )
    with pytest.raises(ValueError, match="SanaTransformer2DModel: its attention is linear"):
        toma.apply_toma(model)
    assert not hasattr(model, "_diffusers_hook")
    with pytest.raises(ValueError, match="WanTransformer3DModel"):  # an unknown module lists the supported ones
        toma.apply_toma(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("family", ["flux", "wan", "ltx"])
def test_set_attention_backend_reaches_merged_attention(family, monkeypatch):
    # merged attention runs through diffusers' dispatcher with the backend the user set,
    # before or after apply_toma
    import importlib

    from tests.tiny_models import flux_inputs, make_flux

    module = importlib.import_module(
        {
            "flux": "diffusers.models.transformers.transformer_flux",
            "wan": "diffusers.models.transformers.transformer_wan",
            "ltx": "diffusers.models.transformers.transformer_ltx",
        }[family]
    )
    if family == "flux":
        model, kw, opts = make_flux(), flux_inputs(1, 8, 8), dict(flux_double_blocks=(0, 1), flux_single_blocks=(0, 1))
    else:
        make, inputs, opts = FAMILIES[family]
        model, kw = make(), inputs(1, 16, 16)
    seen = []
    real = module.dispatch_attention_fn
    monkeypatch.setattr(
        module,
        "dispatch_attention_fn",
        lambda *a, backend=None, **k: seen.append((a[0].shape[1], backend)) or real(*a, backend=backend, **k),
    )
    with torch.no_grad():
        ref = model(**kw).sample
        toma.apply_toma(model, ratio=0.5, **opts)
        model.set_attention_backend("_native_math")
        seen.clear()
        merged = model(**kw).sample
    merged_calls = [(n, b) for n, b in seen if n < ref.shape[1] or family != "flux"]
    assert merged_calls and all(str(b) == "AttentionBackendName._NATIVE_MATH" for _, b in seen)
    assert not torch.allclose(merged, ref, rtol=1e-4, atol=1e-5)
