"""FLUX.3 (``Flux3Transformer2DModel``): per-mode blocks, then single-stream blocks on ``[text; image]``.

Each token mode (the image, reference images, the text) first runs through blocks of its
own, whose attention and feed-forward see that mode alone; then single-stream blocks run
attention and a parallel feed-forward on ``[text; image]``, each from the same modulated
input. The image's own blocks (``mode_blocks.image``) merge their attention and, with
``merge_mlp``, their feed-forward; the single-stream blocks merge the image part of their
attention's and feed-forward's input, the text part passing whole. The modulation is one
row per token but the same row over the image tokens (the timestep's embedding expanded):
it is applied in the block, outside the merged modules, on unmerged tokens. Rotary tables
come from the image ids, which go in tile order with the tokens; the processor applies one
table to the whole batch, so merged attention runs once per sample when the samples have
plans of their own. Proportional attention is a key bias into the dispatched attention
(text keys first in the single-stream blocks, log mass 0).

With reference images (``image_cond_hidden_states``) the single-stream blocks run
``[text; image; references]``, the image in the middle: such calls run unmerged, with one
warning.
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import Fit, InMask, Stream, TEXT_FIRST
from toma.adapters.attention import key_bias
from toma.adapters.spec import FamilySpec, Grid, Rotary, Site, skip_first
from toma.adapters.grids import IdsGrid
from toma.core.masks import slice_joint_mask

# image_rotary_emb is (cos, sin), each (N, D) in the image's blocks and (text + N, D) in the
# single-stream ones: text rows first
_ROTARY = Rotary("image_rotary_emb", None, shared=True)
_ATTENTION = {"rotary": _ROTARY, "bias": InMask(("attention_mask", None), key_bias), "fit": Fit(slice_joint_mask)}
IMAGE_BLOCKS = "mode_blocks.image"

REFERENCES = (
    "FLUX.3 with reference images (image_cond_hidden_states) runs [text; image; references] in its single-stream "
    "blocks, the image in the middle: such calls run unmerged"
)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    if stack == IMAGE_BLOCKS:
        return [Site("attn", "attn", **_ATTENTION), Site("ff", "mlp")]
    return [Site("attn", "attn", layout=TEXT_FIRST, **_ATTENTION), Site("ff", "mlp", layout=TEXT_FIRST)]


class Flux3Grid(IdsGrid):
    """The image's grid from ``img_ids`` (4 columns, as Flux.2's), or why a call with
    reference images runs unmerged."""

    def model_mask(self, call: dict) -> torch.Tensor | None:
        return None  # the forward takes no attention mask

    def __call__(self, model: torch.nn.Module, call: dict) -> Grid | str | None:
        if call.get("image_cond_hidden_states") is not None:
            return REFERENCES
        return super().__call__(model, call)


SPEC = FamilySpec(
    name="flux3",
    classes=("Flux3Transformer2DModel",),
    stacks=(IMAGE_BLOCKS, "single_transformer_blocks"),
    sites=_sites,
    grid=Flux3Grid,
    enter=("output", "x_embedders.image"),
    leave="norm_out",
    stream=Stream(positions=("img_ids",)),
    default_blocks=skip_first(5),
    reference=(64, 64),  # 1024px: one token per 16x16 pixels (8x latents packed 2x2)
)
