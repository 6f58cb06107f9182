"""Wan 2.x (``WanTransformer3DModel``): video self-attention with 3-D rotary, then cross-attention.

Each block merges the video tokens of its self-attention (rotary tables gathered to the
merged tokens' destinations, so a merged token keeps its destination's position);
``merge_crossattn`` merges the queries of the cross-attention to text, ``merge_mlp`` the
MLP. Tiles span ``tile_frames`` latent frames (1 by default) as well as space.
Wan 2.2 TI2V modulates every token with its own timestep, laid out in raster order: those
forwards merge in raster order.
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import InMask
from toma.adapters.attention import key_bias
from toma.adapters.spec import FamilySpec, RopeModule, Rotary, Site, skip_first, video_grid


# rotary tables are (1, N, 1, D); per-batch destinations give (Bp, K, 1, D), which the
# processor's broadcast over (B, K, heads, D) takes as is
_ROTARY = Rotary("rotary_emb", 3, lambda table, dest: table[0][dest])


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    return [
        Site("attn1", "attn", rotary=_ROTARY, bias=InMask(("attention_mask", 2), key_bias)),
        Site("attn2", "cross"),
        Site("ffn", "mlp"),
    ]


def _tile_order_ok(model: torch.nn.Module, call: dict) -> bool:
    timestep = call.get("timestep")
    return not (isinstance(timestep, torch.Tensor) and timestep.ndim == 2)


SPEC = FamilySpec(
    name="wan",
    classes=("WanTransformer3DModel",),
    stacks=("blocks",),
    sites=_sites,
    grid=video_grid,
    # the patch embedding's output, not the first block's input: FirstBlockCache and
    # cache-dit watch that block's output minus its input, which must share one order
    enter=("grid", "patch_embedding"),
    leave="norm_out",
    tables=(RopeModule("rope", 1),),
    tile_order_ok=_tile_order_ok,
    default_blocks=skip_first(5),
    video=True,
    reference=(30, 52),  # 480x832
)
