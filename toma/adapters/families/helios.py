"""Helios (``HeliosTransformer3DModel``): Wan's blocks behind a packed history.

The forward embeds the latents it generates, then packs history latents before them
(``latents_history_long``, ``_mid``, ``_short``, embedded at three scales), so every block
sees ``[history; generated]``, with per-batch rotary tables ``(B, S, D)`` concatenated the
same way from several calls of ``rope``. Each merged call merges the last ``N`` tokens
(``TEXT_FIRST``), the generated latents' grid, and the history passes whole: its keys
take log mass 0 under proportional attention. Its self-attention scales the history's keys
(``is_amplify_history``), which it splits off by the count of generated tokens it is
passed (``original_context_length``): the merged call gets the merged count
(``MergedCount``). The cross-attention to text (queries of the generated tokens, with
``merge_crossattn``) and the MLP (``merge_mlp``) merge the same way. The forward keeps the
last ``N`` tokens for its output.

Tokens stay in raster order: ``rope`` makes the generated latents' tables and the
history's, and no module brackets the generated tokens alone between the blocks.

Under context parallelism diffusers splits each attention's and MLP's input, history and
generated tokens together, which toma does not follow: apply_toma's hooks refuse such calls
with an error that says so.
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import InMask, MergedCount, TEXT_FIRST
from toma.adapters.attention import key_bias
from toma.adapters.spec import FamilySpec, Rotary, Site, gather_rows, skip_first, video_grid


# rotary_emb: (B, history + N, D), cos then sin; the processor broadcasts it over heads
_ROTARY = Rotary("rotary_emb", 3, gather_rows)
_COUNT = ("original_context_length", 4)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    return [
        Site(
            "attn1",
            "attn",
            layout=TEXT_FIRST,
            rotary=_ROTARY,
            bias=InMask(("attention_mask", 2), key_bias),
            rules=(MergedCount(*_COUNT),),
        ),
        Site("attn2", "cross", layout=TEXT_FIRST),
        Site("ffn", "mlp", layout=TEXT_FIRST),
    ]


SPEC = FamilySpec(
    name="helios",
    classes=("HeliosTransformer3DModel",),
    stacks=("blocks",),
    sites=_sites,
    grid=video_grid,
    enter=("grid", "patch_embedding"),
    leave="norm_out",
    tile_order_ok=lambda model, call: False,  # see the module docstring
    default_blocks=skip_first(5),
    video=True,
    reference=(24, 40),  # its pipeline's 384x640 (8x VAE, 2x2 patches)
)
