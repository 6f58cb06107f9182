"""FramePack (``HunyuanVideoFramepackTransformer3DModel``): HunyuanVideo's blocks behind a packed history.

The forward embeds the latents it generates, then packs clean history latents before them
(``latents_clean``, ``latents_history_2x``, ``latents_history_4x``, embedded at three
scales), so the video stream every block sees is ``[history; generated]``, with rotary
tables concatenated the same way from several calls of ``rope``; the prompt, led by the
image embedding's tokens, is the text stream. Each merged call merges the last ``N``
tokens of its video stream (``Site.text_first``), the generated latents' grid, and the
history passes whole, like text: its keys take log mass 0 under proportional attention, and
the model's key mask (ones over the video, the text's padding masked out) is cut to the
merged keys, as HunyuanVideo's is. ``merge_mlp`` merges the dual-stream blocks' video MLP
the same way. The forward keeps the last ``N`` tokens for its output.

Tokens stay in raster order: ``rope`` makes the generated latents' tables and the
history's, on other grids, and no module brackets the generated tokens alone between the
blocks.
"""

from __future__ import annotations

import torch

from toma.adapters.attention import key_bias_text_after
from toma.adapters.engine import EngineAdapter, FamilySpec, Rotary, Site, skip_first, video_grid
from toma.adapters.hunyuanvideo import _joint_mask

# one (history + N, D) table pair for the batch: the generated tokens' rows last
_ROTARY = Rotary("image_rotary_emb", None, shared=True)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    sites = [
        Site(
            "attn",
            "attn",
            rotary=_ROTARY,
            mask=("attention_mask", None),
            mask_layout=key_bias_text_after,  # the history's keys lead (log mass 0), the text's follow
            joint_mask=_joint_mask,  # ones over [history; video]: cutting its first N - K keeps the text's
            text_first=True,
        )
    ]
    if stack == "transformer_blocks":  # dual-stream: the video stream has its own MLP
        sites.append(Site("ff", "mlp", text_first=True))
    return sites


SPEC = FamilySpec(
    name="framepack",
    classes=("HunyuanVideoFramepackTransformer3DModel",),
    stacks=("transformer_blocks", "single_transformer_blocks"),
    sites=_sites,
    grid=video_grid,
    enter=("output", "x_embedder"),
    leave="norm_out",
    tile_order_ok=lambda model, call: False,  # see the module docstring
    default_blocks=skip_first(5),
    video=True,
    reference=(45, 80),  # its pipeline's 720x1280, as HunyuanVideo's
)
ADAPTER = EngineAdapter(SPEC)
