"""PixArt-α / PixArt-Σ (``PixArtTransformer2DModel``): ``BasicTransformerBlock``s, as in the UNets.

Each block merges its self-attention (``attn1``); ``merge_crossattn`` merges the queries of
the cross-attention to text, whose mask covers the text keys and so still applies;
``merge_mlp`` the MLP. Positions are a fixed sin-cos embedding added at the patch
embedding, so tokens are free to move from there to the final norm.
"""

from __future__ import annotations

import torch

from toma.adapters.engine import EngineAdapter, FamilySpec, Grid, Site, head_mask

SKIP_FIRST = 5  # as the authors do for Flux; not yet measured on PixArt


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    return [
        Site("attn1", "attn", mask=("attention_mask", None), mask_layout=head_mask),
        Site("attn2", "cross"),
        Site("ff", "mlp"),
    ]


def _grid(model: torch.nn.Module, call: dict) -> Grid | None:
    latents = call.get("hidden_states")
    p = model.config.patch_size
    if latents is None or latents.ndim != 4:
        return None
    return (1, latents.shape[-2] // p, latents.shape[-1] // p)


SPEC = FamilySpec(
    name="pixart",
    classes=("PixArtTransformer2DModel",),
    stacks=("transformer_blocks",),
    sites=_sites,
    grid=_grid,
    enter=("output", "pos_embed"),
    leave="norm_out",
    default_blocks=lambda stack, n: tuple(range(min(SKIP_FIRST, n // 2), n)),
)
ADAPTER = EngineAdapter(SPEC)
