"""Run policy of a patched model: which plan each merged block uses, and for how long.

:class:`PlanCache` computes a plan at the first merged block of a group (blocks sharing a
token grid) in a denoising step and hands the same plan to the rest of the group,
recomputing every ``recompute_every`` steps, and never across a change of grid, batch,
dtype or device. The plans themselves, and the maths that builds and applies them, are
:mod:`toma.core.plan`'s.
"""

from __future__ import annotations

import math
from typing import Hashable

import torch

from toma.config import ToMAConfig
from toma.core.plan import Plan, build_fused_plan, build_plan
from toma.core.tiling import KernelIndex, LayoutIndex, TileLayout, kernel_index, layout_index, make_layout, to_tiles
from toma.kernels import merges_from_raster, use_triton


class PlanCache:
    """Computes plans at the first merged block of each group and reuses them.

    One cache belongs to one patched model. The model's own forward calls
    :meth:`begin_forward` (one call = one denoising step); merged blocks call :meth:`get`.

    Grids are ``(h, w)`` for images or ``(t, h, w)`` for video.

    Args:
        config: the ToMA settings.
        tile_frames: frames a tile spans on ``(t, h, w)`` grids (1: spatial tiles only).
    """

    def __init__(self, config: ToMAConfig, tile_frames: int = 1) -> None:
        self.config = config
        self.tile = (tile_frames, *config.tile)
        self.step = -1
        self.base_grid: tuple[int, ...] | None = None
        self._last_timestep: float | None = None
        self._plans: dict[Hashable, tuple[int, Plan]] = {}  # key -> (age in steps, plan)
        self._layouts: dict[tuple[tuple[int, ...], float], TileLayout] = {}
        self._indices: dict[tuple[tuple[int, ...], float, torch.device], LayoutIndex] = {}
        self._kernel_indices: dict[tuple[tuple[int, ...], float, torch.device], KernelIndex] = {}
        self._generator: torch.Generator | None = None
        self._inference = False
        self.active = True  # whether this step is inside the config's step window
        # kept out of torch.compile graphs (it reads and writes Python state); wrapped here
        # rather than with a decorator, which would import torch._dynamo (~2 s) with toma
        self.begin_forward = torch.compiler.disable(self.begin_forward)  # type: ignore[method-assign]

    def begin_forward(self, base_grid: tuple[int, ...], timestep: float | None) -> None:
        """Start a denoiser forward on a token grid of ``base_grid`` (``(h, w)`` or ``(t, h, w)``) at downsample 1.

        A timestep that rises starts a new denoising run: plans from the previous run are
        dropped so that they never carry over to another image. The same timestep again is
        another call of the same step (pipelines such as Wan's run the conditional and
        unconditional passes as two calls): the step count stays, and plans are rebuilt
        unless they are kept across steps anyway. No timestep (``None``) makes every call
        a run of its own.
        """
        last = self._last_timestep
        new_run = timestep is None or last is None or timestep > last
        # plans made under inference_mode are inference tensors, which autograd cannot save
        inference = torch.is_inference_mode_enabled()
        if new_run or base_grid != self.base_grid or inference != self._inference:
            self._plans.clear()
            self.step = 0
            if new_run:
                # random selection draws the same destinations in every run, whatever ran before
                self._generator = None
        elif timestep == last:
            if self.config.recompute_every == 1:
                self._plans.clear()
        else:
            self.step += 1
            # Plans age here rather than being compared with the step count in get(): under
            # torch.compile, get() then never reads the step, so the merge path is not
            # specialised on it and does not recompile every step.
            every = self.config.recompute_every
            self._plans = {k: (age + 1, p) for k, (age, p) in self._plans.items() if age + 1 < every}
        # a bool, not the step, is what get() reads: under torch.compile a window costs
        # one more graph, not one per step
        self.active = self.config.merges_at(self.step)
        self.base_grid = base_grid
        self._last_timestep = timestep
        self._inference = inference

    def new_run(self) -> None:
        """Make the next forward start a new denoising run, whatever its timestep.

        The timestep rule in :meth:`begin_forward` cannot see a run that stopped early
        followed by one that starts at a lower timestep (img2img, inpainting); pipelines
        call this when they set their timesteps.
        """
        self._last_timestep = None

    def reset(self) -> None:
        """Forget every plan and the step count."""
        self._plans.clear()
        self.step = -1
        self.active = True
        self.base_grid = None
        self._last_timestep = None

    def snapshot(self) -> tuple:
        """What :meth:`get`, :meth:`grid_at` and :meth:`tile_order_layout` read of the current
        forward (its grid, step-window flag and plans), for :meth:`restore`."""
        return self.base_grid, self.active, dict(self._plans)

    def restore(self, state: tuple) -> tuple:
        """Make a :meth:`snapshot` current (for a recomputation of an earlier forward's
        block); returns the state it replaces, which this puts back."""
        live = self.base_grid, self.active, self._plans
        self.base_grid, self.active, self._plans = state
        return live

    def grid_at(self, downsample: int) -> tuple[int, ...] | None:
        """Token grid at a spatial downsample factor of the base grid (conv strides round up)."""
        if self.base_grid is None or downsample == 1:
            return self.base_grid
        *t, h, w = self.base_grid
        return (*t, math.ceil(h / downsample), math.ceil(w / downsample))

    def layout(self, *grid: int, ratio: float | None = None) -> TileLayout:
        """Tile layout of an ``h x w`` or ``t x h x w`` grid under this cache's tile size and
        ``ratio`` (default: the config's ``ratio``)."""
        ratio = self.config.ratio if ratio is None else ratio
        if (grid, ratio) not in self._layouts:
            *t, h, w = grid
            self._layouts[(grid, ratio)] = make_layout(h, w, self.tile, ratio, t=t[0] if t else 1)
        return self._layouts[(grid, ratio)]

    @property
    def merging(self) -> bool:
        """Whether this forward merges anything (a ratio above 0, a step inside the window):
        where it does not, tokens must keep the model's own order, so that the output is
        bitwise the unpatched one."""
        return self.config.max_ratio > 0 and self.active

    def tile_order_layout(self, grid: tuple[int, ...], device: torch.device | None = None) -> TileLayout | None:
        """The layout whose tile order tokens on ``grid`` may be kept in between merges,
        or None where they stay in raster order (nothing merged, a padded grid whose
        tiles are not a permutation of the tokens, or tokens on a ``device`` where the
        Triton kernels merge straight from raster order, which saves the two copies)."""
        if not self.merging or (device is not None and merges_from_raster(device)):
            return None
        # the tile order is the same at every ratio; the largest ratio's layout carries it
        layout = self.layout(*grid, ratio=self.config.max_ratio)
        return None if layout.padded else layout

    def get(self, x: torch.Tensor, grid: tuple[int, ...], group: Hashable, tiled: bool = False,
            ratio: float | None = None) -> Plan | None:
        """The plan for tokens ``x`` ``(B, N, C)`` on ``grid`` at ``ratio`` (default: the
        config's ``ratio``), computed or reused.

        ``x`` is in raster order, or in tile order when ``tiled``. Returns None when nothing
        should be merged (ratio 0, a step outside the step window, or ``x`` not on ``grid``).
        """
        ratio = self.config.ratio if ratio is None else ratio
        if ratio == 0 or not self.active or x.shape[1] != math.prod(grid) or not grid[-1]:
            return None
        share = self.config.share_batch_plan
        key = (group, grid, ratio, 1 if share else x.shape[0], x.dtype, x.device)
        cached = self._plans.get(key)
        if cached is not None:
            return cached[1]
        layout = self.layout(*grid, ratio=ratio)
        src = (x[:1] if share else x).detach()  # plans are constants for autograd: nothing saved here
        index = self._indices.get((grid, ratio, x.device))
        if index is None:
            # kept for every later call: made as ordinary tensors even under inference_mode,
            # so that a training call after an inference call may save them for backward
            with torch.inference_mode(False):
                index = self._indices[(grid, ratio, x.device)] = layout_index(layout, x.device)
        kernels = None
        if use_triton(x.device):
            kernels = self._kernel_indices.get((grid, ratio, x.device))
            if kernels is None:
                with torch.inference_mode(False):
                    kernels = self._kernel_indices[(grid, ratio, x.device)] = kernel_index(layout, x.device)
        if kernels is not None and self.config.selection == "facility":
            plan = build_fused_plan(src, tiled, layout, x.dtype, index, kernels, temperature=self.config.temperature)
        else:
            tiles = src.unflatten(1, (layout.num_tiles, layout.tile_area)) if tiled else to_tiles(src, layout, index.gather_index)
            plan = build_plan(tiles, layout, x.dtype, selection=self.config.selection, temperature=self.config.temperature,
                              generator=self._random(x.device), index=index, kernels=kernels)
        self._plans[key] = (0, plan)  # (age in steps, plan)
        return plan

    def _random(self, device: torch.device) -> torch.Generator | None:
        if self.config.selection != "random":
            return None
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(self.config.seed)
        return self._generator
