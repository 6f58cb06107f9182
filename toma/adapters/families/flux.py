"""Flux.1 (``FluxTransformer2DModel``): double-stream blocks, then single-stream blocks on ``[text; image]``.

Double-stream blocks merge the image stream of their joint attention (with ``merge_mlp``,
also their image MLP ``ff``); the text stream passes whole. A single-stream block's norm
feeds attention and the MLP in parallel, and ``proj_out`` joins them: the merge spans
from the norm's output to ``proj_out``'s, so attention and the MLP both run on the merged
image tokens (at the attention ratio) and the text passes whole. The double-stream blocks
share one plan per step and the single-stream blocks another, and the first 5 blocks of
each stack stay unmerged (the authors' setting). Rotary tables come from the image ids
through ``pos_embed``, in tile order with the tokens; the processor applies one table to
the whole batch, so merged attention runs once per sample when the samples have plans of
their own. Flux Kontext's reference image (tokens after the image's, ids of their own)
passes whole, like text. An attention mask in ``joint_attention_kwargs`` (over the joint
``[text; image]`` sequence, e.g. text padding) merges when it holds one value over the image
tokens (and any reference's) per sample: the grid reader checks that once per forward
(:func:`toma.core.masks.image_uniform`), and each merged call takes the mask's slice over
its merged tokens. A structured mask (image keys or rows that differ) runs unmerged, with a
warning.

``flux_double_blocks`` / ``flux_single_blocks`` remain as aliases of
``blocks={"transformer_blocks": ..., "single_transformer_blocks": ...}``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from toma.adapters.layouts import Conditioned, Fit, InMask, Span, TEXT_FIRST
from toma.adapters.attention import key_bias
from toma.adapters.grids import IdsGrid
from toma.adapters.spec import FamilySpec, Quirks, RopeModule, Rotary, Site, skip_first, tile_order_unless
from toma.config import ToMAConfig
from toma.core.masks import slice_joint_mask

DEFAULT_SKIP = 5  # the authors leave the first 5 double and 5 single blocks unmerged
STACKS = {"transformer_blocks": "flux_double_blocks", "single_transformer_blocks": "flux_single_blocks"}

# image_rotary_emb is (cos, sin), each (text + N, D): text rows first
_ROTARY = Rotary("image_rotary_emb", None, shared=True)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    if stack == "single_transformer_blocks":
        return [
            Site(
                "norm",
                "attn",
                layout=TEXT_FIRST,
                rotary=_ROTARY,
                bias=InMask(("attention_mask", None), key_bias),
                fit=Fit(slice_joint_mask),
                span=Span(call="attn", until="proj_out"),
                group="single",
            )
        ]
    return [
        Site(
            "attn",
            "attn",
            rotary=_ROTARY,
            bias=InMask(("attention_mask", None), key_bias, keys="encoder_hidden_states"),
            fit=Fit(slice_joint_mask),
            group="double",
        ),
        Site("ff", "mlp", group="double"),
    ]


def default_blocks(count: int) -> tuple[int, ...]:
    """Blocks merged by default: all but the first ``min(5, count // 2)``."""
    return skip_first(DEFAULT_SKIP)("", count)


SPEC = FamilySpec(
    name="flux",
    stream=Conditioned(),
    classes=("FluxTransformer2DModel",),
    stacks=tuple(STACKS),
    sites=_sites,
    grid=IdsGrid,
    enter=("output", "x_embedder"),
    leave="norm_out",
    tables=(RopeModule("pos_embed", 0),),
    # ControlNet residuals are added in raster order between blocks
    tile_order_ok=tile_order_unless("controlnet_block_samples", "controlnet_single_block_samples"),
    default_blocks=lambda stack, n: default_blocks(n),
    reference=(64, 64),  # 1024px
)


class FluxQuirks(Quirks):
    """Flux.1 also takes the ``flux_*_blocks`` aliases of ``blocks``."""

    def placement(self, taken: tuple[str, ...], hint: str) -> tuple[tuple[str, ...], str]:
        """``blocks``, or its aliases ``flux_double_blocks`` and ``flux_single_blocks``."""
        return (*taken, *STACKS.values()), hint + " (or flux_double_blocks / flux_single_blocks)"

    def config(self, model: torch.nn.Module, config: ToMAConfig) -> ToMAConfig:
        """``config`` with the aliases turned into ``blocks``.

        Raises:
            ValueError: ``blocks`` and an alias both given, or an alias's index past its stack.
        """
        aliases = {stack: getattr(config, option) for stack, option in STACKS.items()}
        if any(v is not None for v in aliases.values()):
            if config.blocks is not None:
                raise ValueError("give blocks or flux_double_blocks/flux_single_blocks, not both (they say the same)")
            for stack, option in STACKS.items():
                count = len(model.get_submodule(stack))
                bad = [i for i in aliases[stack] or () if i >= count]
                if bad:
                    raise ValueError(f"{option} must hold indices in [0, {count - 1}]; got {bad}")
            blocks = {s: default_blocks(len(model.get_submodule(s))) if v is None else v for s, v in aliases.items()}
            config = replace(config, blocks=blocks, flux_double_blocks=None, flux_single_blocks=None)
        return config


QUIRKS = FluxQuirks()
