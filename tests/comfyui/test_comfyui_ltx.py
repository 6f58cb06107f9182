"""LTX-Video in the ComfyUI node: its family file on the shared video block, through ComfyUI's
own sampler on a tiny ``comfy.model_base.LTXV`` with seeded weights."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from tiny_comfy import ltx_patcher, sample_ltx

from toma.comfyui import hooks
from toma.comfyui.patch import patch_model


@pytest.fixture
def ltx(comfy):
    return ltx_patcher(comfy)


def _record(dm) -> tuple[dict[str, list[int]], list]:
    """The token counts the self-attention's and cross-attention's queries and the MLP of each
    block saw, call by call, from forward pre-hooks (not toma's own counters)."""
    seen: dict[str, list[int]] = {}
    handles = []
    for i, block in enumerate(dm.transformer_blocks):
        for part, module in (("self_q", block.attn1.to_q), ("cross_q", block.attn2.to_q), ("ff", block.ff)):
            name = f"{i}.{part}"
            seen[name] = []
            handles.append(module.register_forward_pre_hook(lambda m, a, name=name: seen[name].append(a[0].shape[1])))
    return seen, handles


@pytest.mark.parametrize("size", [(3, 4, 6), (2, 5, 7)], ids=["3x4x6", "odd-2x5x7"])
def test_ltx_blocks_see_k_video_tokens(comfy, ltx, size, caplog):
    frames, h, w = size
    reference = sample_ltx(comfy, ltx, frames, h, w)
    assert torch.equal(sample_ltx(comfy, patch_model(ltx, 0.0, blocks="blocks:all"), frames, h, w), reference)
    patched = patch_model(ltx, 0.5, blocks="blocks:all")
    seen, handles = _record(ltx.model.diffusion_model)
    try:
        with caplog.at_level(logging.INFO, logger="toma.comfyui"):
            out = sample_ltx(comfy, patched, frames, h, w)
    finally:
        for hd in handles:
            hd.remove()
    grid = (frames, h, w)  # one latent pixel per token
    n, k = math.prod(grid), patched.toma_run.cache.layout(*grid).num_merged
    assert k < n
    for name, counts in seen.items():  # 2 calls (cond and uncond in one batch), each on K
        assert counts == [k] * 2, name
    assert f"ToMA (ltx): merged blocks 0-1 in 2 of 2 denoiser calls; image tokens {n} -> {k}; ratio 0.5" in caplog.text
    assert out.shape == (1, 4, frames, h, w) and torch.isfinite(out).all()
    assert not torch.equal(out, reference)
    assert torch.equal(sample_ltx(comfy, ltx, frames, h, w), reference)  # the input model is unchanged


def test_ltx_proportional_bias_reaches_self_attention_only(comfy, ltx):
    masks = []

    def other_override(*args, **kwargs):  # another node's attention, set before toma
        mask = kwargs.get("mask")
        masks.append(None if mask is None else (args[1].shape[1], mask.shape[-1]))
        return hooks.resolve("comfy.ldm.modules.attention:attention_pytorch")(*args, **kwargs)

    before = ltx.clone()
    before.set_model_optimized_attention(other_override)
    sample_ltx(comfy, patch_model(before, 0.5, blocks="blocks:all"), steps=1)
    # per block: self-attention (36 merged keys, biased), then cross-attention (the text's own
    # mask over its 5 keys, left as it was)
    assert masks == [(36, 36), (5, 5)] * 2
    masks.clear()
    sample_ltx(comfy, patch_model(before, 0.5, blocks="blocks:all", proportional_attention=False), steps=1)
    assert masks == [None, (5, 5)] * 2


def test_ltx_per_token_timestep_runs_unmerged_with_the_reason(comfy, ltx, caplog):
    # a noise mask (image-to-video conditioning) makes LTX's timestep per token
    mask = torch.ones(1, 1, 3, 4, 6)
    mask[:, :, 0] = 0.0
    reference = sample_ltx(comfy, ltx, noise_mask=mask)
    patched = patch_model(ltx, 0.5, blocks="blocks:all")
    with caplog.at_level(logging.WARNING, logger="toma.comfyui"):
        out = sample_ltx(comfy, patched, noise_mask=mask)
    assert torch.equal(out, reference)
    assert "nothing merged in this run: the timestep is per token (image-to-video conditioning)" in caplog.text
