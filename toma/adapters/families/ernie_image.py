"""ERNIE-Image (``ErnieImageTransformer2DModel``): ``layers`` on one ``[image; text]`` sequence,
sequence-first.

The forward joins the image tokens and the padded text, image first, into one
sequence-first ``(S, B, C)`` stream for its blocks. Each block's attention gets it
transposed to ``(B, S, C)`` and its MLP as it is: both merge the first ``N`` tokens
(``IMAGE_FIRST``; the MLP as a sequence-first site, ``SeqFirst``), and the text
after them passes whole. The rotary angles ``(B, N + T, 1, D)`` have the image's rows first
(their first axis is each sample's text length, so each sample has its own): a merged
attention gets the rows of its destinations, then the text's. The forward's key mask
``(B, 1, 1, N + T)`` is ones over the image and each sample's text padding after it: it is
fitted to the merged tokens by its last ``K + T`` columns
(:func:`toma.core.masks.slice_image_first_mask`), exactly.

Tokens stay in raster order: the image leaves the blocks within the sequence-first stream
(``final_norm`` takes ``[image; text]``), so no module brackets the image tokens alone.
Under proportional attention the bias waits for the processor's dispatch
(:func:`toma.adapters.attention.through_dispatch`), which folds in the key mask the
processor passes; the text's keys take log mass 0.
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import Fit, IMAGE_FIRST, SeqFirst, ViaCall
from toma.adapters.attention import dispatch_ok, key_bias_text_after, through_dispatch
from toma.adapters.spec import FamilySpec, Rotary, Site, gather_rows, image_grid, skip_first
from toma.core.masks import slice_image_first_mask

# ErnieImageAttention.forward(hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
_ROTARY = Rotary("image_rotary_emb", 3, gather_rows)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    return [
        Site(
            "self_attention",
            "attn",
            layout=IMAGE_FIRST,
            rotary=_ROTARY,
            bias=ViaCall(through_dispatch, key_bias_text_after, ok=dispatch_ok),  # the text's keys follow the image's
            fit=Fit(slice_image_first_mask),
        ),
        Site("mlp", "mlp", layout=SeqFirst(IMAGE_FIRST)),
    ]


SPEC = FamilySpec(
    name="ernie-image",
    classes=("ErnieImageTransformer2DModel",),
    stacks=("layers",),
    sites=_sites,
    grid=image_grid,
    enter=("block", ""),
    leave="final_norm",  # never reorders: the forwards stay in raster order
    tile_order_ok=lambda model, call: False,
    default_blocks=skip_first(5),
    reference=(64, 64),  # the pipeline's 1024px: 16x VAE latents patchified 2x2 by the pipeline, patch 1
)
