"""Ideogram 4 (``Ideogram4Transformer2DModel``): one stack of blocks on a packed ``[padding; text; image]`` sequence.

The pipeline's conditional transformer takes one packed sequence per sample: left padding
up to ``max_sequence_length`` text slots, the prompt's tokens, then the image's (its
unconditional transformer takes the image's alone). Text features are added to the text
slots and the latents to the image slots of one ``(B, S, C)`` sequence, which goes through
``layers`` whole and then through ``final_layer``. Each block's attention and its SwiGLU
MLP (``feed_forward``) merge the last ``N`` tokens, the image's (``text_first``); the
padding and text before them pass whole. The per-token modulation (a per-token timestep
makes one) is applied outside the merged sub-modules.

Rotary tables come from ``rotary_emb`` over ``position_ids`` ``(B, S, 3)``, per sample
``(B, S, D)``: each merged call gets its text rows whole, then the rows of its
destinations. The forward builds a ``(B, 1, S, S)`` bool mask from ``segment_ids``: the
padding sees only itself and the text and image see each other. It holds one value over
the image's rows and columns when every image token of a sample has one segment id, as in
every call the pipeline makes; the grid reader checks that once per layout, and each merged
call then takes the mask sliced to the merged tokens (:func:`toma.core.masks.slice_joint_mask`),
exactly. A call whose image tokens span several segments (several images packed in one
row) gets a structured mask and runs unmerged, with one warning. Proportional attention is
a key bias into the processor's dispatched attention, beside that mask.

The grid is read from the image rows of ``position_ids`` (``(0, row, column)`` plus the
model's offset), which ``indicator`` marks. Between the blocks the image tokens run in tile
order (``FamilySpec.packed``): the sequence's last ``N`` tokens are reordered where it
enters the first block and back at ``final_layer``, the prefix in place, and ``position_ids``
follow them at the call, so that ``rotary_emb`` makes its tables in that order. The mask
needs no reordering: it holds one value over the image. A per-token timestep ``(B, S)``
(per-token modulation laid out in raster order) keeps raster order. The timestep is model
time in ``[0, 1]`` (0 is noise), rising over a run: the engine, which counts steps by a
falling timestep, gets its negative.
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import Fit, InMask, Packed, TEXT_FIRST
from toma.adapters.attention import key_bias
from toma.adapters.spec import FamilySpec, Grid, Rotary, Site, gather_rows, skip_first
from toma.adapters.grids import ids_grid, tensor_version
from toma.core.masks import slice_joint_mask

IMAGE = 2  # diffusers' OUTPUT_IMAGE_INDICATOR
POSITION_OFFSET = 65536  # diffusers' IMAGE_POSITION_OFFSET: image ids start there

# image_rotary_emb is (cos, sin), each (B, S, D): per sample, the image's rows last
_ROTARY = Rotary("image_rotary_emb", None, gather=gather_rows)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    return [
        Site(
            "attention",
            "attn",
            layout=TEXT_FIRST,
            rotary=_ROTARY,
            bias=InMask(("attention_mask", None), key_bias),
            fit=Fit(slice_joint_mask),
        ),
        Site("feed_forward", "mlp", layout=TEXT_FIRST),
    ]


def read_layout(ids: torch.Tensor, segments: torch.Tensor, indicator: torch.Tensor) -> Grid | str:
    """The ``(1, h, w)`` grid of the image that ends each packed sequence, or why there is
    none that merges: the image tokens (``indicator``) must be the last ``N`` of every sample,
    on one grid for the batch, within one segment per sample (else the forward's mask is
    structured over the image)."""
    image = indicator == IMAGE
    counts = image.sum(dim=1)
    tokens = int(counts[0])
    if tokens == 0 or bool((counts != tokens).any()):
        return "an Ideogram 4 batch whose samples hold different numbers of image tokens (or none) is not merged"
    if not bool(image[:, -tokens:].all()):
        return "Ideogram 4 image tokens that are not the last of the packed sequence are not merged"
    rows = ids[:, -tokens:]
    if not bool((rows == rows[:1]).all()):
        return "Ideogram 4 samples whose image position_ids differ are not merged"
    tail = segments[:, -tokens:]
    if not bool((tail == tail[:, :1]).all()):
        return (
            "segment_ids that differ over the image tokens make the attention mask structured over them, "
            "which no merged mask fits"
        )
    h, w = ids_grid((rows[0] - POSITION_OFFSET)[:, :3])
    if h * w != tokens:
        return f"position_ids span a {h}x{w} grid but the call has {tokens} image tokens"
    return (1, h, w)


class PackedImageGrid:
    """Reads the image grid of an Ideogram 4 call (see :func:`read_layout`); one per patched
    model. The pipeline passes the same layout tensors at every step (two sets: the
    conditional and the unconditional transformer's), so each is read (a host sync) once
    while it comes back unchanged."""

    KEPT = 4  # layouts remembered: the two transformers' (one model may serve both), and a spare

    def __init__(self) -> None:
        self._known: list[tuple] = []  # ((tensor, version) for ids, segments, indicator), result; newest last

    def __call__(self, model: torch.nn.Module, call: dict) -> Grid | str | None:
        hidden = call.get("hidden_states")
        layout = tuple(call.get(k) for k in ("position_ids", "segment_ids", "indicator"))
        if not isinstance(hidden, torch.Tensor) or not all(isinstance(t, torch.Tensor) for t in layout):
            return "an Ideogram 4 call without hidden_states, position_ids, segment_ids and indicator gives no grid"
        ids, segments, indicator = layout
        if ids.ndim != 3 or segments.shape != ids.shape[:2] or indicator.shape != ids.shape[:2]:
            return f"position_ids {tuple(ids.shape)} are not (B, S, 3) beside (B, S) segment_ids and indicator"
        if hidden.shape[1] != ids.shape[1]:
            return f"hidden_states hold {hidden.shape[1]} tokens, position_ids {ids.shape[1]}"
        key = tuple((t, tensor_version(t)) for t in layout)
        for seen, found in self._known:
            if all(a[0] is b[0] and a[1] == b[1] for a, b in zip(seen, key)):
                return found
        found = read_layout(ids.detach().cpu(), segments.detach().cpu(), indicator.detach().cpu())
        self._known = [*self._known[1 - self.KEPT :], (key, found)]
        return found


def falling_timestep(call: dict) -> torch.Tensor | None:
    """Ideogram 4's model time rises over a run (``1 - sigma``): the engine gets its negative."""
    t = call.get("timestep")
    return None if t is None else -t


def per_sample_timestep(model: torch.nn.Module, call: dict) -> bool:
    """Tile order only for one timestep per sample: a ``(B, S)`` one modulates each token in raster order."""
    t = call.get("timestep")
    return not (isinstance(t, torch.Tensor) and t.ndim == 2)


SPEC = FamilySpec(
    name="ideogram4",
    classes=("Ideogram4Transformer2DModel",),
    stacks=("layers",),
    sites=_sites,
    grid=PackedImageGrid,
    enter=("block", ""),
    leave="final_layer",
    stream=Packed(positions=("position_ids",)),
    tile_order_ok=per_sample_timestep,
    timestep=falling_timestep,
    default_blocks=skip_first(5),
    reference=(128, 128),  # the pipeline's 2048px: 8x VAE, 2x2 patches
)
