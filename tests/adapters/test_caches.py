"""ToMA with diffusers' FasterCache.

It hooks the attention modules and, on some steps, returns an output extrapolated from
earlier steps' instead of computing it. toma's hooks sit inside any cache hook on the same
module (``register_innermost``), so either order of enabling computes the same, and the
cache reuses attention outputs as ToMA makes them. (FirstBlockCache, MagCache, TaylorSeer
and Pyramid Attention Broadcast on every family: ``test_conformance``; SD3 and PixArt take
no cache in diffusers 0.42.)
"""

from __future__ import annotations

import pytest
import torch

import toma
from tests.cases import CACHED

STEPS = 6


def denoise(model, kw, scale: float, clock: list) -> torch.Tensor:
    """Shrinking inputs at decreasing timesteps; ``clock[0]`` is the timestep on diffusers'
    0-1000 scale, which these caches read through a callback (pipelines pass theirs)."""
    outs = []
    with torch.no_grad():
        for i in range(STEPS):
            t = scale * (1 - i / STEPS)
            clock[0] = 1000.0 * t / scale
            call = {
                **kw,
                "hidden_states": kw["hidden_states"] * (1 - i / STEPS),
                "timestep": torch.full((kw["hidden_states"].shape[0],), t),
            }
            with model.cache_context("cond"):
                outs.append(model(**call)[0])
    return torch.stack(outs)


def config(family: str, clock: list):
    from diffusers.hooks import FasterCacheConfig

    # FasterCache computes the steps above t=681 (its default) and extrapolates attention
    # on every other step below; these runs are single-batch (no classifier-free guidance)
    layout = "BCHW" if family in ("flux", "flux2", "qwenimage") else "BFCHW" if family == "cogvideox" else "BCFHW"
    return FasterCacheConfig(
        spatial_attention_block_skip_range=2,
        current_timestep_callback=lambda: clock[0],
        is_guidance_distilled=True,
        tensor_format=layout,
        attention_weight_callback=lambda m: 0.5,
    )


# the attention module whose calls are counted: merged, and hooked by the cache
ATTENTION = {
    "flux": "transformer_blocks.1.attn",
    "wan": "blocks.2.attn1",
    "ltx": "transformer_blocks.2.attn1",
    "cogvideox": "transformer_blocks.2.attn1",
}


@pytest.mark.filterwarnings("ignore:.*FasterCache")
@pytest.mark.parametrize("family", ["flux", "wan", "ltx", "cogvideox"])
def test_faster_cache_composes_with_toma(family):
    make, inputs, scale, opts, _ = CACHED[family]
    kw, clock = inputs(), [0.0]
    unmerged = make()
    plain_tokens = []
    unmerged.get_submodule(ATTENTION[family]).to_q.register_forward_hook(
        lambda m, a, o: plain_tokens.append(a[0].shape[1])
    )
    plain = denoise(unmerged, kw, scale, clock)
    merged = make()
    toma.apply_toma(merged, ratio=0.5, **opts)
    merged_tokens = []
    merged.get_submodule(ATTENTION[family]).to_q.register_forward_hook(
        lambda m, a, o: merged_tokens.append(a[0].shape[1])
    )
    toma_only = denoise(merged, kw, scale, clock)

    outputs = []
    for toma_first in (True, False):
        model = make()
        if toma_first:
            toma.apply_toma(model, ratio=0.5, **opts)
        model.enable_cache(config(family, clock))
        if not toma_first:
            toma.apply_toma(model, ratio=0.5, **opts)
        tokens = []
        model.get_submodule(ATTENTION[family]).to_q.register_forward_hook(lambda m, a, o: tokens.append(a[0].shape[1]))
        outputs.append(denoise(model, kw, scale, clock))
        assert torch.isfinite(outputs[-1]).all()
        # the cache skipped the attention on some steps, and it ran merged on the others
        assert 0 < len(tokens) < STEPS and set(tokens) == set(merged_tokens[:1])
        toma.remove_toma(model)
        model.disable_cache()
        assert torch.equal(denoise(model, kw, scale, clock), plain)
    assert torch.equal(outputs[0], outputs[1])
    assert not torch.equal(outputs[0], toma_only)  # the cache acted
    assert merged_tokens[0] < plain_tokens[0]
