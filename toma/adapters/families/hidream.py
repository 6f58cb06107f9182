"""HiDream-I1 / E1 (``HiDreamImageTransformer2DModel``): double-stream, then single-stream blocks, image first.

Each block of both stacks wraps its transformer block as ``block``. A double-stream block
runs joint attention over ``[image; text]`` (its processor concatenates the image stream's
queries before the text's) and a mixture-of-experts MLP ``ff_i`` on the image stream; a
single-stream block runs both on one sequence ``[image; text; a Llama layer's tokens]``.
Every site merges the first ``N`` tokens of its call (``IMAGE_FIRST``): in a double
block that is the whole image stream, in a single block the image before the text, which
passes whole. The MLPs merge with ``merge_mlp``; their expert router sees merged tokens as
it sees any others.

The rotary tables come from ``pe_embedder`` over the image ids, then the text's:
``(B, N + text, 1, D/2, 2, 2)`` with the image's rows first. Tokens run in tile order from
``x_embedder`` to ``final_layer``, and the tables' image rows with them
(``RopeModule.image_first``).

The forward pads a non-square image's tokens to ``max_resolution``'s count, the pad tokens
after the image, and zeroes their keys with ``hidden_states_masks`` (ones over the image,
zeros over the padding, ones over the text). The pad tokens pass whole like the text, and
each merged attention takes the mask's last positions, one per merged token
(:func:`toma.core.masks.slice_image_first_mask`); such calls stay in raster order, as the
tokens that enter the blocks are more than the grid's. Calls that bring patchified tokens
with a mask of their own run unmerged, with one warning: the mask over the image is then
not known to be uniform. The processor calls torch's SDPA with no attention mask, so
proportional attention is not offered.
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import Fit, IMAGE_FIRST
from toma.adapters.spec import FamilySpec, Grid, RopeModule, Rotary, Site, gather_rows, skip_first
from toma.core.masks import slice_image_first_mask

# image_rotary_emb (B, N + text, 1, D/2, 2, 2): the image's rows first
_ROTARY = Rotary("image_rotary_emb", None, gather=gather_rows)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    group = "double" if stack == "double_stream_blocks" else "single"
    # a non-square image's key mask: ones over the image, zeros over the padding after it
    fit = Fit(slice_image_first_mask, slot=("hidden_states_masks", 1))
    return [
        Site("block.attn1", "attn", layout=IMAGE_FIRST, rotary=_ROTARY, fit=fit, group=group),
        Site("block.ff_i", "mlp", layout=IMAGE_FIRST, group=group),
    ]


def hidream_grid(model: torch.nn.Module, call: dict) -> Grid | str | None:
    """The ``(1, h, w)`` token grid of latents ``(B, C, H, W)``, or why the call cannot merge
    (see the module docstring)."""
    latents = call.get("hidden_states")
    if latents is None:
        return None
    if latents.ndim != 4 or call.get("hidden_states_masks") is not None:
        return "HiDream calls with patchified tokens and their own hidden_states_masks are not merged"
    p = model.config.patch_size
    return (1, latents.shape[-2] // p, latents.shape[-1] // p)


SPEC = FamilySpec(
    name="hidream",
    classes=("HiDreamImageTransformer2DModel",),
    stacks=("double_stream_blocks", "single_stream_blocks"),
    sites=_sites,
    grid=hidream_grid,
    enter=("output", "x_embedder"),
    leave="final_layer",
    tables=(RopeModule("pe_embedder", 1, image_first=True),),
    timestep=lambda call: call.get("timesteps"),
    default_blocks=skip_first(5),
    reference=(64, 64),  # 1024px: 8x VAE, 2x2 patches
)
