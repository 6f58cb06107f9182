"""HunyuanVideo 1.5 (``HunyuanVideo15Transformer3DModel``): dual-stream blocks with 3-D
rotary.

One stack of dual-stream blocks whose joint attention runs over [video; text], text last
(the model packs SigLIP image embeddings, ByT5 and MLLM tokens into one text stream, valid
tokens first). Each block merges the video tokens of its attention call; its rotary tables
(one ``(N, D)`` cos/sin pair for the batch, from ``rope``) are gathered to the merged
tokens' destinations, one call per sample when samples have plans of their own. The block
passes the processor only the ``(B, T)`` text mask, and the processor pads it with True to
the front of whatever query length it gets: the mask already fits ``K`` merged video
tokens and passes unchanged. The processor turns that mask into a boolean mask with a row
per query, so proportional attention's key bias goes past it to the dispatch
(:func:`~toma.adapters.attention.through_dispatch`), exact in the float-mask form only.
``merge_mlp`` merges the video MLP (``ff``). Text tokens are never merged. Tiles span
``tile_frames`` latent frames (1 by default).
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import Fit, ViaCall
from toma.adapters.attention import dispatch_ok, key_bias_text_after, through_dispatch
from toma.adapters.spec import FamilySpec, RopeModule, Rotary, Site, skip_first, video_grid


def _text_mask(mask: torch.Tensor, tokens: int, kept: int) -> torch.Tensor | None:
    """The block's ``(B, T)`` text mask, which the processor pads to any video length: as is."""
    return mask if mask.ndim == 2 else None


_ROTARY = Rotary("image_rotary_emb", None, shared=True)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    attn = Site(
        "attn",
        "attn",
        rotary=_ROTARY,
        # the processor builds a boolean (B, 1, S, S) mask from the text mask: the key bias
        # goes past it to the dispatch, over [video; text], with that mask beside it
        bias=ViaCall(through_dispatch, key_bias_text_after, ok=dispatch_ok),
        fit=Fit(_text_mask),
    )
    return [attn, Site("ff", "mlp")]


SPEC = FamilySpec(
    name="hunyuanvideo15",
    classes=("HunyuanVideo15Transformer3DModel",),
    stacks=("transformer_blocks",),
    sites=_sites,
    grid=video_grid,
    enter=("output", "x_embedder"),
    leave="norm_out",
    tables=(RopeModule("rope", 0),),
    default_blocks=skip_first(5),
    video=True,
    reference=(45, 80),  # 720x1280
)
