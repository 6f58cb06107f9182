"""LTX-Video (``LTXVModel``): block replacement around each transformer block (under Flux's
double-block name), which then runs on ``K`` merged video tokens.

LTX's quirks: its rotary table is a ``(matrix, split)`` pair, tokens on the matrix's dim 1;
a per-token timestep (image-to-video conditioning through a noise mask) and the guides'
keyframe tokens or their self-attention mask run unmerged, with the reason.
"""

from typing import Any

import torch

from toma.comfyui import hooks
from toma.comfyui.family import ComfyFamily
from toma.comfyui.sites import AloneArgs, BlockReplace, Stack, patch_video, rows_on_dim1


def rotary_rows(pe: Any, positions: torch.Tensor) -> Any:
    """LTX's ``(matrix, split)`` rotary table at ``positions``: the matrix's rows, the flag as it was."""
    matrix, split = pe
    return rows_on_dim1(matrix, positions), split


def patch(dm: Any) -> tuple[int, int, int]:
    """``(frames, height, width)`` latent pixels per token, from the model's patchifier."""
    return patch_video(getattr(dm, hooks.LTX_PATCHIFIER), default=(1, 1, 1))


ARGS = AloneArgs(
    per_token="the timestep is per token (image-to-video conditioning), which toma does not merge yet",
    table=rotary_rows,
    fixed_keys=(hooks.ARG_LTX_SELF_MASK,),
)

FAMILY = ComfyFamily(
    "ltx",
    (hooks.LTXV,),  # LTX-2 (LTXAVModel, a subclass) is not taken for it
    site=BlockReplace((Stack("blocks", hooks.LTX_BLOCKS),), ARGS.block, patch_of=patch),
    needs=hooks.LTXV_NEEDS,
    reference=16 * 22,  # a 512x704 frame (32x32 pixels per token)
    label="LTX-Video",
)
