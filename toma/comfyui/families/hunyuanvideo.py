"""HunyuanVideo (T2V, and 1.5): Flux's block replacement, its key mask under
``attention_mask``. I2V's guiding frame is modulated apart by position, so such calls run
unmerged; nothing may follow the video's tokens."""

from toma.comfyui import hooks
from toma.comfyui.family import ComfyFamily
from toma.comfyui.families.flux import STACKS
from toma.comfyui.sites import BlockReplace, JointArgs, patch_video

ARGS = JointArgs(hooks.ARG_HUNYUAN_MASK, fixed_keys=hooks.ARG_HUNYUAN_SPANS, tail=False)

FAMILY = ComfyFamily(
    "hunyuanvideo",
    (hooks.HUNYUAN_VIDEO,),
    site=BlockReplace(STACKS, ARGS.block, patch_of=patch_video, override=False),
    needs=hooks.HUNYUAN_NEEDS,
    reference=45 * 80,  # 720x1280 pixels
    label="HunyuanVideo",
)
