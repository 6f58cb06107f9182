"""ChronoEdit (``ChronoEditTransformer3DModel``): Wan 2.1 I2V's blocks, editing an image as a two-frame video.

Its blocks are Wan's own (``WanTransformerBlock``: self-attention with 3-D rotary,
cross-attention to ``[image embedding; text]``, MLP) and merge as Wan's do
(:mod:`toma.adapters.families.wan`): the video tokens of the self-attention, with their
rotary rows gathered to the merged tokens' destinations; ``merge_crossattn`` the
cross-attention's queries, ``merge_mlp`` the MLP. What differs from Wan is outside the
blocks. Its rotary module places the frames of a two-frame call (input image, edited
image, the pipeline's default) at the ends of a ``rope_temporal_skip_len`` reasoning
clip: the second frame's rows are those of frame ``skip - 1``, not 1. The tables are still
one row per token, made by the ``rope`` module, so they follow the tokens into tile order
and merge as Wan's. With temporal reasoning on, the pipeline's first steps run on the whole
reasoning clip and the rest on its two end frames: each grid gets plans of its own. It has
no context-parallel split of Wan 2.2's per-token timesteps, and toma does not merge it under
context parallelism (Wan merges there); a per-token timestep merges in raster order, as Wan's.
"""

from __future__ import annotations

import dataclasses

from toma.adapters.families.wan import SPEC as WAN

SPEC = dataclasses.replace(WAN, name="chronoedit", classes=("ChronoEditTransformer3DModel",))
