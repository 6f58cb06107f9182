"""Krea 2 (``Krea2Transformer2DModel``): one stack of single-stream blocks on ``[text; image]``.

The forward fuses the text (its own small transformer, never merged), joins it before the
image tokens once, and runs ``transformer_blocks`` on the joint sequence: each block's
attention, then its SwiGLU MLP, each with a residual. Both merge the image part of
``[text; image]`` (``text_first``); the text passes whole. Tokens enter the blocks from
``img_in`` and leave at ``final_layer`` (the forward slices the text off before it), so
they run in tile order between, and the rotary tables from ``rotary_emb`` (over the
``(text + N, 3)`` ``position_ids``, text rows first) follow them; the processor applies
one table to the whole batch (``Rotary(shared=True)``). The grid is read from the image
rows of ``position_ids``.

The forward builds its attention mask itself: the ``(B, T)`` ``encoder_attention_mask``
joined to ones over the image, ``(B, 1, 1, T + N)``. It holds one value over the image in
every call the forward can make, so each merged call takes its slice over the merged
tokens (:func:`toma.core.masks.slice_joint_mask`), exactly. Proportional attention is a
key bias into the processor's dispatched attention (text keys first, log mass 0), applied
by the backend's rule (:mod:`toma.adapters.attention`) beside that mask.
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import Fit, InMask, TEXT_FIRST
from toma.adapters.attention import key_bias
from toma.adapters.spec import FamilySpec, Grid, RopeModule, Rotary, Site, skip_first
from toma.adapters.grids import ids_grid, tensor_version
from toma.core.masks import slice_joint_mask

# image_rotary_emb is (cos, sin), each (text + N, D): text rows first
_ROTARY = Rotary("image_rotary_emb", None, shared=True)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    return [
        Site(
            "attn",
            "attn",
            layout=TEXT_FIRST,
            rotary=_ROTARY,
            bias=InMask(("attention_mask", None), key_bias),
            fit=Fit(slice_joint_mask),
        ),
        Site("ff", "mlp", layout=TEXT_FIRST),
    ]


class PositionGrid:
    """Reads the image grid from the image rows of Krea 2's ``position_ids`` (the last N of
    ``text + N`` rows, ``(0, row, column)``); one per patched model. The pipeline passes the
    same ids at every step, so they are read (a host sync) once while they come back."""

    def __init__(self) -> None:
        self._known: tuple[torch.Tensor, int, int, tuple[int, int]] | None = None  # (ids, version, text, grid)

    def __call__(self, model: torch.nn.Module, call: dict) -> Grid | str | None:
        hidden, ids, text = call.get("hidden_states"), call.get("position_ids"), call.get("encoder_hidden_states")
        if not all(isinstance(t, torch.Tensor) for t in (hidden, ids, text)):
            return "a Krea 2 call without hidden_states, encoder_hidden_states and position_ids gives no token grid"
        tokens, lead = hidden.shape[1], text.shape[1]
        if ids.ndim != 2 or ids.shape[0] != lead + tokens or tokens == 0:
            return f"position_ids of shape {tuple(ids.shape)} are not the ({lead} + {tokens}, 3) rows of the call"
        known = self._known
        if known is not None and known[0] is ids and known[1] == tensor_version(ids) and known[2] == lead:
            rows, cols = known[3]
        else:
            rows, cols = ids_grid(ids[lead:])
            self._known = (ids, tensor_version(ids), lead, (rows, cols))
        if rows * cols != tokens:
            return f"position_ids span a {rows}x{cols} grid but the call has {tokens} image tokens"
        return (1, rows, cols)


SPEC = FamilySpec(
    name="krea2",
    classes=("Krea2Transformer2DModel",),
    stacks=("transformer_blocks",),
    sites=_sites,
    grid=PositionGrid,
    enter=("output", "img_in"),
    leave="final_layer",
    tables=(RopeModule("rotary_emb", 0),),
    default_blocks=skip_first(5),
    reference=(64, 64),  # 1024px: 8x VAE, 2x2 patches
)
