"""SD3 / SD3.5 (``SD3Transformer2DModel``): joint attention over [image; text], no rotary.

Each ``JointTransformerBlock`` merges the image stream of its joint attention (the text
stream passes whole) and, on SD3.5, of its image-only second attention; the MLP merges
with ``merge_mlp``. Positions are a learned embedding added at the patch embedding, so
tokens are free to move from there to the final norm.
"""

from __future__ import annotations

import torch

from toma.adapters.engine import EngineAdapter, FamilySpec, Grid, Site

SKIP_FIRST = 5  # as the authors do for Flux; not yet measured on SD3


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    sites = [Site("attn", "attn")]
    if getattr(block, "attn2", None) is not None:  # SD3.5: image-only self-attention
        sites.append(Site("attn2", "attn"))
    if getattr(block, "ff", None) is not None:
        sites.append(Site("ff", "mlp"))
    return sites


def _grid(model: torch.nn.Module, call: dict) -> Grid | None:
    latents = call.get("hidden_states")
    p = model.config.patch_size
    if latents is None or latents.ndim != 4:
        return None
    return (1, latents.shape[-2] // p, latents.shape[-1] // p)


SPEC = FamilySpec(
    name="sd3",
    classes=("SD3Transformer2DModel",),
    stacks=("transformer_blocks",),
    sites=_sites,
    grid=_grid,
    enter=("output", "pos_embed"),
    leave="norm_out",
    raster_kwargs=("block_controlnet_hidden_states",),
    default_blocks=lambda stack, n: tuple(range(min(SKIP_FIRST, n // 2), n)),
)
ADAPTER = EngineAdapter(SPEC)
