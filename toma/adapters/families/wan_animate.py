"""Wan-Animate 2.2 (``WanAnimateTransformer3DModel``): Wan's blocks with face-motion residuals between them.

Its blocks (a copy of Wan's) merge as Wan's do (:mod:`toma.adapters.families.wan`). Every
``inject_face_latents_blocks`` blocks, a face adapter cross-attends the video tokens to a
motion vector per latent frame: it splits the token sequence into equal runs, one per
frame. Tile order keeps each frame's tokens together only while tiles span one frame, so
``tile_frames`` is 1 here and any other value is refused.

Known limit: the tokens enter tile order at the first block, not at the patch embedding as
Wan's do, because the pose embedding is added to that embedding's ``(B, C, t, h, w)`` grid.
That is inside FirstBlockCache's hook on the block, so that cache's skips may depend on the
token order, as Wan's did (not checked).
"""

from __future__ import annotations

import dataclasses

from toma.adapters.spec import Quirks
from toma.adapters.families.wan import SPEC as WAN
from toma.config import ToMAConfig

SPEC = dataclasses.replace(WAN, name="wan-animate", classes=("WanAnimateTransformer3DModel",), enter=("block", ""))


class _Quirks(Quirks):
    """Tiles of one frame."""

    def tile_frames(self, config: ToMAConfig, frames: int) -> int:
        """1: the face adapter splits the tokens per frame (see the module docstring).

        Raises:
            ValueError: ``config.tile_frames`` is another number.
        """
        if config.tile_frames not in (None, 1):
            raise ValueError(
                f"tile_frames must be 1 (or None) for {SPEC.name}: its face adapter attends frame by frame "
                f"over the token sequence, which tiles across frames would mix; got {config.tile_frames}"
            )
        return 1


QUIRKS = _Quirks()
