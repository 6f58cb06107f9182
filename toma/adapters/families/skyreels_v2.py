"""SkyReels-V2 (``SkyReelsV2Transformer3DModel``): Wan's block layout, T2V, I2V and diffusion forcing.

Its blocks are Wan's (self-attention with 3-D rotary, cross-attention, MLP) and merge as
Wan's do (:mod:`toma.adapters.families.wan`); image-to-video models add image keys to the
cross-attention, whose queries are all that merges there. Diffusion forcing passes one
timestep per latent frame, which modulates every token by its raster place: those forwards
merge in raster order. Models with ``num_frame_per_block > 1`` (autoregressive diffusion
forcing) pass every self-attention a frame-block causal mask over the unmerged tokens,
which merged tokens cannot take as it is: their forwards run unmerged, with a warning once.
"""

from __future__ import annotations

import dataclasses

import torch

from toma.adapters.spec import Grid
from toma.adapters.families.wan import SPEC as WAN


def _grid(model: torch.nn.Module, call: dict) -> Grid | str | None:
    blocks = model.config.num_frame_per_block
    if blocks > 1:
        return (
            f"{type(model).__name__} with num_frame_per_block={blocks} (causal diffusion forcing) masks "
            "self-attention frame-block causally over its unmerged tokens, a mask ToMA does not fit to merged tokens"
        )
    return WAN.grid(model, call)


SPEC = dataclasses.replace(WAN, name="skyreels-v2", classes=("SkyReelsV2Transformer3DModel",), grid=_grid)
