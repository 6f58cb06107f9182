"""LTX-2 (``LTX2VideoTransformer3DModel``): a video stream and an audio stream in every block.

Each block runs, on the video tokens, self-attention (``attn1``, rotary), cross-attention
to the prompt (``attn2``), audio-to-video attention (``audio_to_video_attn``: video
queries, audio keys and values, a temporal rotary table on each side) and the MLP
(``ff``); on the audio tokens the same four (``audio_attn1``, ``audio_attn2``,
``video_to_audio_attn``, ``audio_ff``). The video sites merge as LTX's do: ``attn1`` is
self-attention (its table gathered to the merged tokens' destinations; proportional
attention reaches its dispatch through :func:`~toma.adapters.attention.through_dispatch`),
``attn2`` and the audio-to-video attention merge their queries under ``merge_crossattn``
(the audio keys, and their table, pass whole), ``ff`` obeys ``merge_mlp``. The audio stream
is never merged: it is not on the video grid. ``video_to_audio_attn`` takes the video as
its keys and values and is left alone, so it sees every video token, unmerged: the block
computes its input from the video stream outside any merged call.

Tokens run in tile order between ``proj_in`` and ``norm_out``. Two modules make video
tables, ``rope`` (self-attention) and ``cross_attn_rope`` (the time axis, for the
audio-video attentions); both follow the tokens (``FamilySpec.rope`` with two modules).
Their layout is the config's ``rope_type``: "interleaved" ``(B, N, D)`` or "split"
``(B, H, N, D/2)``; the tokens are the second-to-last dimension in both, which is where
they are reordered and gathered (:func:`~toma.adapters.spec.gather_token_rows`), so both
layouts run in tile order.

The grid is the call's ``num_frames``, ``height`` and ``width`` (latent sizes, over the
config's patch sizes). The pipelines pass ``video_coords`` too, one position per token of
that grid: the tables are computed from them and follow the tokens like the model's own.
A call with more video tokens than the grid (keyframe or reference tokens appended by the
condition and IC-LoRA pipelines) runs unmerged, with a warning once. Calls with a timestep
per token (image-to-video: the conditioning frame's tokens are clean), a
``video_self_attention_mask`` or ``video_keyframes_mask`` (both laid over the raster
sequence) run in raster order; ``attn1`` under a self-attention mask of the model's own
runs unmerged, as every site with such a mask does. LTX-2.3's options (gated attention,
prompt modulation, the perturbed processor of spatio-temporal guidance) change nothing here.
Under context parallelism (see :mod:`toma.adapters.parallel`) the video merges per shard, as
LTX's: the grid comes from the call's sizes, and ``rope``'s output, which diffusers splits,
holds every shard's rows, each run in its own tile order. diffusers 0.42.1's plan runs only
with ``isolate_modalities=True``, merged or not: it splits the video tokens but leaves
``cross_attn_rope``'s tables whole, so the audio-video attentions fail on their shapes.
"""

from __future__ import annotations

import math

import torch

from toma.adapters.layouts import ViaCall
from toma.adapters.attention import dispatch_ok, key_bias, through_dispatch
from toma.adapters.spec import (
    FamilySpec,
    Grid,
    RopeModule,
    Rotary,
    Site,
    gather_token_rows,
    skip_first,
    tile_order_unless,
)

# LTX2Attention.forward(hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb, ...)
QUERY_TABLES = Rotary("query_rotary_emb", 3, gather_token_rows)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    return [
        Site(
            "attn1",
            "attn",
            rotary=QUERY_TABLES,
            # its processor reshapes a mask per head, which a key bias does not survive
            bias=ViaCall(through_dispatch, key_bias, ok=dispatch_ok),
        ),
        Site("attn2", "cross"),
        # video queries on the audio keys: the queries' temporal table follows them
        Site("audio_to_video_attn", "cross", rotary=QUERY_TABLES),
        Site("ff", "mlp"),
    ]


def _grid(model: torch.nn.Module, call: dict) -> Grid | str | None:
    tokens = call.get("hidden_states")
    sizes = tuple(call.get(k) for k in ("num_frames", "height", "width"))
    if tokens is None or tokens.ndim != 3 or None in sizes:
        return "an LTX-2 call without num_frames, height and width gives no token grid"
    pt, p = model.config.patch_size_t, model.config.patch_size
    grid = (-(-int(sizes[0]) // pt), -(-int(sizes[1]) // p), -(-int(sizes[2]) // p))  # the rope's grid
    if math.prod(grid) != tokens.shape[1]:
        return (
            "an LTX-2 call with video tokens other than the num_frames x height x width grid's (keyframe or "
            "reference tokens appended to it) gives no token grid"
        )
    coords = call.get("video_coords")
    if isinstance(coords, torch.Tensor) and (coords.ndim != 4 or coords.shape[2] != tokens.shape[1]):
        return "LTX-2 video_coords that are not one position per video token give no token grid"
    return grid


def _tile_order_ok(model: torch.nn.Module, call: dict) -> bool:
    # a timestep per token modulates the tokens in raster order
    timestep = call.get("timestep")
    return not (isinstance(timestep, torch.Tensor) and timestep.numel() > call["hidden_states"].shape[0])


SPEC = FamilySpec(
    name="ltx2",
    classes=("LTX2VideoTransformer3DModel",),
    stacks=("transformer_blocks",),
    sites=_sites,
    grid=_grid,
    enter=("output", "proj_in"),
    leave="norm_out",
    tables=(RopeModule("rope", -2), RopeModule("cross_attn_rope", -2)),
    tile_order_ok=tile_order_unless("video_self_attention_mask", "video_keyframes_mask", check=_tile_order_ok),
    default_blocks=skip_first(5),
    video=True,
    reference=(16, 24),  # 768x512: the pipelines' default, VAE 32x
)
