"""Z-Image and Lumina 2 (NextDiT): NextDiT has no block replacement, so each chosen main
layer is swapped, while the model is patched, by an object patch (:class:`NextDiTLayer`).

NextDiT's quirks: its sequence is ``[caption (padded); image; image pad]``, the reverse of
diffusers' order; the caption and the pads pass whole, their rotary rows too. Omni mode
(parts of the sequence modulated apart by ``timestep_zero_index``) and any mask but a key
mask run the layer unmerged, with the reason. Proportional attention goes through the
attention override, armed for the layer's attention call.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch

from toma.adapters.layouts import BETWEEN
from toma.comfyui import hooks
from toma.comfyui.family import ComfyFamily
from toma.comfyui.sites import Site, patch_side


def fit_key_mask(mask: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor | None:
    """A key mask over the ``length`` positions of the sequence (``(B, L)``, ``(B, 1, L)`` or
    ``(B, 1, 1, L)``, boolean or additive) taken at ``rows`` ``(Bp, L')``: ``(B', 1, 1, L')``
    additive. None where it is no key mask (it masks queries too, or its shape is another),
    which merging cannot keep."""
    if mask.shape[-1] != length or mask.ndim not in (2, 3, 4) or any(d != 1 for d in mask.shape[1:-1]):
        return None
    flat = mask.reshape(mask.shape[0], length)
    if flat.dtype == torch.bool:
        # additive, so that the key bias of proportional attention can join it
        flat = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device).masked_fill(~flat, float("-inf"))
    b = max(flat.shape[0], rows.shape[0])
    return torch.gather(flat.expand(b, -1), 1, rows.expand(b, -1))[:, None, None, :]


class NextDiTLayer:
    """One of NextDiT's main layers, merged: the layer runs on ``[caption; K merged image
    tokens; image pad]`` and its change to the image tokens is unmerged onto the full stream.

    The layer is reached through an object patch: a shallow copy of the layer
    (:meth:`stand_in`), which shares the layer's submodules, parameters and hooks (weight
    patches such as LoRA and ComfyUI's casting reach them under the same names) and whose
    ``forward`` is :meth:`forward`; ComfyUI puts the original back when it unpatches, and the
    layer itself is never changed. Each merged token takes its destination's row of
    ``freqs_cis`` (tokens on dim 1); a key mask is taken at the kept positions.
    """

    def __init__(self, run: Any, index: int, layer: torch.nn.Module, proportional: bool, multiple: Any) -> None:
        self.run, self.index, self.layer, self.proportional = run, index, layer, proportional
        self.multiple = int(multiple) if multiple else 0

    def stand_in(self) -> torch.nn.Module:
        """The object that replaces the layer while the model is patched."""
        twin = copy.copy(self.layer)  # shares _modules, _parameters, _buffers and the hooks
        twin.forward = self.forward  # on toma's copy only
        twin.toma_layer = self
        return twin

    @staticmethod
    def original(layer: Any) -> Any:
        """``layer`` without toma's stand-ins: while another patched clone of the same model
        is loaded, its stand-ins sit in the model, and ``get_model_object`` returns them."""
        while isinstance(getattr(layer, "toma_layer", None), NextDiTLayer):
            layer = layer.toma_layer.layer
        return layer

    def forward(
        self,
        x: torch.Tensor,
        x_mask: torch.Tensor | None = None,
        freqs_cis: torch.Tensor | None = None,
        adaln_input: torch.Tensor | None = None,
        timestep_zero_index: Any = None,
        transformer_options: dict | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The layer's forward, as NextDiT calls it, on merged image tokens where they merge."""
        run = self.run
        options = {} if transformer_options is None else transformer_options

        def call(seq: torch.Tensor, mask: Any, pe: Any) -> torch.Tensor:
            extra = {"timestep_zero_index": timestep_zero_index, "transformer_options": options, **kwargs}
            return self.layer.forward(seq, mask, pe, adaln_input, **extra)

        if not run.merging or run.grid is None:
            return call(x, x_mask, freqs_cis)
        if timestep_zero_index is not None:
            run.unmerged("omni mode modulates parts of the sequence apart (references), which toma does not merge")
            return call(x, x_mask, freqs_cis)
        n = math.prod(run.grid)
        length = x.shape[1]
        text = length - n - (-n % self.multiple if self.multiple else 0)
        if text < 0 or freqs_cis is None or freqs_cis.shape[1] != length:
            run.unmerged("the sequence is not [caption; image; pad] as toma expects of NextDiT")
            return call(x, x_mask, freqs_cis)
        head, image, pad = BETWEEN.split(x, text, n)
        plan = run.plan(image, run.grid, "dit")
        if plan is None:
            return call(x, x_mask, freqs_cis)
        rows = BETWEEN.kept(plan.dest_tokens.to(x.device), text, n, length)
        mask = x_mask
        if x_mask is not None:
            mask = fit_key_mask(x_mask, rows, length)
            if mask is None:
                run.unmerged(f"the attention mask {tuple(x_mask.shape)} is not a mask over keys, which merging keeps")
                return call(x, x_mask, freqs_cis)
        merged = plan.merge(image)
        k = merged.shape[1]
        pe = BETWEEN.gather(freqs_cis, rows, dim=1)
        seq = torch.cat((head, merged, pad), 1)
        if self.proportional:
            run.bias = BETWEEN.bias(plan.log_mass, text, length - text - n, x.dtype)
        try:
            out = call(seq, mask, pe)
        finally:
            run.bias = None
        out_head, out_image, out_pad = BETWEEN.split(out, text, k)
        image_out = plan.unmerge(out_image - merged, residual=image)
        run.count("layers", self.index, n, k)
        return torch.cat((out_head, image_out, out_pad), 1)


@dataclass(frozen=True)
class NextDiTLayers(Site):
    """Object patches on NextDiT's main layers (the refiners never merge)."""

    def counts(self, dm: Any) -> dict[str, int]:
        return {"layers": len(getattr(dm, hooks.NEXTDIT_LAYERS))}

    def patch(self, dm: Any) -> int:
        return patch_side(dm)

    def install(self, clone: Any, model: Any, dm: Any, run: Any, chosen: dict, proportional: bool) -> None:
        multiple = getattr(dm, hooks.NEXTDIT_PAD_MULTIPLE, None)
        for i in chosen.get("layers", ()):
            name = f"{hooks.DIFFUSION_MODEL}.{hooks.NEXTDIT_LAYERS}.{i}"
            # the layer as this model has it: another node's object patch of it is wrapped
            layer = NextDiTLayer.original(model.get_model_object(name))
            clone.add_object_patch(name, NextDiTLayer(run, i, layer, proportional, multiple).stand_in())


FAMILY = ComfyFamily(
    "zimage",
    (hooks.NEXTDIT,),  # Z-Image and Lumina 2; the pixel-space subclass is not taken for it
    site=NextDiTLayers(),
    needs=hooks.NEXTDIT_NEEDS,
    reference=64 * 64,  # 1024x1024 pixels
    label="Z-Image",
)
