"""The ComfyUI node on ComfyUI's own model classes (the vendored 0.33.0), through its sampler.

What a merged module sees is observed by forward pre-hooks on ComfyUI's own layers, not by
toma's counters. Models are tiny, with seeded weights (ComfyUI's layers skip initialisation).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import logging
import math
from pathlib import Path

import pytest
import torch
from tiny_comfy import (
    chroma_patcher,
    sd3_patcher,
    flux_patcher,
    hunyuan_patcher,
    qwen_patcher,
    sample,
    sample_hunyuan,
    sample_qwen,
    sample_video,
    unet_patcher,
    wan_patcher,
    zimage_patcher,
)

from toma.adapters import state
from toma.comfyui import hooks
from toma.comfyui.families import FAMILIES, family_of, supported
from toma.comfyui.node import NODE_CLASS_MAPPINGS, ToMAModel
from toma.comfyui.patch import patch_model

ALL_FLUX = "double:all single:all"
TEXT = 6  # tokens of the tiny conditioning (tiny_comfy.conds)


@pytest.fixture(scope="module")
def flux(comfy):
    return flux_patcher(comfy)


@pytest.fixture(scope="module")
def flux_reference(comfy, flux):
    """The unpatched tiny Flux's output, sampled before anything is patched."""
    return sample(comfy, flux, "flux")


@pytest.fixture(scope="module")
def sdxl(comfy):
    return unet_patcher(comfy, sdxl_like=True)


def _record(modules: dict[str, torch.nn.Module]) -> tuple[dict[str, list[int]], list]:
    """Token counts each module's input had, call by call, from forward pre-hooks."""
    seen: dict[str, list[int]] = {name: [] for name in modules}
    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: seen[name].append(args[0].shape[1]))
        for name, m in modules.items()
    ]
    return seen, handles


def _flux_modules(patcher) -> dict[str, torch.nn.Module]:
    dm = patcher.model.diffusion_model
    out = {}
    for i, b in enumerate(dm.double_blocks):
        out[f"double{i}.qkv"] = b.img_attn.qkv
        out[f"double{i}.mlp"] = b.img_mlp[0]
    for i, b in enumerate(dm.single_blocks):
        out[f"single{i}.linear1"] = b.linear1
    return out


def _options_snapshot(patcher) -> tuple:
    return (repr(patcher.model_options), dict(patcher.object_patches), {k: list(v) for k, v in patcher.patches.items()})


# -- names and hooks ----------------------------------------------------------------------------
def test_every_named_internal_is_in_the_vendored_comfyui(comfy):
    every = (
        hooks.COMMON + hooks.FLUX_NEEDS + hooks.CHROMA_NEEDS + hooks.HUNYUAN_NEEDS + hooks.QWEN_NEEDS + hooks.WAN_NEEDS
    ) + hooks.NEXTDIT_NEEDS
    for need in every + hooks.UNET_NEEDS + hooks.ATTENTION_OVERRIDE_NEEDS:
        assert hooks.problem(need) is None, need
    for family in FAMILIES:  # what each family file says it needs
        for need in family.needs:
            assert hooks.problem(need) is None, (family.name, need)
    for family in FAMILIES:
        for target in family.classes:
            assert isinstance(hooks.resolve(target), type), target
    names = [hooks.MODEL_PATCHER, hooks.WRAPPERS, hooks.TRANSFORMER_BLOCK, hooks.SPATIAL_TRANSFORMER]
    assert all(hooks.resolve(n) for n in names)
    wrappers = hooks.resolve(hooks.WRAPPERS)
    assert getattr(wrappers, hooks.OUTER_SAMPLE) and getattr(wrappers, hooks.APPLY_MODEL)
    # the denoisers' attributes toma reads, on ComfyUI's own classes (tiny instances)
    flux_dm, wan_dm = flux_patcher(comfy).model.diffusion_model, wan_patcher(comfy).model.diffusion_model
    unet_dm, hunyuan_dm = unet_patcher(comfy).model.diffusion_model, hunyuan_patcher(comfy).model.diffusion_model
    for dm in (flux_dm, hunyuan_dm):
        assert len(getattr(dm, hooks.DOUBLE_BLOCKS)) and len(getattr(dm, hooks.SINGLE_BLOCKS))
        assert getattr(dm, hooks.PATCH_SIZE)
    assert len(getattr(wan_dm, hooks.WAN_BLOCKS)) and tuple(getattr(wan_dm, hooks.PATCH_SIZE)) == (1, 2, 2)
    assert len(getattr(unet_dm, hooks.UNET_INPUT_BLOCKS))
    fields = dataclasses.fields(hooks.resolve(hooks.FLUX_MODULATION_OUT))
    assert hooks.MODULATION_SHIFT in {f.name for f in fields}
    # the args and attention keywords, where ComfyUI's sources pass them
    flux_src = inspect.getsource(hooks.resolve(hooks.FLUX).forward_orig)
    for key in (hooks.ARG_IMG, hooks.ARG_TXT, hooks.ARG_PE, hooks.ARG_VEC, hooks.ARG_FLUX_MASK):
        assert f'"{key}"' in flux_src, key
    hunyuan_src = inspect.getsource(hooks.resolve(hooks.HUNYUAN_VIDEO).forward_orig)
    for key in (hooks.ARG_HUNYUAN_MASK, *hooks.ARG_HUNYUAN_SPANS):
        assert f"'{key}'" in hunyuan_src or f'"{key}"' in hunyuan_src, key
    attention = inspect.signature(hooks.resolve("comfy.ldm.modules.attention:attention_pytorch")).parameters
    assert hooks.ATTN_MASK in attention and hooks.ATTN_SKIP_RESHAPE in attention


def test_supported_lists_every_family_with_a_reason_where_refused():
    rows = supported()
    assert {r["name"] for r in rows} >= {"flux", "unet", "wan", "qwenimage", "zimage", "ltx", "hunyuanvideo"}
    for r in rows:
        assert r["merges"] == (r["reason"] is None)
    merged = ["chroma", "flux", "hunyuanvideo", "ltx", "qwenimage", "sd3", "unet", "wan", "zimage"]
    assert [r["name"] for r in rows if r["merges"]] == merged  # by name: the family files' order


@pytest.mark.parametrize("family", [f for f in FAMILIES if not f.merges], ids=lambda f: f.name)
def test_refused_family_logs_its_reason_and_patches_nothing(comfy, flux, family, caplog, monkeypatch):
    module, _, name = family.classes[0].partition(":")
    fake = type(name, (torch.nn.Module,), {"__module__": module})()
    monkeypatch.setattr(flux.model, "diffusion_model", fake)
    assert family_of(fake) is family
    before = _options_snapshot(flux)
    with caplog.at_level(logging.WARNING, logger="toma.comfyui"):
        assert patch_model(flux, 0.5) is flux
    assert [r.getMessage() for r in caplog.records if r.name == "toma.comfyui"] == [
        f"ToMA: not patching this model: {family.reason} (tested on ComfyUI {hooks.TESTED_VERSION})"
    ]
    assert _options_snapshot(flux) == before


def test_missing_hook_is_refused_with_its_name(comfy, flux, caplog, monkeypatch):
    patcher_cls = hooks.resolve(hooks.MODEL_PATCHER)
    monkeypatch.delattr(patcher_cls, "set_model_patch_replace")
    with caplog.at_level(logging.WARNING, logger="toma.comfyui"):
        assert patch_model(flux, 0.5) is flux
    assert "ModelPatcher.set_model_patch_replace" in caplog.text and "is missing" in caplog.text


def test_changed_signature_is_refused(comfy, sdxl, caplog, monkeypatch):
    patcher_cls = hooks.resolve(hooks.MODEL_PATCHER)
    monkeypatch.setattr(patcher_cls, "set_model_attn1_patch", lambda self, fn: None)
    with caplog.at_level(logging.WARNING, logger="toma.comfyui"):
        assert patch_model(sdxl, 0.5) is sdxl
    assert "set_model_attn1_patch takes no patch (signature changed)" in caplog.text


def test_forward_that_no_longer_reads_the_hook_is_refused(comfy, flux, caplog, monkeypatch):
    flux_cls = hooks.resolve(hooks.FLUX)

    def forward_orig(self, img, img_ids, txt, txt_ids, timesteps, y, transformer_options={}):
        return img  # a forward without block replacement

    monkeypatch.setattr(flux_cls, "forward_orig", forward_orig)
    with caplog.at_level(logging.WARNING, logger="toma.comfyui"):
        assert patch_model(flux, 0.5) is flux
    assert "no longer contains 'patches_replace.get(\"dit\"'" in caplog.text


# -- inputs -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"ratio": 1.0}, "ratio"),
        ({"ratio": -0.1}, "ratio"),
        ({"ratio": "0.5"}, "ratio"),
        ({"ratio": float("nan")}, "ratio"),
        ({"tile_size": -2}, "tile_size"),
        ({"tile_size": 2.5}, "tile_size"),
        ({"tile_size": True}, "tile_size"),
        ({"start_percent": 0.8, "end_percent": 0.2}, "start_percent"),
        ({"end_percent": 1.5}, "end_percent"),
        ({"blocks": "triple:0"}, "unknown block stack 'triple'"),
        ({"blocks": "double:7"}, "blocks: double '7' is outside 0-1"),
        ({"blocks": "double:x"}, "blocks: 'x'"),
        ({"blocks": "double"}, "blocks: 'double' is not 'stack:indices'"),
        ({"merge_mlp": "maybe"}, "merge_mlp"),
        ({"merge_mlp": "off"}, "merge_mlp: 'off' is not available on Flux"),
        ({"proportional_attention": "yes"}, "proportional_attention"),
    ],
)
def test_bad_input_is_an_error_naming_it_and_patches_nothing(comfy, flux, kwargs, name):
    before = _options_snapshot(flux)
    args = {"ratio": 0.5, **kwargs}
    with pytest.raises(ValueError, match=name.replace("(", r"\(").replace("[", r"\[")):
        ToMAModel().patch(flux, **args)
    assert _options_snapshot(flux) == before


def test_unet_blocks_are_checked_against_its_levels(comfy, sdxl):
    with pytest.raises(ValueError, match="blocks: unknown block stack 'double'; allowed: levels|unknown block stack"):
        patch_model(sdxl, 0.5, blocks="double:0")
    # levels count from 1, as the docs and the log line count them
    with pytest.raises(ValueError, match="levels '3' is outside 1-2"):
        patch_model(sdxl, 0.5, blocks="levels:3")
    with pytest.raises(ValueError, match="levels '0' is outside 1-2"):
        patch_model(sdxl, 0.5, blocks="levels:0")
    assert patch_model(sdxl, 0.5, blocks="levels:2").toma_run.levels == (4,)  # SDXL-like: levels at /2, /4
    assert patch_model(sdxl, 0.5, blocks="levels:1,2").toma_run.levels == (2, 4)
    with pytest.raises(ValueError, match="merge_mlp: 'on' is not available on the SD/SDXL UNet"):
        patch_model(sdxl, 0.5, merge_mlp="on")


# -- Flux through the sampler -------------------------------------------------------------------
def test_flux_blocks_see_k_tokens_and_the_input_model_is_unchanged(comfy, flux, flux_reference, caplog, monkeypatch):
    before = _options_snapshot(flux)
    patched = ToMAModel().patch(flux, 0.5, blocks=ALL_FLUX)[0]
    assert patched is not flux and _options_snapshot(flux) == before
    selections = []
    build = state.build_plan
    monkeypatch.setattr(
        state, "build_plan", lambda tiles, *a, **k: selections.append(tiles.shape[0]) or build(tiles, *a, **k)
    )
    seen, handles = _record(_flux_modules(flux))
    try:
        with caplog.at_level(logging.INFO, logger="toma.comfyui"):
            merged = sample(comfy, patched, "flux")
    finally:
        for h in handles:
            h.remove()
    n, k = 64, 32  # 16x16 latent, patch 2: 8x8 tokens; 4x4 tiles keep 8 of 16
    calls = 3  # Euler steps, cond and uncond in one batch each
    # one selection per denoiser call, on both samples (cond, uncond), reused by all 4 blocks
    assert selections == [2] * calls
    for i in range(2):
        assert seen[f"double{i}.qkv"] == [k] * calls
        assert seen[f"double{i}.mlp"] == [k] * calls
        assert seen[f"single{i}.linear1"] == [TEXT + k] * calls
    lines = [r.getMessage() for r in caplog.records if r.name == "toma.comfyui"]
    assert lines == [
        f"ToMA (flux): merged double 0-1; single 0-1 in {calls} of {calls} denoiser calls; "
        f"image tokens {n} -> {k}; ratio 0.5"
    ]
    assert torch.isfinite(merged).all()
    # merging changes the result (by much more than float noise)...
    assert (merged - flux_reference).abs().max() > 1e-2
    # ... and the unpatched model still gives its own output, bitwise
    assert torch.equal(sample(comfy, flux, "flux"), flux_reference)


def test_flux_ratio_zero_is_bitwise_unmerged(comfy, flux, flux_reference, caplog):
    patched = patch_model(flux, 0.0, blocks=ALL_FLUX)
    seen, handles = _record(_flux_modules(flux))
    try:
        with caplog.at_level(logging.WARNING, logger="toma.comfyui"):
            out = sample(comfy, patched, "flux")
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(out, flux_reference)
    assert seen["double0.qkv"] == [64] * 3
    assert "nothing merged in this run: ratio is 0" in caplog.text


def test_flux_steps_outside_the_window_are_bitwise_unmerged(comfy, flux, caplog):
    sampling = flux.get_model_object("model_sampling")
    steps = 3
    sigmas = comfy.comfy.samplers.calculate_sigmas(sampling, "normal", steps)
    start = 0.5
    first_in = next(i for i, s in enumerate(sigmas[:-1]) if float(s) <= sampling.percent_to_sigma(start))
    assert 0 < first_in < steps  # the window cuts the run

    def denoised(patcher):
        out = []
        last = sample(comfy, patcher, "flux", steps=steps, callback=lambda i, x0, x, total: out.append(x0.clone()))
        return out, last

    plain, plain_last = denoised(flux)
    patched = patch_model(flux, 0.5, blocks=ALL_FLUX, start_percent=start)
    seen, handles = _record(_flux_modules(flux))
    try:
        windowed, _ = denoised(patched)
    finally:
        for h in handles:
            h.remove()
    assert seen["double0.qkv"] == [64] * first_in + [32] * (steps - first_in)
    for i in range(first_in):
        assert torch.equal(windowed[i], plain[i])
    assert not torch.equal(windowed[first_in], plain[first_in])

    # a window no step falls in (100% is sigma 0, which the sampler never calls) merges
    # nothing, and says so
    empty = patch_model(flux, 0.5, blocks=ALL_FLUX, start_percent=1.0, end_percent=1.0)
    with caplog.at_level(logging.WARNING, logger="toma.comfyui"):
        out = sample(comfy, empty, "flux", steps=steps)
    assert torch.equal(out, plain_last)
    assert "no step fell inside start_percent / end_percent" in caplog.text


@pytest.mark.parametrize(
    "kwargs, size, reason",
    [
        ({}, 16, "no block selected"),  # the default skips the first 5 blocks: the tiny model has 2 + 2
        ({"blocks": ALL_FLUX}, 2, "the 1x1 token grid is too small to merge at ratio 0.5"),
    ],
    ids=["default-blocks-on-a-shallow-model", "grid-too-small"],
)
def test_nothing_merged_is_a_warning_with_the_reason(comfy, flux, kwargs, size, reason, caplog):
    patched = patch_model(flux, 0.5, **kwargs)
    with caplog.at_level(logging.INFO, logger="toma.comfyui"):
        out = sample(comfy, patched, "flux", h=size, w=size, steps=1)
    assert torch.equal(out, sample(comfy, flux, "flux", h=size, w=size, steps=1))
    records = [r for r in caplog.records if r.name == "toma.comfyui"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert records[0].getMessage().startswith("ToMA (flux): nothing merged in this run: " + reason)


def test_flux_plans_are_per_sample_under_cfg(comfy, flux):
    """With a plan per sample, each image of a CFG batch comes out as it does alone: a plan
    shared by the batch (or by cond and uncond) would change the second image."""
    patched = patch_model(flux, 0.5, blocks=ALL_FLUX)
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(2, 4, 16, 16, generator=g)
    import comfy.sample
    from tiny_comfy import conds

    pos, neg = conds("flux")

    def run(x):
        return comfy.sample.sample(
            patched, x, 2, 2.0, "euler", "normal", pos, neg, torch.zeros_like(x), disable_pbar=True, seed=1
        )

    both = run(noise)
    plan = next(iter(patched.toma_run.cache.forward.plans.values()))[1]
    assert plan.dest.shape[0] == 4  # 2 images x (cond, uncond), one plan each
    for i in range(2):
        alone = run(noise[i : i + 1])
        torch.testing.assert_close(both[i : i + 1], alone, rtol=0, atol=1e-5)


def test_flux_odd_latent(comfy, flux):
    patched = patch_model(flux, 0.5, blocks=ALL_FLUX)
    seen, handles = _record(_flux_modules(flux))
    try:
        out = sample(comfy, patched, "flux", h=15, w=13, steps=2)
    finally:
        for h in handles:
            h.remove()
    grid = (8, 7)  # Flux pads 15x13 to 16x14: 8x7 tokens
    layout_k = patched.toma_run.cache.layout(*grid).num_merged
    assert layout_k < math.prod(grid)
    assert seen["double1.qkv"] == [layout_k] * 2
    assert out.shape == (1, 4, 15, 13) and torch.isfinite(out).all()


# -- Wan ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wan(comfy):
    return wan_patcher(comfy)


def _wan_modules(patcher) -> dict[str, torch.nn.Module]:
    out = {}
    for i, b in enumerate(patcher.model.diffusion_model.blocks):
        out[f"{i}.self_q"] = b.self_attn.q
        out[f"{i}.cross_q"] = b.cross_attn.q
        out[f"{i}.ffn"] = b.ffn[0]
    return out


@pytest.mark.parametrize("size", [(3, 8, 8), (2, 7, 9)], ids=["3x8x8", "odd-2x7x9"])
def test_wan_blocks_see_k_video_tokens(comfy, wan, size, caplog):
    frames, h, w = size
    reference = sample_video(comfy, wan, frames, h, w)
    patched = patch_model(wan, 0.5, blocks="blocks:all")
    assert torch.equal(sample_video(comfy, patch_model(wan, 0.0, blocks="blocks:all"), frames, h, w), reference)
    seen, handles = _record(_wan_modules(wan))
    try:
        with caplog.at_level(logging.INFO, logger="toma.comfyui"):
            out = sample_video(comfy, patched, frames, h, w)
    finally:
        for hd in handles:
            hd.remove()
    grid = (frames, math.ceil(h / 2), math.ceil(w / 2))  # patch (1, 2, 2), padded up
    n, k = math.prod(grid), patched.toma_run.cache.layout(*grid).num_merged
    assert k < n
    for i in range(2):  # self-attention, cross-attention queries and the MLP all run on K
        for part in ("self_q", "cross_q", "ffn"):
            assert seen[f"{i}.{part}"] == [k] * 2, (i, part)
    assert f"ToMA (wan): merged blocks 0-1 in 2 of 2 denoiser calls; image tokens {n} -> {k}; ratio 0.5" in caplog.text
    assert out.shape == (1, 4, frames, h, w) and torch.isfinite(out).all()
    assert not torch.equal(out, reference)
    assert torch.equal(sample_video(comfy, wan, frames, h, w), reference)


def test_wan_proportional_bias_reaches_self_attention_only(comfy, wan):
    masks = []

    def other_override(*args, **kwargs):  # another node's attention, set before toma
        mask = kwargs.get("mask")
        masks.append(None if mask is None else (args[1].shape[1], mask.shape[-1]))
        return hooks.resolve("comfy.ldm.modules.attention:attention_pytorch")(*args, **kwargs)

    before = wan.clone()
    before.set_model_optimized_attention(other_override)
    sample_video(comfy, patch_model(before, 0.5, blocks="blocks:all"), steps=1)
    # per block: self-attention (24 merged keys, biased), then cross-attention (text, not)
    assert masks == [(24, 24), None] * 2
    masks.clear()
    sample_video(comfy, patch_model(before, 0.5, blocks="blocks:all", proportional_attention=False), steps=1)
    assert masks == [None, None] * 2


# -- Chroma -------------------------------------------------------------------------------------
def test_chroma_blocks_see_k_tokens(comfy, caplog):
    model = chroma_patcher(comfy)
    reference = sample(comfy, model, "flux", steps=2)
    assert torch.equal(sample(comfy, patch_model(model, 0.0, blocks=ALL_FLUX), "flux", steps=2), reference)
    patched = patch_model(model, 0.5, blocks=ALL_FLUX)
    seen, handles = _record(_flux_modules(model))  # Chroma's blocks are Flux's layers
    try:
        with caplog.at_level(logging.INFO, logger="toma.comfyui"):
            out = sample(comfy, patched, "flux", steps=2)
    finally:
        for h in handles:
            h.remove()
    for i in range(2):
        assert seen[f"double{i}.qkv"] == [32] * 2 and seen[f"double{i}.mlp"] == [32] * 2
        assert seen[f"single{i}.linear1"] == [TEXT + 32] * 2
    assert "ToMA (chroma): merged double 0-1; single 0-1 in 2 of 2 denoiser calls; image tokens 64 -> 32" in caplog.text
    assert torch.isfinite(out).all() and not torch.equal(out, reference)
    assert torch.equal(sample(comfy, model, "flux", steps=2), reference)


# -- SD3 ----------------------------------------------------------------------------------------
def test_sd3_joint_blocks_see_k_tokens(comfy, caplog):
    model = sd3_patcher(comfy)
    reference = sample(comfy, model, "flux", steps=2)
    assert torch.equal(sample(comfy, patch_model(model, 0.0, blocks="blocks:all"), "flux", steps=2), reference)
    patched = patch_model(model, 0.5, blocks="blocks:all")
    modules = {}
    for i, b in enumerate(model.model.diffusion_model.joint_blocks):
        modules[f"{i}.qkv"], modules[f"{i}.mlp"] = b.x_block.attn.qkv, b.x_block.mlp.fc1
    seen, handles = _record(modules)
    try:
        with caplog.at_level(logging.INFO, logger="toma.comfyui"):
            out = sample(comfy, patched, "flux", steps=2)
    finally:
        for h in handles:
            h.remove()
    for i in range(2):
        assert seen[f"{i}.qkv"] == [32] * 2 and seen[f"{i}.mlp"] == [32] * 2
    assert "ToMA (sd3): merged blocks 0-1 in 2 of 2 denoiser calls; image tokens 64 -> 32; ratio 0.5" in caplog.text
    assert torch.isfinite(out).all() and not torch.equal(out, reference)
    assert torch.equal(sample(comfy, model, "flux", steps=2), reference)


# -- HunyuanVideo -------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", [True, False], ids=["text-mask-cfg1", "cfg2"])
def test_hunyuanvideo_blocks_see_k_video_tokens(comfy, mask, caplog):
    model = hunyuan_patcher(comfy)
    reference = sample_hunyuan(comfy, model, mask=mask)
    assert torch.equal(sample_hunyuan(comfy, patch_model(model, 0.0, blocks=ALL_FLUX), mask=mask), reference)
    patched = patch_model(model, 0.5, blocks=ALL_FLUX)
    seen, handles = _record(_flux_modules(model))  # HunyuanVideo's blocks are Flux's layers
    try:
        with caplog.at_level(logging.INFO, logger="toma.comfyui"):
            out = sample_hunyuan(comfy, patched, mask=mask)
    finally:
        for h in handles:
            h.remove()
    n, k = 2 * 4 * 4, 16  # 2 frames of 8x8 latents, patch (1, 2, 2); each frame's 16 tokens keep 8
    calls = 2
    for i in range(2):
        assert seen[f"double{i}.qkv"] == [k] * calls
        assert seen[f"double{i}.mlp"] == [k] * calls
        assert seen[f"single{i}.linear1"] == [7 + k] * calls  # [text; image]
    assert f"image tokens {n} -> {k}; ratio 0.5" in caplog.text
    assert torch.isfinite(out).all() and not torch.equal(out, reference)
    assert torch.equal(sample_hunyuan(comfy, model, mask=mask), reference)


# -- Qwen-Image ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", [False, True], ids=["cfg2", "text-mask-cfg1"])
def test_qwenimage_blocks_see_k_tokens_and_the_bias_joins_the_text_mask(comfy, mask, caplog):
    model = qwen_patcher(comfy)
    cfg = 1.0 if mask else 2.0
    reference = sample_qwen(comfy, model, mask=mask, cfg=cfg)
    assert torch.equal(sample_qwen(comfy, patch_model(model, 0.0, blocks="blocks:all"), mask=mask, cfg=cfg), reference)
    masks = []

    def other(*args, **kwargs):  # another node's attention: sees the mask toma hands on
        m = args[4] if len(args) > 4 else kwargs.get("mask")
        masks.append(m)
        return hooks.resolve("comfy.ldm.modules.attention:attention_pytorch")(*args, **kwargs)

    observed = model.clone()
    observed.set_model_optimized_attention(other)
    patched = patch_model(observed, 0.5, blocks="blocks:all")
    modules = {}
    for i, b in enumerate(model.model.diffusion_model.transformer_blocks):
        modules[f"{i}.to_q"], modules[f"{i}.mlp"] = b.attn.to_q, b.img_mlp
    seen, handles = _record(modules)
    try:
        with caplog.at_level(logging.INFO, logger="toma.comfyui"):
            out = sample_qwen(comfy, patched, mask=mask, cfg=cfg)
    finally:
        for h in handles:
            h.remove()
    k, text = 32, 7  # 8x8 image tokens halved; 7 text tokens
    for i in range(2):
        assert seen[f"{i}.to_q"] == [k] * 2 and seen[f"{i}.mlp"] == [k] * 2
    assert "ToMA (qwenimage): merged blocks 0-1 in 2 of 2 denoiser calls; image tokens 64 -> 32" in caplog.text
    # every joint attention got [text mask; log masses of the merged keys]
    assert len(masks) == 4 and all(m is not None and m.shape[-1] == text + k for m in masks)
    for m in masks:
        image_part = m[..., text:]
        assert (image_part >= 0).all() and (image_part > 0).any()  # log of masses >= 1
        assert bool((m[..., :text] < -1e30).any()) == mask  # the padding stays masked
    assert not torch.equal(out, reference) and torch.isfinite(out).all()
    assert torch.equal(sample_qwen(comfy, model, mask=mask, cfg=cfg), reference)


# -- SD / SDXL UNet -----------------------------------------------------------------------------
def _unet_modules(patcher) -> dict[str, torch.nn.Module]:
    block_cls = hooks.resolve(hooks.TRANSFORMER_BLOCK)
    out = {}
    for name, m in patcher.model.diffusion_model.named_modules():
        if isinstance(m, block_cls):
            for part in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn2.to_q", "ff"):
                out[f"{name}.{part}"] = m.get_submodule(part)
    return out


@pytest.mark.parametrize("sdxl_like", [True, False], ids=["sdxl", "sd1"])
def test_unet_self_attention_sees_k_tokens_at_the_default_levels(comfy, sdxl, sdxl_like, caplog):
    patcher = sdxl if sdxl_like else unet_patcher(comfy, sdxl_like=False)
    size = 16 if sdxl_like else 8
    reference = sample(comfy, patcher, "unet", h=size, w=size, steps=2)
    patched = patch_model(patcher, 0.5)
    seen, handles = _record(_unet_modules(patcher))
    try:
        with caplog.at_level(logging.INFO, logger="toma.comfyui"):
            out = sample(comfy, patched, "unet", h=size, w=size, steps=2)
    finally:
        for h in handles:
            h.remove()
    # SDXL-like, 16x16 latent: attention at /2 (64 tokens) and /4 (16, the middle block's
    # too), both merged by default; SD1-like, 8x8: at /1 (64) and /2 (16), and /4 in the
    # middle block (4), the first merged by default
    merged = {64: 32, 16: 8} if sdxl_like else {64: 32}
    blocks = sorted({name.rsplit(".attn", 1)[0].rsplit(".ff", 1)[0] for name in seen})
    levels_seen = set()
    for block in blocks:
        (n,) = set(seen[f"{block}.attn2.to_q"])  # cross-attention queries: every token
        levels_seen.add(n)
        assert seen[f"{block}.ff"] == [n] * 2  # no hook around the feed-forward: every token
        for part in ("to_q", "to_k", "to_v"):
            assert seen[f"{block}.attn1.{part}"] == [merged.get(n, n)] * 2, (block, part)
    assert levels_seen == ({64, 16} if sdxl_like else {64, 16, 4})
    n, k = next(iter(merged.items()))
    levels = "1-2" if sdxl_like else "1"
    assert [r.getMessage() for r in caplog.records if r.name == "toma.comfyui"] == [
        f"ToMA (unet): merged levels {levels} in 2 of 2 denoiser calls; image tokens {n} -> {k}; ratio 0.5"
    ]
    assert not torch.equal(out, reference)
    assert torch.equal(sample(comfy, patcher, "unet", h=size, w=size, steps=2), reference)


def test_unet_ratio_zero_and_odd_latent(comfy, sdxl):
    reference = sample(comfy, sdxl, "unet", h=11, w=9, steps=2)
    assert torch.equal(sample(comfy, patch_model(sdxl, 0.0), "unet", h=11, w=9, steps=2), reference)
    patched = patch_model(sdxl, 0.5)
    seen, handles = _record(_unet_modules(sdxl))
    try:
        out = sample(comfy, patched, "unet", h=11, w=9, steps=2)
    finally:
        for h in handles:
            h.remove()
    # /2: 6x5 = 30 tokens, /4: 3x3 = 9; the layouts' K, not N, reach q, k and v
    ks = [patched.toma_run.cache.layout(*g).num_merged for g in ((3, 3), (6, 5))]
    q_counts = {c for name, counts in seen.items() if name.endswith("attn1.to_q") for c in counts}
    assert q_counts == set(ks) and ks[0] < 9 and ks[1] < 30
    assert torch.isfinite(out).all() and not torch.equal(out, reference)


def test_unet_proportional_attention_chains_an_override_set_before(comfy, sdxl):
    calls = []

    def other_override(*args, **kwargs):  # another node's attention, as set_model_optimized_attention takes it
        calls.append(kwargs.get("mask") is not None)
        attention = hooks.resolve("comfy.ldm.modules.attention:attention_pytorch")
        return attention(*args, **kwargs)

    before = sdxl.clone()
    before.set_model_optimized_attention(other_override)
    patched = patch_model(before, 0.5, proportional_attention=True)
    sample(comfy, patched, "unet", steps=1)
    assert calls and any(calls) and not all(calls)  # merged attn1 gets the bias; attn2 and others do not
    calls.clear()
    without = patch_model(before, 0.5, proportional_attention=False)
    sample(comfy, without, "unet", steps=1)
    assert calls and not any(calls)


# -- the plumbing, exactly --------------------------------------------------------------------
@pytest.mark.parametrize("family", ["flux", "chroma", "sd3", "wan", "hunyuanvideo", "qwenimage", "zimage", "unet"])
def test_keeping_every_token_reproduces_the_unpatched_model(comfy, family, monkeypatch):
    """Where every tile keeps all its tokens (K = N, which toma itself skips as pointless),
    each token is its own destination: the merge is a permutation into tiles, the rotary
    rows, masks and key biases (log 1 = 0) follow it, and the unmerge puts tokens back. So
    the output is the unpatched one up to float reassociation of the near one-hot weights
    (off-destination weights are below exp(-1000 * (1 - similarity)))."""
    from toma.comfyui import patch as patch_module

    monkeypatch.setattr(
        patch_module.ComfyRun,
        "plan",
        lambda self, x, grid, group: self.cache.get(x, grid, group) if self.merging else None,
    )
    if family == "flux":
        model, run, blocks = flux_patcher(comfy, seed=1), lambda m: sample(comfy, m, "flux", steps=2), ALL_FLUX
    elif family == "wan":
        model, run, blocks = wan_patcher(comfy, seed=1), lambda m: sample_video(comfy, m), "blocks:all"
    elif family == "sd3":
        model, run, blocks = sd3_patcher(comfy, seed=1), lambda m: sample(comfy, m, "flux", steps=2), "blocks:all"
    elif family == "chroma":
        model, run, blocks = chroma_patcher(comfy, seed=1), lambda m: sample(comfy, m, "flux", steps=2), ALL_FLUX
    elif family == "qwenimage":
        model, run, blocks = qwen_patcher(comfy, seed=1), lambda m: sample_qwen(comfy, m), "blocks:all"
    elif family == "hunyuanvideo":
        model, run, blocks = hunyuan_patcher(comfy, seed=1), lambda m: sample_hunyuan(comfy, m), ALL_FLUX
    elif family == "zimage":
        model, run = zimage_patcher(comfy, seed=1), lambda m: sample(comfy, m, "flux", h=12, w=20, steps=2)
        blocks = "layers:all"
    else:
        model, run, blocks = unet_patcher(comfy, seed=1), lambda m: sample(comfy, m, "unet", h=8, w=8, steps=2), ""
    reference = run(model)
    patched = patch_model(model, 0.01, tile_size=4, blocks=blocks, proportional_attention=True)
    out = run(patched)
    assert patched.toma_run.merged_calls == 2 and patched.toma_run.tokens[0] == patched.toma_run.tokens[1]
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-4)


# -- the node folder ----------------------------------------------------------------------------
def test_comfyui_loads_the_node_folder_where_it_sits(comfy):
    repo = Path(__file__).resolve().parents[2]

    nodes = comfy.nodes
    saved = copy.copy(nodes.NODE_CLASS_MAPPINGS), copy.copy(nodes.NODE_DISPLAY_NAME_MAPPINGS)
    try:
        assert asyncio.run(nodes.load_custom_node(str(repo / "comfyui_toma")))
        assert nodes.NODE_CLASS_MAPPINGS["ToMAModel"] is NODE_CLASS_MAPPINGS["ToMAModel"]
        assert nodes.NODE_DISPLAY_NAME_MAPPINGS["ToMAModel"] == "ToMA Token Merging"
        schema = nodes.NODE_CLASS_MAPPINGS["ToMAModel"].INPUT_TYPES()
        assert list(schema["required"]) == ["model", "ratio"]
        assert schema["required"]["ratio"][1]["default"] == 0.5
    finally:
        nodes.NODE_CLASS_MAPPINGS.clear()
        nodes.NODE_CLASS_MAPPINGS.update(saved[0])
        nodes.NODE_DISPLAY_NAME_MAPPINGS.clear()
        nodes.NODE_DISPLAY_NAME_MAPPINGS.update(saved[1])
