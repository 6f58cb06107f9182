"""Lumina-Image 2.0 and Neta Lumina (``Lumina2Transformer2DModel``): ``layers`` on ``[caption; image]`` per sample.

The forward runs the caption through ``context_refiner`` and the image through
``noise_refiner`` (two blocks each, on one part alone, left unmerged), then joins them per
sample as ``[caption_i; image; padding]``: each sample's caption is its effective length
(the ones of ``encoder_attention_mask``), and shorter sequences are padded at their end up
to the longest, with a key mask ``(B, S)`` that only then exists. So the image starts at
another position in each sample (a per-sample prefix length).

Each main block's attention and its MLP merge the image as the last ``N`` tokens of a
``[text; image]`` sequence (``TEXT_FIRST``). Where the lengths differ, each merged
block runs on each sample's sequence rolled right by its padding, ``[padding; caption_i;
image]`` (:class:`AlignPrefixes`), with its key mask and rotary tables ``(B, S, D/2)``
(complex) rolled alike, and its output is rolled back. Attention gives each token the same
result under any permutation of the keys that moves their mask entries and rotary rows
with them, and every other op of a block is per token, so the roll changes nothing but the
order of float sums. It is done per block, so that every block's input and output stay in
the model's order: a cache that compares them (cache-dit's first blocks) sees no roll, and
a block recomputed under gradient checkpointing rolls again. The mask, ones over the image, is then fitted to
the merged tokens by slicing (:func:`toma.core.masks.slice_joint_mask`).

The attention is called as a cross-attention whose keys are its own hidden states
(``encoder_hidden_states=norm_hidden_states``): the merged call gets the merged tokens
there too (``SameTokens``). Tokens stay in raster order: the image leaves the blocks
inside the per-sample sequences, which the forward slices before unpatchifying. The
processor turns its mask to bool and calls torch's SDPA itself, so proportional attention
is not offered. The pipeline's timestep rises over a run (``1 - t / 1000``): it is negated.
"""

from __future__ import annotations

from typing import Any

import torch

from toma.adapters.layouts import Fit, SameTokens, TEXT_FIRST
from toma.adapters.base import PREFIX_HOOK_NAME, Hook, Patched
from toma.adapters.spec import FamilySpec, Quirks, Rotary, Site, gather_rows, image_grid, skip_first
from toma.core.masks import slice_joint_mask

# Lumina2TransformerBlock.forward(hidden_states, attention_mask, image_rotary_emb, temb)
MASK_INDEX, ROTARY_INDEX = 1, 2

# image_rotary_emb (B, S, D/2): per sample, the caption's rows, the image's, then zeros
_ROTARY = Rotary("image_rotary_emb", None, gather=gather_rows)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    return [
        Site(
            "attn",
            "attn",
            layout=TEXT_FIRST,
            rotary=_ROTARY,
            fit=Fit(slice_joint_mask),  # ones over the image, once the prefixes are aligned
            rules=(SameTokens("encoder_hidden_states"),),
        ),
        Site("feed_forward", "mlp", layout=TEXT_FIRST),
    ]


def roll_right(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Each sample's sequence (dimension 1) rolled right by its ``shift`` ``(B,)``: the
    last ``shift[i]`` positions of sample ``i`` move to its front."""
    length = x.shape[1]
    index = (torch.arange(length, device=x.device) - shift.to(x.device)[:, None]) % length
    return x.gather(1, index.view(*index.shape, *(1,) * (x.ndim - 2)).expand(-1, -1, *x.shape[2:]))


def roll_left(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`roll_right`."""
    return roll_right(x, -shift)


class AlignPrefixes(Hook):
    """On a merged main block: its call on each sample's sequence rolled right by the
    sample's padding, so that every image is the last ``N`` tokens (module docstring), and
    its output rolled back. The block's hidden states, key mask and rotary tables are
    rolled; the last mask and tables are remembered with their rolled forms, as every block
    of a forward gets the same ones. ``cache`` is the model's
    :class:`~toma.adapters.state.PlanCache`, which says whether the call merges."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.shift: torch.Tensor | None = None  # this call's, from pre_forward to post_forward
        self.memo: tuple[Any, ...] | None = None  # (mask, rotary, shift, rolled mask, rolled rotary)

    def reset(self) -> None:
        """Forget the call in progress and the remembered tables."""
        self.shift = None
        self.memo = None

    def _merges(self) -> bool:
        grid = self.cache.grid_at(1)
        return bool(grid is not None and grid[-1] and self.cache.active and self.cache.config.max_ratio > 0)

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        self.shift = None
        if len(args) <= ROTARY_INDEX or args[MASK_INDEX] is None or not self._merges():
            return args, kwargs  # captions of one length (no mask), or a call that merges nothing
        mask, rotary = args[MASK_INDEX], args[ROTARY_INDEX]
        memo = self.memo
        if memo is None or memo[0] is not mask or memo[1] is not rotary:
            shift = mask.shape[1] - mask.sum(dim=1)
            memo = self.memo = (mask, rotary, shift, roll_right(mask, shift), roll_right(rotary, shift))
        self.shift = memo[2]
        return (roll_right(args[0], self.shift), memo[3], memo[4], *args[ROTARY_INDEX + 1 :]), kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        shift, self.shift = self.shift, None
        return output if shift is None else roll_left(output, shift)


SPEC = FamilySpec(
    name="lumina2",
    classes=("Lumina2Transformer2DModel",),
    stacks=("layers",),
    sites=_sites,
    grid=image_grid,
    enter=("block", ""),
    leave="norm_out",  # never reorders: the forwards stay in raster order
    tile_order_ok=lambda model, call: False,
    timestep=lambda call: None if call.get("timestep") is None else -call["timestep"],
    default_blocks=skip_first(5),
    reference=(64, 64),  # 1024px: 8x VAE, 2x2 patches
)


class _Quirks(Quirks):
    """:class:`AlignPrefixes` on every merged main block."""

    def attach(self, model: torch.nn.Module, targets: list[Patched], cache: Any, ledger: Any) -> list[torch.nn.Module]:
        """:class:`AlignPrefixes` on each block a target is in, after the engine's hooks
        (innermost: inside the engine's hooks and any cache's on the block)."""
        indices = sorted({int(t.name.split(".")[1]) for t in targets if t.name.startswith("layers.")})
        blocks = [model.layers[i] for i in indices]
        for block in blocks:
            ledger.hook(block, AlignPrefixes(cache), PREFIX_HOOK_NAME)
        return blocks


QUIRKS = _Quirks()
