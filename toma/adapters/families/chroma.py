"""Chroma (``ChromaTransformer2DModel``): Flux.1's blocks, with its pipeline's text padding mask.

Chroma is Flux.1 with pruned modulation (one approximator makes every block's shifts and
scales): double-stream then single-stream blocks, text first, rotary tables from
``cat(txt_ids, img_ids)``, the same sub-module names. The blocks, sites, grid and
conditioning tokens are Flux.1's (:mod:`toma.adapters.families.flux`). Its pipelines pass an
``attention_mask`` ``(B, text + N)`` that hides the text padding but one token and is 1 over
the image; each block turns it into the outer product ``(B, 1, S, S)``. A mask that holds one
value over the image per sample (every mask the pipelines make) merges: the grid reader
checks the model's ``(B, S)`` mask once per forward, and each merged call takes its blocks'
mask sliced to the merged tokens on both axes (:mod:`toma.core.masks`); proportional attention
adds its bias beside that per-query mask where the backend takes a float mask. A mask that
differs over the image runs unmerged, with a warning. Placement is ``blocks`` (the
``flux_*_blocks`` aliases are Flux.1's).
"""

from __future__ import annotations

import dataclasses

import torch

from toma.adapters.families.flux import SPEC as FLUX
from toma.adapters.grids import IdsGrid


class ChromaGrid(IdsGrid):
    """:class:`~toma.adapters.grids.IdsGrid`, with the mask the forward takes as ``attention_mask``."""

    MASK_NAME = "attention_mask"

    def model_mask(self, call: dict) -> torch.Tensor | None:
        """The forward's ``attention_mask`` over ``[text; image]``, if any."""
        return call.get("attention_mask")


SPEC = dataclasses.replace(FLUX, name="chroma", classes=("ChromaTransformer2DModel",), grid=ChromaGrid)
