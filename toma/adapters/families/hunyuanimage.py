"""HunyuanImage 2.1 (``HunyuanImageTransformer2DModel``): HunyuanVideo's blocks on an image.

Dual-stream then single-stream blocks whose attention runs over [image; text], text last,
with one ``(N, D)`` rotary table for the batch and the model's ``(B, 1, 1, N + text)`` mask
(True over the image): the sites and the mask's fitting to merged tokens are HunyuanVideo's
(:mod:`toma.adapters.families.hunyuanvideo`). Latents are ``(B, C, H, W)`` (or ``(B, C, T, H, W)``
with a 3-D ``patch_size``), patchified by ``config.patch_size``; tiles are 2-D.
"""

from __future__ import annotations

import dataclasses

import torch

from toma.adapters.spec import Grid
from toma.adapters.families.hunyuanvideo import SPEC as HUNYUANVIDEO


def _grid(model: torch.nn.Module, call: dict) -> Grid | None:
    latents = call.get("hidden_states")
    patch = tuple(model.config.patch_size)
    if latents is None or latents.ndim != 2 + len(patch):
        return None
    sizes = tuple(d // p for d, p in zip(latents.shape[2:], patch))
    return sizes if len(sizes) == 3 else (1, *sizes)


SPEC = dataclasses.replace(
    HUNYUANVIDEO,
    name="hunyuanimage",
    classes=("HunyuanImageTransformer2DModel",),
    grid=_grid,
    tile_order_ok=None,
    video=False,
    reference=(64, 64),  # 2048px
)
