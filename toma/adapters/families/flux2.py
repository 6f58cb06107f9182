"""Flux.2 (``Flux2Transformer2DModel``): dual-stream blocks, then single-stream blocks on ``[text; image]``.

Double-stream blocks merge the image stream of their joint attention (and, with
``merge_mlp``, their image MLP); the text stream passes whole. A single-stream block's
attention module computes attention and MLP from one fused projection and returns their
fused output projection, so it merges the image part of ``[text; image]`` around the whole
module: attention and the parallel MLP run on the merged tokens, and the text part passes
whole. Rotary tables come from the image ids, which go in tile order with the tokens; the
processors apply one table to the whole batch, so merged attention runs once per sample
when the samples have plans of their own (``Rotary(shared=True)``). Reference images'
tokens (editing) pass whole, like text. An attention mask in ``joint_attention_kwargs``
merges where it holds one value over the image (and reference) tokens per sample, sliced
to the merged tokens; a structured one runs unmerged (:mod:`toma.adapters.families.flux`).
Proportional attention is a key bias into the dispatched attention (text keys first, log
mass 0), applied by the attention backend's rule (:mod:`toma.adapters.attention`).
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import Conditioned, Fit, InMask, TEXT_FIRST
from toma.adapters.attention import key_bias
from toma.adapters.spec import FamilySpec, Rotary, Site, skip_first
from toma.adapters.grids import IdsGrid
from toma.core.masks import slice_joint_mask

# image_rotary_emb is (cos, sin), each (text + N, D): text rows first
_ROTARY = Rotary("image_rotary_emb", None, shared=True)


# proportional attention: a key bias into the processors' dispatched attention, text keys
# first (the joint sequence of the single-stream blocks, the text stream put before the
# image's in the double-stream ones)
_MASK = ("attention_mask", None)


# what both streams' attention takes: one rotary table, the key bias, the sliced model mask
_FIT = Fit(slice_joint_mask)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    if stack == "single_transformer_blocks":
        return [Site("attn", "attn", layout=TEXT_FIRST, rotary=_ROTARY, bias=InMask(_MASK, key_bias), fit=_FIT)]
    bias = InMask(_MASK, key_bias, keys="encoder_hidden_states")
    return [Site("attn", "attn", rotary=_ROTARY, bias=bias, fit=_FIT), Site("ff", "mlp")]


SPEC = FamilySpec(
    name="flux2",
    classes=("Flux2Transformer2DModel",),
    stacks=("transformer_blocks", "single_transformer_blocks"),
    sites=_sites,
    grid=IdsGrid,
    enter=("output", "x_embedder"),
    leave="norm_out",
    stream=Conditioned(positions=("img_ids",)),
    default_blocks=skip_first(5),
    reference=(64, 64),  # 1024px
)
