"""JoyAI-Image-Edit (``JoyImageEditTransformer3DModel``): dual-stream blocks over [image;
text].

Each of the ``double_blocks`` runs one joint attention whose processor concatenates the
image stream before the text; its image stream merges (and, with ``merge_mlp``, its image
MLP ``img_mlp``), the text stream passes whole. Latents are ``(B, C, T, H, W)`` or, for an
edit, ``(B, n, C, T, H, W)``: the model moves the last item (the generated image) first
and lays the ``n`` items out as frames of one grid, so the reference images' tokens follow
the generated image's and pass whole, as conditioning tokens. Its rotary tables come from
a method (``get_rotary_pos_embed``), not a module, as ``((cos, sin), text table or None)``
over every item's tokens in raster order: each block's are put in the blocks' order at its
call (``block_rope``). The processor applies one table to the whole batch (``view(1, S, 1,
D)``), so merged attention runs once per sample when the samples have plans of their own.
It hands diffusers' dispatch no mask (``attn_mask=None`` is written into the processor),
so proportional attention's key bias goes past it to the dispatch
(:func:`~toma.adapters.attention.through_dispatch`).
"""

from __future__ import annotations

import math

import torch

from toma.adapters.layouts import Conditioned, ViaCall
from toma.adapters.attention import dispatch_ok, key_bias_text_after, through_dispatch
from toma.adapters.spec import BlockRope, FamilySpec, Grid, Rotary, Site, skip_first

# image_rotary_emb is ((cos, sin), text table or None); cos and sin are (N + extra, D)
_ROTARY = Rotary("image_rotary_emb", 2, shared=True, items=(0,))


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    # the processor hands dispatch no mask at all: the key bias goes past it, over
    # [image; references; text], the keys after the merged image at log mass 0
    attn = Site("attn", "attn", rotary=_ROTARY, bias=ViaCall(through_dispatch, key_bias_text_after, ok=dispatch_ok))
    return [attn, Site("img_mlp", "mlp")]


def _grid(model: torch.nn.Module, call: dict) -> Grid | None:
    latents = call.get("hidden_states")
    if latents is None or latents.ndim not in (5, 6):
        return None
    pt, ph, pw = model.config.patch_size
    t, h, w = latents.shape[-3:]
    return (t // pt, h // ph, w // pw)  # the generated item's: the model puts it first


def _references(model: torch.nn.Module, call: dict) -> int:
    """Tokens of the reference items, which follow the generated image's in the blocks."""
    latents = call["hidden_states"]
    items = latents.shape[1] if latents.ndim == 6 else 1
    return (items - 1) * math.prod(_grid(model, call))


SPEC = FamilySpec(
    name="joyimage",
    classes=("JoyImageEditTransformer3DModel",),
    stacks=("double_blocks",),
    sites=_sites,
    grid=_grid,
    enter=("block", ""),
    leave="norm_out",
    # the blocks take the tables as image_rotary_emb=, or 4th positionally under checkpointing
    tables=(BlockRope("image_rotary_emb", 3, 0, items=(0,)),),
    stream=Conditioned(count=_references),
    default_blocks=skip_first(5),
    reference=(64, 64),  # 1024px: the edit pipeline's bucket base size, VAE /8, patch 2
)
