"""Cosmos-Predict 1 / 2 / 2.5, Transfer, Anima (``CosmosTransformer3DModel``): self-attention
with 3-D rotary, cross-attention, MLP.

Each block merges the video tokens of its self-attention (``attn1``); its rotary tables
(one ``(N, D)`` cos/sin pair for the batch, from ``rope``) are gathered to the merged
tokens' destinations, one call per sample when samples have plans of their own.
``merge_crossattn`` merges the queries of the cross-attention to text (whose key mask
stays as it is), ``merge_mlp`` the MLP. Three inputs are laid out over the raster
sequence, so forwards with them merge in raster order: per-frame timesteps
(video-to-world), the learnable positional embedding of ``extra_pos_embed_type="learnable"``
models (added to every block's tokens), and ControlNet residuals (Transfer). Tiles span
``tile_frames`` latent frames (1 by default).
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import InMask
from toma.adapters.attention import key_bias
from toma.adapters.spec import FamilySpec, RopeModule, Rotary, Site, skip_first, tile_order_unless, video_grid

_ROTARY = Rotary("image_rotary_emb", None, shared=True)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    # the processor hands its mask (None from the block) to diffusers' dispatch as is
    attn1 = Site("attn1", "attn", rotary=_ROTARY, bias=InMask(("attention_mask", None), key_bias))
    return [attn1, Site("attn2", "cross"), Site("ff", "mlp")]


def _tile_order_ok(model: torch.nn.Module, call: dict) -> bool:
    timestep = call.get("timestep")
    per_frame = isinstance(timestep, torch.Tensor) and timestep.ndim == 5
    return not per_frame and model.config.extra_pos_embed_type != "learnable"


SPEC = FamilySpec(
    name="cosmos",
    classes=("CosmosTransformer3DModel",),
    stacks=("transformer_blocks",),
    sites=_sites,
    grid=video_grid,
    enter=("block", ""),
    leave="norm_out",
    tables=(RopeModule("rope", 0),),
    tile_order_ok=tile_order_unless("block_controlnet_hidden_states", check=_tile_order_ok),
    default_blocks=skip_first(5),
    video=True,
    reference=(44, 80),  # 704x1280 (Predict2 video)
)
