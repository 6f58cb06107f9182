"""Flux.1 dev/schnell/Kontext and Flux.2 (one class): block replacement around the double and
single blocks; the block's key mask carries proportional attention, and Kontext's reference
tokens after the image pass whole."""

from toma.comfyui import hooks
from toma.comfyui.family import ComfyFamily
from toma.comfyui.sites import BlockReplace, JointArgs, Stack

STACKS = (
    Stack("double", hooks.DOUBLE_BLOCKS, hooks.DOUBLE_BLOCK),
    Stack("single", hooks.SINGLE_BLOCKS, hooks.SINGLE_BLOCK),
)

FAMILY = ComfyFamily(
    "flux",
    (hooks.FLUX,),
    site=BlockReplace(STACKS, JointArgs(hooks.ARG_FLUX_MASK).block, override=False),
    needs=hooks.FLUX_NEEDS,
    reference=64 * 64,  # 1024x1024 pixels
    label="Flux",
)
