"""SD 1.x, 2.x and SDXL (``UNetModel``): ``attn1_patch`` and ``attn1_output_patch`` around the
self-attention of the transformer blocks of the chosen attention levels.

The UNet's quirks: the ``blocks`` input names levels, counted from 1 at the highest
resolution that has self-attention; a level is found from a call's token count. Queries,
keys and values merge alike (unlike ComfyUI's TomePatchModel, which merges queries only),
before the projections. The feed-forward has no hook, so ``merge_mlp="on"`` is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from toma.comfyui import hooks
from toma.comfyui.family import ComfyFamily
from toma.comfyui.sites import Site


def unet_attention_levels(unet: torch.nn.Module) -> list[int]:
    """The spatial downsample factors (1, 2, 4, ...) of a ComfyUI UNet's input blocks that hold
    a SpatialTransformer, ascending: SD 1.x has ``[1, 2, 4]``, SDXL ``[2, 4]``."""
    spatial = hooks.resolve(hooks.SPATIAL_TRANSFORMER)
    down = hooks.resolve(hooks.UNET_DOWNSAMPLE)
    ds, levels = 1, []
    for block in getattr(unet, hooks.UNET_INPUT_BLOCKS):
        mods = list(block.modules())
        if any(isinstance(m, spatial) for m in mods) and ds not in levels:
            levels.append(ds)
        if any(isinstance(m, down) for m in mods):
            ds *= 2
    return levels


class UNetAttn1:
    """The UNet's self-attention, merged: ``attn1_patch`` merges the normed tokens (queries,
    keys and values alike) before the projections, and ``attn1_output_patch`` unmerges the
    attention's output before the residual add."""

    def __init__(self, run: Any, proportional: bool) -> None:
        self.run, self.proportional = run, proportional

    def _level(self, tokens: int) -> tuple[int, tuple[int, int]] | None:
        h, w = self.run.latent_hw
        for ds in self.run.levels:
            grid = (math.ceil(h / ds), math.ceil(w / ds))
            if grid[0] * grid[1] == tokens:
                return ds, grid
        return None

    def before(self, n: torch.Tensor, context: Any, value: Any, extra_options: dict) -> tuple:
        """``attn1_patch``: merge ``n`` (and the keys and values where they are ``n``)."""
        run = self.run
        if not run.merging or run.latent_hw is None:
            return n, context, value
        found = self._level(n.shape[1])
        if found is None:
            return n, context, value
        ds, grid = found
        plan = run.plan(n, grid, ("unet", ds))
        if plan is None:
            return n, context, value
        merged = plan.merge(n)
        run.pending.append((plan, merged.shape[1]))
        if self.proportional:
            run.bias = plan.log_mass
        run.count("levels", run.levels.index(ds) + 1, n.shape[1], merged.shape[1])
        return merged, merged if context is n else context, merged if value is n else value

    def after(self, n: torch.Tensor, extra_options: dict) -> torch.Tensor:
        """``attn1_output_patch``: unmerge the attention output merged by :meth:`before`."""
        run = self.run
        if not run.pending or run.pending[-1][1] != n.shape[1]:
            return n
        plan, _ = run.pending.pop()
        run.bias = None  # in case no attention call took it
        return plan.unmerge(n)


@dataclass(frozen=True)
class UNetLevels(Site):
    """attn1 patches at the chosen attention levels."""

    whole_blocks = False
    first = 1  # levels count from 1 in the input, its docs and the log line

    def counts(self, dm: Any) -> dict[str, int]:
        return {"levels": len(unet_attention_levels(dm))}

    def patch(self, dm: Any) -> int:
        return 1

    def defaults(self, dm: Any, counts: dict[str, int]) -> dict[str, tuple[int, ...]]:
        levels = unet_attention_levels(dm)
        # SDXL (no attention at full resolution) merges its top two levels, SD 1.x its top one
        default = 2 if levels and levels[0] > 1 else 1
        return {"levels": tuple(range(min(default, len(levels))))}

    def resolve(self, dm: Any, chosen: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[int, ...]], tuple]:
        levels = unet_attention_levels(dm)
        picked = chosen.get("levels", ())
        return {"levels": tuple(i + 1 for i in picked)}, tuple(levels[i] for i in picked)

    def mlp_refusal(self, merge_mlp: str, title: str) -> str | None:
        if merge_mlp == "on":
            return (
                "merge_mlp: 'on' is not available on the SD/SDXL UNet: ComfyUI's transformer block has no "
                "hook around its feed-forward; use 'auto' or 'off'"
            )
        return None

    def install(self, clone: Any, model: Any, dm: Any, run: Any, chosen: dict, proportional: bool) -> None:
        attn = UNetAttn1(run, proportional)
        clone.set_model_attn1_patch(attn.before)
        clone.set_model_attn1_output_patch(attn.after)


FAMILY = ComfyFamily(
    "unet",
    (hooks.UNET,),  # SD 1.x, 2.x and SDXL
    site=UNetLevels(),
    needs=hooks.UNET_NEEDS,
    label="the SD/SDXL UNet",
)
