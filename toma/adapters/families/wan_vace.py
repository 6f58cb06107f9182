"""Wan VACE (``WanVACETransformer3DModel``): Wan's blocks, plus control blocks whose hints join them.

The ``blocks`` are Wan's own and merge as Wan's do (:mod:`toma.adapters.families.wan`). Before them
the ``vace_blocks`` run the same three sub-modules (self-attention with Wan's rotary
tables, cross-attention to text, MLP) on the control video's tokens, and their outputs
(hints) are added to the main tokens after the ``config.vace_layers`` blocks. The control
tokens come from their own patch embedding in raster order and the hints are added in
that order, so every forward runs in raster order: merging gathers its tokens from the
raster sequence, and the rotary tables stay in raster order for both stacks. The control
blocks merge too (their tokens are a grid of the same shape), with plans of their own
(group ``"vace"``): their tokens are the control video's, not the generated one's.
"""

from __future__ import annotations

import dataclasses

import torch

from toma.adapters.spec import Site, tile_order_unless
from toma.adapters.families.wan import SPEC as WAN


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    sites = WAN.sites(stack, block)
    return [dataclasses.replace(s, group="vace") for s in sites] if stack == "vace_blocks" else sites


SPEC = dataclasses.replace(
    WAN,
    name="wan-vace",
    classes=("WanVACETransformer3DModel",),
    stacks=("blocks", "vace_blocks"),
    sites=_sites,
    # every call passes it (the model needs it); a call without it would fail in the model
    tile_order_ok=tile_order_unless("control_hidden_states", check=WAN.tile_order_ok),
)
