"""PixArt-α / PixArt-Σ (``PixArtTransformer2DModel``): ``BasicTransformerBlock``s, as in the UNets.

Each block merges its self-attention (``attn1``); ``merge_crossattn`` merges the queries of
the cross-attention to text, whose mask covers the text keys and so still applies;
``merge_mlp`` the MLP. Positions are a fixed sin-cos embedding added at the patch
embedding, so tokens are free to move from there to the final norm.
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import InMask
from toma.adapters.spec import FamilySpec, Site, head_mask, image_grid, skip_first


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    return [
        Site("attn1", "attn", bias=InMask(("attention_mask", None), head_mask)),
        Site("attn2", "cross"),
        Site("ff", "mlp"),
    ]


SPEC = FamilySpec(
    name="pixart",
    classes=("PixArtTransformer2DModel",),
    stacks=("transformer_blocks",),
    sites=_sites,
    grid=image_grid,
    enter=("output", "pos_embed"),
    leave="norm_out",
    default_blocks=skip_first(5),
    reference=(64, 64),  # PixArt-Sigma at 1024px
)
