"""QwenImage (``QwenImageTransformer2DModel``): dual-stream joint attention with complex rotary tables.

Each block merges the image stream of its joint attention; the text stream passes whole,
and so does its mask (``encoder_hidden_states_mask``), since the processor builds the image
part of the joint mask from the merged tokens. The processor applies one complex table to
the whole batch (``freqs.unsqueeze(1)``), so merged attention runs once per sample when the
samples have plans of their own (``Rotary(shared=True)``). ``merge_mlp`` merges the image
MLP. Proportional attention reaches the joint attention's dispatch through
:func:`~toma.adapters.attention.through_dispatch`. With several images per sample
(editing), the images after the first condition it: their tokens pass whole, like text.
"""

from __future__ import annotations

import math

import torch

from toma.adapters.layouts import Conditioned, ViaCall
from toma.adapters.attention import dispatch_ok, key_bias, through_dispatch
from toma.adapters.spec import FamilySpec, Grid, RopeModule, Rotary, Site, skip_first, tile_order_unless

# image_rotary_emb is (image table (N, D/2), text table (T, D/2)), complex
_ROTARY = Rotary("image_rotary_emb", None, shared=True, items=(0,))


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    # the processor builds its own joint mask and refuses one from outside: the key bias
    # reaches its dispatch directly, with that mask folded in
    attn = Site(
        "attn",
        "attn",
        rotary=_ROTARY,
        bias=ViaCall(through_dispatch, key_bias, ok=dispatch_ok, keys="encoder_hidden_states"),
    )
    return [attn, Site("img_mlp", "mlp")]


def _grid(model: torch.nn.Module, call: dict) -> Grid | str | None:
    tokens, shapes = call.get("hidden_states"), call.get("img_shapes")
    if tokens is None or tokens.ndim != 3 or not shapes:
        return None
    # one list of (frames, h, w) per sample, or one (frames, h, w) per sample; the model
    # itself reads the first sample's
    first = shapes[0]
    first = [first] if isinstance(first, tuple) else list(first)
    # the generated image's grid; the images after it (editing) condition it and pass whole
    grid = tuple(int(v) for v in first[0])
    total = sum(math.prod(int(v) for v in shape) for shape in first)
    return grid if len(grid) == 3 and total == tokens.shape[1] else None


SPEC = FamilySpec(
    name="qwenimage",
    stream=Conditioned(),
    classes=("QwenImageTransformer2DModel",),
    stacks=("transformer_blocks",),
    sites=_sites,
    grid=_grid,
    enter=("output", "img_in"),
    leave="norm_out",
    tables=(RopeModule("pos_embed", 0, items=(0,)),),
    tile_order_ok=tile_order_unless("controlnet_block_samples"),
    default_blocks=skip_first(5),
    reference=(64, 64),  # 1024px
)
