"""LongCat-Image and LongCat-Image-Edit (``LongCatImageTransformer2DModel``): Flux.1's layout.

Double-stream then single-stream blocks, text first, rotary tables from ``cat(txt_ids,
img_ids)``: the blocks, sites, grid and conditioning tokens are Flux.1's
(:mod:`toma.adapters.families.flux`). Its image ids have a first column of 1 and the edit
pipeline's reference image, after the generated one's tokens, a first column of 2: the
reference passes whole, as Kontext's. The forward takes no attention mask. Placement is
``blocks`` (the ``flux_*_blocks`` aliases are Flux.1's).
"""

from __future__ import annotations

import dataclasses

from toma.adapters.families.flux import SPEC as FLUX

SPEC = dataclasses.replace(FLUX, name="longcat-image", classes=("LongCatImageTransformer2DModel",), tile_order_ok=None)
