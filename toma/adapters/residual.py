"""Unmerging into the residual stream: one kernel for a merged sub-module's unmerge and add.

A merged sub-module of a transformer block computes ``x + U F(M norm(x))``. With a hook on
the sub-module alone, the unmerge ``U y`` is one kernel and the block's own ``+ x`` another.
Here the block runs a forward of toma's that hands each sub-module's residual ``x`` to the
sub-module's merge hook (through a :class:`ResidualSlot`), which returns ``x + U y`` from
one ``baddbmm`` (or one Triton launch), and the block skips its add. A sub-module that did
not merge on a call leaves the add to the block, as before.

The forward is that of a diffusers ``BasicTransformerBlock`` with ``norm_type="layer_norm"``
(SD 1.x/2.x and SDXL) and does the same maths in the same order; any call it does not cover
(4-D hidden states, GLIGEN inputs, feed-forward chunking the block still owns) runs the
block's own forward, and any other kind of block keeps it altogether.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from toma.adapters import _private
from toma.adapters.base import RESIDUAL_HOOK_NAME, Hook

__all__ = ["RESIDUAL_HOOK_NAME", "FusedResidualHook", "ResidualSlot", "fusable"]

# the parameters of BasicTransformerBlock.forward this forward stands in for
_PARAMETERS = (
    "hidden_states",
    "attention_mask",
    "encoder_hidden_states",
    "encoder_attention_mask",
    "timestep",
    "cross_attention_kwargs",
    "class_labels",
    "added_cond_kwargs",
)


class ResidualSlot:
    """The residual of the sub-module call running now, from the block's forward to the
    sub-module's merge hook; ``fused`` says whether the hook added it."""

    def __init__(self) -> None:
        self.x: torch.Tensor | None = None
        self.fused = False


def fusable(block: torch.nn.Module) -> bool:
    """Whether ``block`` is a ``BasicTransformerBlock`` whose forward :class:`FusedResidualHook` covers."""
    base = next((cls for cls in type(block).__mro__ if cls.__name__ == "BasicTransformerBlock"), None)
    if base is None or type(block).forward is not base.forward:  # a subclass's own forward may do anything
        return False
    if getattr(block, "norm_type", None) != "layer_norm" or getattr(block, "pos_embed", 0) is not None:
        return False
    if not all(hasattr(block, name) for name in ("norm1", "attn1", "attn2", "norm3", "ff", "only_cross_attention")):
        return False
    try:
        names = tuple(inspect.signature(base.forward).parameters)[1:]
    except (TypeError, ValueError):
        return False
    return names == _PARAMETERS  # another diffusers version's block: leave its forward alone


class FusedResidualHook(Hook):
    """Runs a ``BasicTransformerBlock`` with each residual add left to its sub-modules'
    merge hooks (see the module docstring).

    Copied from diffusers 0.42 ``BasicTransformerBlock.forward`` (``diffusers.models.attention``),
    the ``norm_type="layer_norm"`` path only. Modifications:

    - each of ``attn1``, ``attn2`` and ``ff`` is called through :meth:`_add`, which hands
      the residual to the sub-module's merge hook and skips the block's own add when the
      hook did it;
    - calls the copy does not cover (4-D hidden states, GLIGEN, feed-forward chunking,
      a LoRA ``scale``) run the block's own forward;
    - :func:`fusable` refuses any block whose forward or signature is not diffusers' own.
    """

    def __init__(self, slot: ResidualSlot) -> None:
        self.slot = slot

    def new_forward(
        self,
        block: torch.nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        timestep: Any = None,
        cross_attention_kwargs: dict[str, Any] | None = None,
        class_labels: Any = None,
        added_cond_kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        extra = cross_attention_kwargs or {}
        if (
            hidden_states.ndim != 3
            or "gligen" in extra
            or getattr(block, _private.CHUNK_SIZE) is not None
            or extra.get("scale") is not None
        ):
            return self.fn_ref.original_forward(
                hidden_states,
                attention_mask=attention_mask,
                encoder_hidden_states=encoder_hidden_states,
                encoder_attention_mask=encoder_attention_mask,
                timestep=timestep,
                cross_attention_kwargs=cross_attention_kwargs,
                class_labels=class_labels,
                added_cond_kwargs=added_cond_kwargs,
            )
        x = hidden_states
        context = encoder_hidden_states if block.only_cross_attention else None
        x = self._add(
            block.attn1, x, block.norm1(x), encoder_hidden_states=context, attention_mask=attention_mask, **extra
        )
        if block.attn2 is not None:
            x = self._add(
                block.attn2,
                x,
                block.norm2(x),
                encoder_hidden_states=encoder_hidden_states,
                attention_mask=encoder_attention_mask,
                **extra,
            )
        return self._add(block.ff, x, block.norm3(x))

    def _add(self, sub: torch.nn.Module, x: torch.Tensor, normed: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``x + sub(normed)``, the add done by ``sub``'s merge hook where it merged."""
        slot = self.slot
        slot.x, slot.fused = x, False
        try:
            out = sub(normed, **kwargs)
        finally:
            fused, slot.x, slot.fused = slot.fused, None, False
        return out if fused else out + x
