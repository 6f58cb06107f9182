"""FramePack (``HunyuanVideoFramepackTransformer3DModel``): HunyuanVideo's blocks behind a packed history.

The forward embeds the latents it generates, then packs clean history latents before them
(``latents_clean``, ``latents_history_2x``, ``latents_history_4x``, embedded at three
scales), so the video stream every block sees is ``[history; generated]``, with rotary
tables concatenated the same way from several calls of ``rope``; the prompt, led by the
image embedding's tokens, is the text stream. Each merged call merges the last ``N``
tokens of its video stream (``TEXT_FIRST``), the generated latents' grid, and the
history passes whole, like text: its keys take log mass 0 under proportional attention, and
the model's key mask (ones over the video, the text's padding masked out) is cut to the
merged keys, as HunyuanVideo's is. ``merge_mlp`` merges the dual-stream blocks' video MLP
the same way. The forward keeps the last ``N`` tokens for its output.

Tokens stay in raster order: ``rope`` makes the generated latents' tables and the
history's, on other grids, and no module brackets the generated tokens alone between the
blocks.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from toma.adapters.layouts import TEXT_FIRST
from toma.adapters.families.hunyuanvideo import SPEC as HUNYUANVIDEO
from toma.adapters.spec import FamilySpec, Site, skip_first, video_grid


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    # HunyuanVideo's: its key bias already pads the text's keys after the merged ones, and
    # a text-first merge leads them with the history's at log mass 0; its joint mask holds
    # ones over [history; video], so cutting its first N - K keys keeps the text's
    return [replace(site, layout=TEXT_FIRST) for site in HUNYUANVIDEO.sites(stack, block)]


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
