"""SD3 and SD3.5 (MMDiT): joint blocks replaced under Flux's double-block name; no rotary
table (positions are added before the blocks) and no mask, so proportional attention goes
through the attention override."""

from toma.comfyui import hooks
from toma.comfyui.family import ComfyFamily
from toma.comfyui.sites import BlockReplace, JointArgs, Stack

FAMILY = ComfyFamily(
    "sd3",
    (hooks.SD3,),
    site=BlockReplace((Stack("blocks", hooks.SD3_BLOCKS),), JointArgs(None).block),
    needs=hooks.SD3_NEEDS,
    reference=64 * 64,  # 1024x1024 pixels
    label="SD3",
)
