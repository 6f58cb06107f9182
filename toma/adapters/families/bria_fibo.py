"""Bria FIBO (``BriaFiboTransformer2DModel``): Flux.1's layout, with text that changes per block.

Double-stream then single-stream blocks, text first, rotary tables from ``cat(txt_ids,
img_ids)`` through ``pos_embed``, the same sub-module names: the blocks, sites, grid and
conditioning tokens are Flux.1's (:mod:`toma.adapters.families.flux`). Before each block the forward
replaces half of the text's channels with that block's projection of a text-encoder layer
(``text_encoder_layers``); only the text changes, which passes every merge whole. Its
pipelines pass a bool key mask ``(B, 1, 1, text + N)`` in ``joint_attention_kwargs`` when
the prompt is padded: it holds over the image, so each merged call takes its slice, and a
mask that differs over the image runs unmerged, with a warning, as Flux's. Proportional
attention is a key bias into both processors' dispatched attention. It adds no ControlNet
residuals. Placement is ``blocks``.
"""

from __future__ import annotations

import dataclasses

from toma.adapters.families.flux import SPEC as FLUX

SPEC = dataclasses.replace(FLUX, name="bria-fibo", classes=("BriaFiboTransformer2DModel",), tile_order_ok=None)
