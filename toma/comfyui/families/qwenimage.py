"""Qwen-Image and Qwen-Image-Edit: joint blocks replaced under Flux's double-block name; the
Edit references after the image pass whole; proportional attention through the attention
override (the blocks take no mask)."""

from toma.comfyui import hooks
from toma.comfyui.family import ComfyFamily
from toma.comfyui.sites import BlockReplace, JointArgs, Stack, patch_video

FAMILY = ComfyFamily(
    "qwenimage",
    (hooks.QWEN_IMAGE,),
    site=BlockReplace((Stack("blocks", hooks.QWEN_BLOCKS),), JointArgs(None).block, patch_of=patch_video),
    needs=hooks.QWEN_NEEDS,
    reference=64 * 64,  # 1024x1024 pixels
    label="Qwen-Image",
)
