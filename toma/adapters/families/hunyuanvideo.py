"""HunyuanVideo (``HunyuanVideoTransformer3DModel``): dual-stream then single-stream blocks with 3-D rotary.

Every block's attention runs over [video; text] with the text last: the dual-stream
blocks pass the two streams separately, the single-stream blocks split their joint
sequence before the attention call. Each merges the video tokens of that call; its rotary
tables (one ``(N, D)`` table for the batch, from ``rope``) are gathered to the merged
tokens' destinations. The processor applies one table to the whole batch, so when the
samples have plans of their own (``share_batch_plan=False``) each merged attention runs
once per sample. The model's own attention mask spans [video; text] and masks text
padding; its video columns are all True by construction, so the merged call takes the
mask's last ``K + text`` columns (a view), which keeps the text padding masked. Under
proportional attention that mask is folded into the key bias (log mass 0 for the text keys,
``-inf`` for their padding), which diffusers' dispatch then applies by the backend's rule.
``merge_mlp`` merges the dual-stream blocks' video MLP (``ff``); a single-stream block's MLP
runs on the joint sequence and stays unmerged. Text tokens are never merged. Tiles span
``tile_frames`` latent frames (1 by default). Image-to-video models with
``image_condition_type="token_replace"`` modulate first-frame tokens by their raster place,
so they merge in raster order.
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import Fit, InMask
from toma.adapters.attention import key_bias_text_after
from toma.adapters.spec import FamilySpec, RopeModule, Rotary, Site, skip_first, video_grid
from toma.core.masks import slice_image_first_mask


def _joint_mask(mask: torch.Tensor, tokens: int, kept: int) -> torch.Tensor | None:
    """The model's ``(B, 1, 1, N + text)`` mask for ``K`` merged video tokens: its last ``K + text`` columns."""
    if mask.ndim != 4 or mask.shape[-1] < tokens:
        return None
    return slice_image_first_mask(mask, tokens, kept)


# the processor applies one (N, D) table to the whole batch: samples with plans of their
# own run one call each, with their own destinations' rows
_ROTARY = Rotary("image_rotary_emb", None, shared=True)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    # the text keys follow the video's: a key bias padded after, with the text padding folded in
    sites = [
        Site(
            "attn",
            "attn",
            rotary=_ROTARY,
            bias=InMask(("attention_mask", None), key_bias_text_after),
            fit=Fit(_joint_mask),
        )
    ]
    if stack == "transformer_blocks":  # dual-stream: the video stream has its own MLP
        sites.append(Site("ff", "mlp"))
    return sites


def _tile_order_ok(model: torch.nn.Module, call: dict) -> bool:
    return model.config.image_condition_type != "token_replace"


SPEC = FamilySpec(
    name="hunyuanvideo",
    classes=("HunyuanVideoTransformer3DModel",),
    stacks=("transformer_blocks", "single_transformer_blocks"),
    sites=_sites,
    grid=video_grid,
    enter=("output", "x_embedder"),
    leave="norm_out",
    tables=(RopeModule("rope", 0),),
    tile_order_ok=_tile_order_ok,
    default_blocks=skip_first(5),
    video=True,
    reference=(45, 80),  # 720x1280
)
