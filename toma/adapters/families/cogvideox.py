"""CogVideoX 1.0 / 1.5 (``CogVideoXTransformer3DModel``): joint attention over [text; video].

Each ``CogVideoXBlock`` merges the video stream of its attention (the text stream passes
whole and stays first in the joint sequence). The 5B models take rotary tables from the
pipeline, one ``(N, D)`` table for the batch in raster order (there is no rotary module to
put them in tile order): each block's are put in the blocks' order at its call
(``block_rope``), merged or not, and gathered to the merged tokens' destinations; as
the processor applies one table to the whole batch, samples with plans of their own
(``share_batch_plan=False``) run one merged attention call each. The 2B model adds sin-cos
positions at the patch embedding. ``merge_mlp`` merges the video part of the
MLP's joint [text; video] sequence. Tiles span ``tile_frames`` latent
frames (1 by default); CogVideoX 1.5 patches ``patch_size_t`` frames into one token.
Proportional attention passes a float mask (the processor calls torch's SDPA itself, not
diffusers' dispatch, so the per-backend rule does not reach it: on a GPU that mask keeps
SDPA off its flash kernel).
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import InMask, TEXT_FIRST
from toma.adapters.spec import BlockRope, FamilySpec, Grid, Rotary, Site, skip_first

# one (N, D) table for the whole batch, in the blocks' order (block_rope)
_ROTARY = Rotary("image_rotary_emb", None, shared=True)


def _key_rows(log_mass: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """Log masses ``(Bp, text + K)`` as the ``(B, 1, text + K)`` float mask the processor's
    ``prepare_attention_mask`` repeats over heads (one row per sample, so that per-sample
    calls slice it)."""
    return log_mass[:, None, :].expand(batch, 1, -1)


def _mask_ok(attn: torch.nn.Module) -> str | None:
    # diffusers 0.42's fused processor pads a mask to the text's length, not the joint
    # sequence's, so that any mask fails there (unpatched too)
    if type(attn.processor).__name__.startswith("Fused"):
        return "its fused processor (fuse_qkv_projections) cannot take an attention mask"
    return None


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    # the MLP runs on [text; video] in one sequence: its video part merges
    return [
        Site(
            "attn1",
            "attn",
            rotary=_ROTARY,
            bias=InMask(("attention_mask", None), _key_rows, ok=_mask_ok, keys="encoder_hidden_states"),
        ),
        Site("ff", "mlp", layout=TEXT_FIRST),
    ]


def _grid(model: torch.nn.Module, call: dict) -> Grid | None:
    video = call.get("hidden_states")  # (B, F, C, H, W)
    if video is None or video.ndim != 5:
        return None
    p, pt = model.config.patch_size, model.config.patch_size_t or 1
    return (video.shape[1] // pt, video.shape[3] // p, video.shape[4] // p)


SPEC = FamilySpec(
    name="cogvideox",
    classes=("CogVideoXTransformer3DModel",),
    stacks=("transformer_blocks",),
    sites=_sites,
    grid=_grid,
    enter=("block", ""),
    leave="norm_final",
    # the blocks take the pipeline's tables as image_rotary_emb=, or 4th positionally under checkpointing
    tables=(BlockRope("image_rotary_emb", 3, 0),),
    default_blocks=skip_first(5),
    video=True,
    reference=(30, 45),  # 480x720
)
