"""Qwen-Image 2.1 (``QwenImage21Transformer2DModel``): the target image's tokens merge in the
passes that decode from the prefix key-value cache.

The model runs one sequence: the vision-language encoder's text with the condition images'
tokens put in its image slots, then the target image's tokens, under a block-causal mask
(each image block bidirectional inside, causal across). Its pipeline's first step fills a
key-value cache of that prefix (``kv_cache_mode="extract"``); every later step runs only
the target image's tokens (``"cached"``), whose queries see the cached prefix keys and
their own, with a padding mask over those keys at most. Those passes merge:

- each block's attention merges the target tokens (its complex rotary table, one for the
  batch, gathered to the destinations); the cached prefix keys pass whole, before the
  merged ones, so proportional attention gives them log mass 0 (:func:`key_bias_prefix`);
- the model's padding mask is ``True`` over every target key, so slicing it is exact;
- between the blocks the target's tokens run in tile order (``packed``): ``img_in``'s
  output is ``[condition images; target]``, and the forward drops it into the joint
  sequence's image slots in that order, so the target's rows stay last and only they are
  reordered; so are the last rows of the rotary table, the target's.

The prefill pass (``"extract"``) and passes without a cache run the whole block-causal
sequence, which merged tokens cannot lay out: they run unmerged, with one warning. At the
pipeline's defaults (a cache, 50 steps) that is its first step.
"""

from __future__ import annotations

import math

import torch

from toma.adapters.layouts import Fit, InMask, Packed
from toma.adapters.attention import dispatch_ok, key_bias_prefix
from toma.adapters.spec import FamilySpec, Grid, RopeModule, Rotary, Site, skip_first
from toma.core.masks import slice_joint_mask

# rotary_emb: one complex (N, D/2) table over the target tokens in a cached pass
_ROTARY = Rotary("rotary_emb", None, shared=True)

PREFILL = (
    "Qwen-Image 2.1's prefill pass (kv_cache_mode='extract', or no kv_cache) runs text, condition images and the "
    "target under a block-causal mask laid out over the unmerged sequence: it runs unmerged, and the passes that "
    "decode from the cache (kv_cache_mode='cached', every step after the first in its pipeline) merge"
)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    attn = Site(
        "attn",
        "attn",
        rotary=_ROTARY,
        bias=InMask(("attention_mask", None), key_bias_prefix, ok=dispatch_ok),
        fit=Fit(slice_joint_mask),
    )
    return [attn, Site("img_mlp", "mlp")]


def qwenimage21_grid(model: torch.nn.Module, call: dict) -> Grid | str | None:
    """The target image's ``(1, h, w)`` token grid in a cached pass; why a prefill pass
    runs unmerged; None for a call that is not the model's."""
    shapes, tokens = call.get("img_shapes"), call.get("hidden_states")
    if not shapes or tokens is None or tokens.ndim != 3:
        return None
    if call.get("kv_cache_mode") != "cached" or call.get("kv_cache") is None:
        return PREFILL
    frames, h, w = (int(v) for v in shapes[0][-1])  # every sample shares the first's layout
    if frames != 1 or math.prod((h, w)) > tokens.shape[1]:
        return None
    return (1, h, w)


SPEC = FamilySpec(
    name="qwenimage21",
    classes=("QwenImage21Transformer2DModel",),
    stacks=("transformer_blocks",),
    sites=_sites,
    grid=qwenimage21_grid,
    enter=("output", "img_in"),
    leave="norm_out",  # its modulation mask is True over every target token: order-free
    tables=(RopeModule("pos_embed", 0),),  # one (prefix + target, D/2) table: the target's rows last
    stream=Packed(),
    default_blocks=skip_first(5),
    reference=(64, 64),  # 1024px: the VAE's 16x latents, one token each
)
