"""Kandinsky 5 (``Kandinsky5Transformer3DModel``): video self-attention with 3-D rotary, then
cross-attention to text.

The model's text blocks (``text_transformer_blocks``) run on the text alone and are left
unmerged. Each visual block merges the video tokens of its self-attention (rotary
rotations gathered to the merged tokens' destinations); ``merge_crossattn`` merges the
queries of the cross-attention to text, ``merge_mlp`` the feed-forward.

The tokens come out of ``visual_embeddings`` as a channel-last grid ``(B, t, h, w, C)``,
which a plain function (``fractal_flatten``) flattens into the blocks' sequence; after the
blocks, ``fractal_unflatten`` reshapes it back into a grid for ``out_layer``. The tokens
are put in tile order in that first grid and back in raster order in the last
(``FamilySpec.grid_tokens``), so that every visual block, and any block cache around
them, sees one order. The rotary rotations are made grid-shaped too,
``(B, t, h, w, 1, D/2, 2, 2)``, and flattened by the same function, so no module's output
holds them as rows: each visual block's (its ``rope`` argument, ``(B, N, 1, D/2, 2, 2)``)
are put in the blocks' order at the block's call, and gathered on their dimension 1 at a
merged self-attention's.

NABLA sparse attention (``attention_type="nabla"``; the pipeline then passes
``sparse_params``) reorders the tokens into 8x8 blocks and masks attention by 64-token
blocks chosen from the queries and keys: those calls run unmerged, with one warning.
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import ViaCall
from toma.adapters.attention import dispatch_ok, key_bias, through_dispatch
from toma.adapters.spec import BlockRope, FamilySpec, Grid, Rotary, Site, gather_rows, skip_first

# rotations (B, N, 1, D/2, 2, 2) at the attention's call (the forward repeats one table
# over the batch); its processor calls diffusers' dispatch with no mask of its own
_ROTARY = Rotary("rotary_emb", None, gather_rows)

NABLA = (
    "Kandinsky 5's NABLA sparse attention (sparse_params, attention_type='nabla') puts the tokens in 8x8 blocks "
    "and masks attention by 64-token blocks picked from the queries and keys, which merged tokens do not fill"
)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    return [
        Site("self_attention", "attn", rotary=_ROTARY, bias=ViaCall(through_dispatch, key_bias, ok=dispatch_ok)),
        Site("cross_attention", "cross"),
        Site("feed_forward", "mlp"),
    ]


def kandinsky5_grid(model: torch.nn.Module, call: dict) -> Grid | str | None:
    """The ``(t, h, w)`` token grid of channel-last latents ``(B, T, H, W, C)`` patchified by
    the model's ``config.patch_size``, or why the call cannot merge (NABLA)."""
    latents = call.get("hidden_states")
    if latents is None or latents.ndim != 5:
        return None
    if call.get("sparse_params") is not None:
        return NABLA
    pt, ph, pw = model.config.patch_size
    return (latents.shape[1] // pt, latents.shape[2] // ph, latents.shape[3] // pw)


SPEC = FamilySpec(
    name="kandinsky5",
    classes=("Kandinsky5Transformer3DModel",),
    stacks=("visual_transformer_blocks",),
    sites=_sites,
    grid=kandinsky5_grid,
    enter=("channels_last", "visual_embeddings"),
    leave="out_layer",
    tables=(BlockRope("rope", 3, 1),),  # the block's forward(visual_embed, text_embed, time_embed, rope, sparse_params)
    default_blocks=skip_first(5),
    video=True,
    reference=(32, 48),  # the T2V pipeline's 512x768: 8x VAE, 2x2 patches
)
