"""SD3 / SD3.5 (``SD3Transformer2DModel``): joint attention over [image; text], no rotary.

Each ``JointTransformerBlock`` merges the image stream of its joint attention (the text
stream passes whole) and, on SD3.5, of its image-only second attention; the MLP merges
with ``merge_mlp``. Positions are a learned embedding added at the patch embedding, so
tokens are free to move from there to the final norm.
"""

from __future__ import annotations

import torch

from toma.adapters.engine import EngineAdapter, FamilySpec, Site, image_grid, skip_first


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    sites = [Site("attn", "attn")]
    if getattr(block, "attn2", None) is not None:  # SD3.5: image-only self-attention
        sites.append(Site("attn2", "attn"))
    if getattr(block, "ff", None) is not None:
        sites.append(Site("ff", "mlp"))
    return sites


SPEC = FamilySpec(
    name="sd3",
    classes=("SD3Transformer2DModel",),
    stacks=("transformer_blocks",),
    sites=_sites,
    grid=image_grid,
    enter=("output", "pos_embed"),
    leave="norm_out",
    raster_kwargs=("block_controlnet_hidden_states",),
    default_blocks=skip_first(5),
    reference=(64, 64),  # 1024px
)
ADAPTER = EngineAdapter(SPEC)
