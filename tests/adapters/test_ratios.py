"""Separate ratios for self-attention, cross-attention queries and the MLP."""

from __future__ import annotations

import pytest
import torch

import toma
from tests.tiny_models import flux_inputs, make_flux, make_sd15_unet, make_wan, unet_inputs, wan_inputs

WAN_ALL = {"blocks": {"blocks": range(3)}}


def run(model, kw):
    with torch.no_grad():
        return model(**kw)[0]


def record(model, paths):
    """Token counts each named sub-module's forward sees, per suffix. (The merged modules'
    own pre-hooks run before ToMA's merge: these are modules inside them.)"""
    seen: dict[str, list[int]] = {p: [] for p in paths}
    handles = []
    for name, module in model.named_modules():
        for p in paths:
            if name.endswith(p):
                handles.append(
                    module.register_forward_pre_hook(
                        lambda m, a, kw, p=p: seen[p].append((a[0] if a else kw["hidden_states"]).shape[1]),
                        with_kwargs=True,
                    )
                )
    return seen, handles


def test_unet_parts_see_their_own_ratio():
    # 16x16 latent, 4x4 tiles: ratio r keeps 16 (1 - r) tokens of each of the 16 tiles
    unet = make_sd15_unet()
    kw = unet_inputs(1, 16, 16, False)
    patch = toma.apply_toma(unet, ratio=0.5, merge_crossattn=True, merge_mlp=True, crossattn_ratio=0.75, mlp_ratio=0.25)
    seen, handles = record(unet, ("attn1.to_q", "attn2.to_q", "ff.net.0"))
    run(unet, kw)
    for h in handles:
        h.remove()
    # down, mid and the two up blocks: the 16x16 level merges, the mid block's 8x8 (levels=1) not
    assert seen == {"attn1.to_q": [128, 64, 128, 128], "attn2.to_q": [64] * 4, "ff.net.0": [192, 64, 192, 192]}
    # one plan per distinct ratio at the level, each selected once per step and shared by blocks
    assert sorted(key[2] for key in patch.cache._plans) == [0.25, 0.5, 0.75]


def test_wan_parts_see_their_own_ratio():
    model = make_wan()
    kw = wan_inputs(1, 4, 16, 16)  # 4 x 8 x 8 tokens, 2x4x4 tiles of 32
    toma.apply_toma(
        model, ratio=0.5, merge_crossattn=True, merge_mlp=True, crossattn_ratio=0.25, mlp_ratio=0.75, **WAN_ALL
    )
    seen, handles = record(model, ("attn1.to_q", "attn2.to_q", "ffn.net.0"))
    run(model, kw)
    for h in handles:
        h.remove()
    assert seen == {"attn1.to_q": [128] * 3, "attn2.to_q": [192] * 3, "ffn.net.0": [64] * 3}


def test_explicit_part_ratios_equal_to_ratio_change_nothing():
    unet = make_sd15_unet()
    kw = unet_inputs(2, 16, 16, False)
    toma.apply_toma(unet, ratio=0.5, merge_mlp=True)
    plain = run(unet, kw)
    toma.apply_toma(unet, ratio=0.5, merge_mlp=True, attn_ratio=0.5, mlp_ratio=0.5)
    assert torch.equal(run(unet, kw), plain)
    # ratio is only the default: the same per-part ratios under another ratio are the same model
    toma.apply_toma(unet, ratio=0.1, merge_mlp=True, attn_ratio=0.5, mlp_ratio=0.5)
    assert torch.equal(run(unet, kw), plain)


def test_a_part_at_ratio_zero_runs_unmerged():
    unet = make_sd15_unet()
    kw = unet_inputs(2, 16, 16, False)
    toma.apply_toma(unet, ratio=0.5)
    attention_only = run(unet, kw)
    toma.apply_toma(unet, ratio=0.5, merge_mlp=True, mlp_ratio=0.0)
    assert torch.equal(run(unet, kw), attention_only)
    # and the other way round: only the MLP merges
    seen, handles = record(unet, ("attn1.to_q", "ff.net.0"))
    toma.apply_toma(unet, ratio=0.5, merge_mlp=True, attn_ratio=0.0)
    out = run(unet, kw)
    for h in handles:
        h.remove()
    assert seen == {"attn1.to_q": [256, 64, 256, 256], "ff.net.0": [128, 64, 128, 128]}
    assert torch.isfinite(out).all() and not torch.equal(out, attention_only)


def test_flux_attention_ratio():
    model = make_flux()
    kw = flux_inputs(1, 8, 8)
    blocks = {"transformer_blocks": (0, 1), "single_transformer_blocks": (0, 1)}
    toma.apply_toma(model, ratio=0.5, blocks=blocks)
    half = run(model, kw)
    toma.apply_toma(model, ratio=0.9, attn_ratio=0.5, blocks=blocks)
    assert torch.equal(run(model, kw), half)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"mlp_ratio": 0.5}, "mlp_ratio is set but merge_mlp is off"),
        ({"crossattn_ratio": 0.5}, "crossattn_ratio is set but merge_crossattn is off"),
        ({"merge_attn": False, "merge_mlp": True, "attn_ratio": 0.5}, "attn_ratio is set but merge_attn is off"),
        ({"merge_mlp": True, "mlp_ratio": 1.0}, "mlp_ratio must be in [0, 1)"),
        ({"attn_ratio": float("nan")}, "attn_ratio must be in [0, 1)"),
        ({"attn_ratio": "0.5"}, "attn_ratio must be a number"),
    ],
)
def test_bad_part_ratios_are_refused_before_patching(options, message):
    unet = make_sd15_unet()
    with pytest.raises((ValueError, TypeError), match=message.replace("[", r"\[").replace(")", r"\)")):
        toma.apply_toma(unet, ratio=0.5, **options)
    assert toma.get_toma(unet) is None


def test_flux_mlp_merges_the_double_stream_image_mlp_at_its_ratio():
    # 8x8 tokens, 4x4 tiles of 16: double-stream attention at 0.5 keeps 32, the image MLP
    # (ff) at 0.75 keeps 16; the text MLP (ff_context) stays whole; single-stream blocks
    # run attention and MLP on one merged input, at the attention ratio
    model = make_flux()
    kw = flux_inputs(1, 8, 8, text=5)
    blocks = {"transformer_blocks": (0, 1), "single_transformer_blocks": (0, 1)}
    toma.apply_toma(model, ratio=0.5, merge_mlp=True, mlp_ratio=0.75, blocks=blocks)
    seen, handles = record(model, ("0.attn.to_q", "0.ff.net.0", "0.ff_context.net.0", "0.proj_mlp"))
    run(model, kw)
    for h in handles:
        h.remove()
    assert seen == {"0.attn.to_q": [32, 5 + 32], "0.ff.net.0": [16], "0.ff_context.net.0": [5], "0.proj_mlp": [5 + 32]}


def test_flux_refuses_crossattn():
    model = make_flux()
    with pytest.raises(ValueError, match=r"merge_crossattn=True: flux has no cross-attention"):
        toma.apply_toma(model, ratio=0.5, merge_crossattn=True)
    assert toma.get_toma(model) is None
