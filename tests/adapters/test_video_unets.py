"""The UNets of video pipelines: AnimateDiff's ``UNetMotionModel`` and Stable Video
Diffusion's ``UNetSpatioTemporalConditionModel``, through the UNet adapter.

Their spatial transformer blocks are SD's, one image per frame: they merge as an image
UNet's do. Their temporal attention runs over the frames of each latent pixel (a sequence
of ``frames`` tokens, batched over the pixels), which token merging over the image grid
does not apply to: it runs untouched, and the summary does not list it as merged.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import toma
from tests.tiny_models import (
    animatediff_inputs,
    make_animatediff_unet,
    make_svd_unet,
    svd_inputs,
)

H, W = 10, 14  # latent pixels: the 4x4 tiles pad the last row and column of tiles

CASES = {  # model, inputs(batch, frames), the temporal blocks' class
    "animatediff": (make_animatediff_unet, lambda b, f: animatediff_inputs(b, f, H, W), "BasicTransformerBlock"),
    "svd": (make_svd_unet, lambda b, f: svd_inputs(b, f, H, W), "TemporalBasicTransformerBlock"),
}


def kept_tokens(h: int, w: int, ratio: float, tile: int = 4) -> int:
    """Tokens an ``h x w`` grid keeps: each 4x4 tile (cut by the grid) ``round(p * (1 - ratio))`` of its ``p``."""
    return sum(
        max(1, math.floor(min(tile, h - top) * min(tile, w - left) * (1 - ratio) + 0.5))
        for top in range(0, h, tile)
        for left in range(0, w, tile)
    )


def temporal(name: str) -> bool:
    """Whether the module called ``name`` is inside temporal attention (over frames)."""
    return ".motion_modules." in name or ".temporal_transformer_blocks." in name


def query_shapes(model) -> tuple[dict[str, list], list]:
    """The (batch, tokens) of every self-attention's ``to_q`` input, per attention, at each call."""
    seen: dict[str, list] = {}
    handles = [
        m.to_q.register_forward_hook(
            lambda mod, a, o, name=name: seen.setdefault(name, []).append(tuple(a[0].shape[:2]))
        )
        for name, m in model.named_modules()
        if name.endswith(".attn1")
    ]
    return seen, handles


def run(model, kw):
    with torch.no_grad():
        return model(**kw).sample


@pytest.mark.parametrize("case", CASES)
def test_spatial_attention_merges_and_temporal_attention_sees_every_frame(case):
    make, inputs, _ = CASES[case]
    model, kw = make(), inputs(2, 3)
    before, handles = query_shapes(model)
    ref = run(model, kw)
    for h in handles:
        h.remove()
    patch = toma.apply_toma(model, ratio=0.5)
    after, handles = query_shapes(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(model, kw)
    for h in handles:
        h.remove()
    assert [str(w.message) for w in caught if "ToMA" in str(w.message)] == []
    assert out.shape == ref.shape and torch.isfinite(out).all() and not torch.equal(out, ref)
    kept = kept_tokens(H, W, 0.5)
    assert (
        kept == patch.cache.layout(H, W).num_merged == 70
    )  # 0.5x of 140: every tile, edge ones too, has an even count
    spatial = [name for name in before if not temporal(name) and before[name][0][1] == H * W]
    assert spatial and all(after[name] == [(2 * 3, kept)] for name in spatial)  # one image per frame, K tokens each
    frames = [name for name in before if temporal(name)]
    assert frames and all(after[name] == before[name] and before[name][0][1] == 3 for name in frames)  # every frame


@pytest.mark.parametrize("case", CASES)
def test_the_summary_lists_no_temporal_module_as_merged(case):
    make, _, kind = CASES[case]
    model = make()
    patch = toma.apply_toma(model, ratio=0.5)
    temporal_blocks = [n for n, m in model.named_modules() if type(m).__name__ == kind and temporal(n)]
    assert temporal_blocks  # the model has them
    assert patch.patched and not [p.name for p in patch.patched if temporal(p.name)]
    assert "motion_modules" not in "".join(
        line for line in str(patch).splitlines() if line.lstrip().startswith("merged")
    )


def test_temporal_attention_over_frames_that_divide_the_grid_runs_without_a_warning():
    # a motion module's 4 frames per pixel are not the 140 tokens of the image grid: no
    # "called on 4 of the 140 tokens at a time (feed-forward chunking?)" warning
    model = make_animatediff_unet()
    kw = animatediff_inputs(1, 4, 8, 8)  # 64 tokens, a multiple of 4 frames
    toma.apply_toma(model, ratio=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(model, kw)
    assert [str(w.message) for w in caught if "ToMA" in str(w.message)] == []
