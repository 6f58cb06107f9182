"""LTX-Video (``LTXVideoTransformer3DModel``): video self-attention with per-sample rotary, then cross-attention.

Tokens arrive flattened, one per latent pixel; the grid comes from the call's
``num_frames``, ``height`` and ``width``. Each block merges its self-attention, whose
rotary tables (one per sample, over the full width) are gathered to the merged tokens'
destinations; ``merge_crossattn`` merges the queries of the cross-attention to text
(its text mask still applies), ``merge_mlp`` the MLP. Tiles span ``tile_frames`` latent
frames (1 by default). Proportional attention reaches the self-attention's dispatch
through :func:`~toma.adapters.attention.through_dispatch`. Calls with a timestep per token
(conditioning frames) modulate tokens in raster order, so they merge in raster order.
"""

from __future__ import annotations

import math

import torch

from toma.adapters.layouts import ViaCall
from toma.adapters.attention import dispatch_ok, key_bias, through_dispatch
from toma.adapters.spec import FamilySpec, Grid, RopeModule, Rotary, Site, gather_rows, skip_first


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    return [
        Site(
            "attn1",
            "attn",
            rotary=Rotary("image_rotary_emb", None, gather_rows),
            # its processor reshapes a mask per head, which a key bias does not survive
            bias=ViaCall(through_dispatch, key_bias, ok=dispatch_ok),
        ),
        Site("attn2", "cross"),
        Site("ff", "mlp"),
    ]


def _grid(model: torch.nn.Module, call: dict) -> Grid | str | None:
    tokens = call.get("hidden_states")
    sizes = tuple(call.get(k) for k in ("num_frames", "height", "width"))
    if tokens is None or tokens.ndim != 3 or None in sizes:
        return "an LTX call without num_frames, height and width gives no token grid"
    if call.get("video_coords") is not None:
        return "video_coords place tokens off the regular grid"
    grid = tuple(int(v) for v in sizes)
    return grid if math.prod(grid) == tokens.shape[1] else None


def _tile_order_ok(model: torch.nn.Module, call: dict) -> bool:
    timestep = call.get("timestep")
    tokens = call["hidden_states"]
    return not (isinstance(timestep, torch.Tensor) and timestep.numel() > tokens.shape[0])


SPEC = FamilySpec(
    name="ltx",
    classes=("LTXVideoTransformer3DModel",),
    stacks=("transformer_blocks",),
    sites=_sites,
    grid=_grid,
    enter=("output", "proj_in"),
    leave="norm_out",
    tables=(RopeModule("rope", 1),),
    tile_order_ok=_tile_order_ok,
    default_blocks=skip_first(5),
    video=True,
    reference=(16, 22),  # 512x704
)
