"""Z-Image (``ZImageTransformer2DModel``): refiners, then ``layers`` on ``[image; caption]``.

The forward takes lists of per-sample latents ``(C, F, H, W)`` and caption features, runs
the image tokens through ``noise_refiner`` and the caption through ``context_refiner``
(both left unmerged: two blocks each, on one part alone), then joins them image first into
one unified sequence for ``layers``. Each main block's attention and its MLP merge the
first ``N`` tokens of that sequence (``IMAGE_FIRST``); the caption after them passes
whole. The forward builds per-sample rotary tables ``freqs_cis`` ``(B, N + T, D/2)``
(complex) with the image's rows first, and passes them to every block; each merged call
gets the rows of its destinations, then the caption's.

Images of any size merge, every sample's of one size. The forward pads the image part to a
multiple of 32 tokens with a learned pad token, between the image and the caption (832x1216
is 52x76 = 3,952 tokens, padded to 3,968): the pad tokens are no image's, and pass whole
with the caption after them, their rotary rows too. Captions of different padded lengths in one batch
(a classifier-free guidance batch: the prompt and the negative prompt) make the forward
pad the shorter sequences at their end and mask those keys: the image leads every
sequence, the mask holds ones over it, and each merged attention takes its last positions,
one per merged token (:func:`toma.core.masks.slice_image_first_mask`). Other calls, and
omni mode (``[caption; images; SigLIP]`` with per-token modulation), run unmerged with one
warning saying why. Tokens stay in raster order: the image enters as a
concatenation of per-sample lists and leaves within the unified sequence, so no module
brackets the image tokens alone. Under proportional attention the bias waits for the
processor's dispatch (:func:`toma.adapters.attention.through_dispatch`), which folds in the
processor's mask; the caption's keys take log mass 0.
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import Fit, IMAGE_FIRST, ViaCall
from toma.adapters.attention import dispatch_ok, key_bias_text_after, through_dispatch
from toma.adapters.spec import FamilySpec, Grid, Rotary, Site, gather_rows, skip_first
from toma.core.masks import slice_image_first_mask

# freqs_cis (B, N + T, D/2): per sample, the image's rows first
_ROTARY = Rotary("freqs_cis", None, gather=gather_rows)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    return [
        Site(
            "attention",
            "attn",
            layout=IMAGE_FIRST,
            rotary=_ROTARY,
            # the processor reshapes its mask: the bias waits for its dispatch, and the
            # caption's keys follow the image's
            bias=ViaCall(through_dispatch, key_bias_text_after, ok=dispatch_ok),
            fit=Fit(slice_image_first_mask),  # the joint mask of sequences that differ in length
        ),
        Site("feed_forward", "mlp", layout=IMAGE_FIRST),
    ]


def zimage_grid(model: torch.nn.Module, call: dict) -> Grid | str | None:
    """The ``(f, h, w)`` token grid of a Z-Image call whose unified sequences are regular
    (see the module docstring), or the reason why the call cannot merge."""
    x, caps = call.get("x"), call.get("cap_feats")
    if not isinstance(x, (list, tuple)) or not x or not isinstance(caps, (list, tuple)):
        return "a Z-Image call without lists of latents x and cap_feats gives no token grid"
    if not isinstance(x[0], torch.Tensor):
        return "Z-Image's omni mode ([caption; images; SigLIP], per-token modulation) is not merged"
    if len({tuple(t.shape) for t in x}) != 1 or x[0].ndim != 4:
        return "Z-Image latents of different sizes in one batch are not merged"
    p, pf = call.get("patch_size", 2), call.get("f_patch_size", 1)
    _, f, h, w = x[0].shape
    return (f // pf, h // p, w // p)


def _falling_timestep(call: dict) -> torch.Tensor | None:
    """Z-Image's ``t`` is ``1 - sigma`` (the pipeline's ``(1000 - timestep) / 1000``), rising
    over a run; the engine counts steps by a falling timestep, so it gets ``-t``."""
    t = call.get("t")
    return None if t is None else -t


SPEC = FamilySpec(
    name="zimage",
    classes=("ZImageTransformer2DModel",),
    stacks=("layers",),
    sites=_sites,
    grid=zimage_grid,
    enter=("block", ""),
    leave="all_final_layer",  # never reorders: the forwards stay in raster order
    tile_order_ok=lambda model, call: False,
    timestep=_falling_timestep,
    default_blocks=skip_first(5),
    reference=(64, 64),  # 1024px: 8x VAE, 2x2 patches
)
