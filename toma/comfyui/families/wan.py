"""Wan 2.1 / 2.2 T2V and I2V: block replacement around each block (under Flux's double-block
name), which then runs on ``K`` merged video tokens. Its rotary table is ``(1, N, 1, ...)``,
tokens on dim 1. A per-token timestep (Wan 2.2 TI2V) or tokens beside the video's (VACE's
and other subclasses' context) run unmerged, with the reason."""

from toma.comfyui import hooks
from toma.comfyui.family import ComfyFamily
from toma.comfyui.sites import AloneArgs, BlockReplace, Stack, patch_video

ARGS = AloneArgs(per_token="the timestep embedding is per token (Wan 2.2 TI2V), which toma does not merge yet")

FAMILY = ComfyFamily(
    "wan",
    (hooks.WAN,),  # subclasses (VACE, Camera, ...) are not taken for it
    site=BlockReplace((Stack("blocks", hooks.WAN_BLOCKS),), ARGS.block, patch_of=patch_video),
    needs=hooks.WAN_NEEDS,
    reference=30 * 52,  # 480x832 pixels
    label="Wan",
)
