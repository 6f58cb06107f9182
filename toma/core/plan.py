"""Merge plans and their reuse across blocks and denoising steps.

A :class:`Plan` holds everything needed to merge and unmerge the tokens of one token
grid: the tile layout, the chosen destinations and the merge/unmerge weights. Computing
one costs a selection; applying one is two batched matmuls. :class:`PlanCache` computes a
plan at the first merged block of a group (blocks sharing a token grid) in a denoising
step and hands the same plan to the rest of the group, recomputing every
``recompute_every`` steps, and never across a change of grid, batch, dtype or device.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from toma.config import ToMAConfig
from toma.core.merge import assignment, cosine_similarity, destination_mass, merge, merge_weights, unmerge
from toma.core.selection import facility_location, grid_selection, random_selection
from toma.core.tiling import (
    KernelIndex,
    LayoutIndex,
    TileLayout,
    from_tiles,
    kernel_index,
    layout_index,
    make_layout,
    slot_raster_index,
    to_tiles,
)
from toma.kernels import merges_from_raster, use_triton


class Memo:
    """Adds :meth:`memo`, a per-object cache of derived data, to plan classes."""

    def memo(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()``, computed on the first call with ``key`` and kept with the plan.

        For data derived from the plan that every block of its group would otherwise
        rebuild (biases and position tables in the layout an attention processor wants).
        """
        # A hand-rolled cache rather than functools.cached_property, whose lock is a
        # context manager torch.compile cannot trace (a graph break in the merge path).
        slot = "_memo_" + key
        known = self.__dict__.get(slot)
        if known is None:
            known = make()
            object.__setattr__(self, slot, known)  # plans are frozen dataclasses
        return known


@dataclass(frozen=True)
class Plan(Memo):
    """How to merge the ``N`` tokens of one grid into ``K`` and back.

    Attributes:
        layout: the tile layout (``T`` tiles of ``n`` slots, ``k`` destination slots each).
        dest: ``(Bp, T, k)`` destination slot of each destination, local to its tile.
        merge_w: ``(Bp, T, k, n)`` merge weights (rows sum to 1), in the activations' dtype.
        unmerge_w: ``(Bp, T, n, k)`` unmerge weights ``A^T`` (rows of real tokens sum to 1).
        keep_index: ``(K,)`` used slots among the ``T*k``, or None when every slot is used.
        spread_index: ``(T*k,)`` position among the ``K`` of each slot (unused slots point
            at 0, which their zero unmerge weight ignores), or None.
        mass: ``(Bp, K)`` float32 count of the tokens each merged token absorbed (the row
            sums of the assignment); see :attr:`log_mass`.
        dtype: the activations' dtype (of ``merge_w``, ``unmerge_w`` and :attr:`log_mass`).
        kernels: where the fused Triton kernels read and write (:mod:`toma.kernels`), or
            None for the torch path.
        index: the layout's :class:`~toma.core.tiling.LayoutIndex` (its gathers move
            tokens of a padded grid between raster order and tiles), or None.

    ``Bp`` is the batch size, or 1 when the plan is shared by the whole batch.
    """

    layout: TileLayout
    dest: torch.Tensor
    merge_w: torch.Tensor
    unmerge_w: torch.Tensor
    keep_index: torch.Tensor | None
    spread_index: torch.Tensor | None
    mass: torch.Tensor
    dtype: torch.dtype
    kernels: KernelIndex | None = None
    index: LayoutIndex | None = None

    @property
    def num_merged(self) -> int:
        """K, the tokens left after merging."""
        return self.layout.num_merged

    def merge(self, x: torch.Tensor, tiled: bool = False) -> torch.Tensor:
        """Merge tokens ``(B, N, C)`` into ``(B, K, C)`` (tile-major order).

        ``x`` is in raster order, or in tile order (:func:`toma.core.tiling.tile_order`) when
        ``tiled``; the latter costs no copy.
        """
        with profiled("toma::merge"):
            if self.kernels is not None and not _needs_grad(x):
                from toma.kernels.triton_ops import merge_tokens

                src = self.kernels.src_tiled if tiled else self.kernels.src_raster
                out = merge_tokens(x, _as(self.merge_w, x.dtype), src, self.kernels.dst_rows, self.num_merged)
                if out is not None:  # None: the kernel cannot run here, the torch path does
                    return out
            if tiled:
                tiles = x.unflatten(1, (self.layout.num_tiles, self.layout.tile_area))
            else:
                tiles = to_tiles(x, self.layout, None if self.index is None else self.index.gather_index)
            merged = merge(tiles, _as(self.merge_w, tiles.dtype)).flatten(1, 2)
            return merged if self.keep_index is None else merged.index_select(1, self.keep_index)

    def unmerge(self, y: torch.Tensor, tiled: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Unmerge ``(B, K, C)`` back to ``(B, N, C)``: raster order, or tile order when ``tiled``.

        With ``residual`` ``(B, N, C)`` (in the same order), returns ``residual + unmerge(y)``:
        a block's residual add done with the unmerge, in one kernel where tokens are in tile
        order (a batched ``baddbmm``) or on the Triton path, instead of two.
        """
        if residual is not None and residual.dtype != y.dtype:
            # the add promotes (a float32 residual stream under half-precision attention, say)
            return self.unmerge(y, tiled) + residual
        with profiled("toma::unmerge"):
            if self.kernels is not None and not _needs_grad(y) and not _needs_grad(residual):
                from toma.kernels.triton_ops import unmerge_tokens

                src = self.kernels.src_tiled if tiled else self.kernels.src_raster
                rows = self.layout.num_tiles * self.layout.tile_area if tiled else self.layout.num_tokens
                # unmerge_w is a transposed view of the (k, n) assignment the kernel reads
                a = _as(self.unmerge_w, y.dtype).transpose(-1, -2)
                out = unmerge_tokens(y, a, src, self.kernels.dst_rows, rows, residual)
                if out is not None:
                    return out
            if self.spread_index is not None:
                y = y.index_select(1, self.spread_index)
            lay = self.layout
            y = y.unflatten(1, (lay.num_tiles, lay.slots))
            weights = _as(self.unmerge_w, y.dtype)
            if tiled and residual is not None:
                return self._unmerge_add(y, weights, residual)
            out = unmerge(y, weights)
            out = out.flatten(1, 2) if tiled else from_tiles(out, lay, None if self.index is None else self.index.scatter_index)
            return out if residual is None else out + residual

    def _unmerge_add(self, y: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + unmerge(y)`` in tile order, one ``baddbmm``: ``y`` ``(B, T, k, C)``,
        ``weights`` ``(Bp, T, n, k)``, ``residual`` ``(B, T*n, C)``."""
        b, tiles, k, c = y.shape
        n = self.layout.tile_area
        if weights.shape[0] != b:
            # a plan shared by the batch: its weights repeated once per batch size and kept
            # (they are small), since baddbmm does not broadcast
            weights = self.memo(f"unmerge_w_{b}_{weights.dtype}", lambda: weights.expand(b, -1, -1, -1).contiguous())
        out = torch.baddbmm(residual.reshape(b * tiles, n, c), weights.reshape(b * tiles, n, k), y.reshape(b * tiles, k, c))
        return out.view(b, tiles * n, c)

    @property
    def log_mass(self) -> torch.Tensor:
        """``(Bp, K)`` log of :attr:`mass` in the activations' dtype: the additive key bias
        of proportional attention. Computed on first use and kept with the plan."""
        return self.memo("log_mass", lambda: self.mass.log().to(self.dtype))

    @property
    def dest_tokens(self) -> torch.Tensor:
        """Raster index of each merged token's destination: ``(Bp, K)`` int64.

        Used to give a merged token its destination's position (e.g. rotary embeddings).
        Computed on first use and kept with the plan.
        """
        return self.memo("dest_tokens", self._raster_dest)

    @property
    def dest_slots(self) -> torch.Tensor:
        """Tile-order index (see :func:`toma.core.tiling.tile_order`) of each merged token's
        destination: ``(Bp, K)`` int64. Computed on first use and kept with the plan."""
        return self.memo("dest_slots", self._slot_dest)

    def _slot_dest(self) -> torch.Tensor:
        lay = self.layout
        first = torch.arange(lay.num_tiles, device=self.dest.device)[:, None] * lay.tile_area
        idx = (first + self.dest).flatten(1)
        return idx if self.keep_index is None else idx.index_select(1, self.keep_index)

    def _raster_dest(self) -> torch.Tensor:
        return slot_raster_index(self.layout, self.dest.device)[self.dest_slots]


def build_plan(
    tiles: torch.Tensor,
    layout: TileLayout,
    config: ToMAConfig,
    dtype: torch.dtype,
    generator: torch.Generator | None = None,
    index: LayoutIndex | None = None,
    kernels: KernelIndex | None = None,
) -> Plan:
    """Select destinations and compute merge weights for tokens in tile layout.

    Args:
        tiles: ``(Bp, T, n, C)`` tokens (from :func:`toma.core.tiling.to_tiles`).
        layout: their layout, with the per-tile keep counts.
        config: selection method and temperature.
        dtype: dtype of the activations the plan will be applied to.
        generator: random source for ``selection="random"``.
        index: the layout's :func:`toma.core.tiling.layout_index` on ``tiles.device``, if already built.
        kernels: the layout's :func:`toma.core.tiling.kernel_index` on ``tiles.device`` to
            build and apply the plan with the Triton kernels (:mod:`toma.kernels`); None:
            the torch path.
    """
    # Plans are constants for autograd: no gradient flows through the choice of destinations
    # or the merge weights (the tokens still get theirs through the merge itself). So a
    # plan holds no graph: it can be reused across training steps, and a checkpointed block
    # saves the same tensors when it recomputes with the cached plan. Non-finite tokens
    # count as zero vectors, so that one bad sample cannot turn a plan shared with the
    # rest of its batch into NaNs.
    with torch.no_grad():
        if kernels is not None and config.selection == "facility":
            plan = _fused_plan(tiles.detach().flatten(1, 2), kernels.src_tiled, layout, config, dtype, index, kernels)
            if plan is not None:
                return plan
        clean = finite_or_zero(tiles.detach())
        return _build_plan(clean, layout, config, dtype, generator, index, kernels)


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """``x`` (any shape, floating) with NaN and +-inf replaced by 0: the values of
    ``torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)``, bit for bit.

    Eager, that is ``nan_to_num``: one kernel, ten times faster here than ``isfinite`` and
    ``where``. Under torch.compile it is ``where(isfinite(x), x, 0)``: inductor's CPU code
    for ``nan_to_num`` tests NaN one element at a time (a scalar ``std::isnan`` loop over a
    stored vector), which made a compiled plan on SD 1.5's 4096 x 320 tokens take twice as
    long (3.7 against 1.8 ms at one thread) as with ``isfinite``, which vectorises.
    """
    if torch.compiler.is_compiling():
        return torch.where(x.isfinite(), x, 0.0)
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def build_fused_plan(
    x: torch.Tensor,
    tiled: bool,
    layout: TileLayout,
    config: ToMAConfig,
    dtype: torch.dtype,
    index: LayoutIndex,
    kernels: KernelIndex,
) -> Plan:
    """:func:`build_plan` for facility-location selection with the Triton kernels, straight
    from tokens ``x`` ``(Bp, N, C)`` in raster order (tile order when ``tiled``): one launch,
    no copy of the tokens into tiles. Where the plan kernel cannot run, the torch path
    builds the plan (which the merge kernels still apply)."""
    with torch.no_grad():
        plan = _fused_plan(x.detach(), kernels.src_tiled if tiled else kernels.src_raster, layout, config, dtype, index,
                           kernels)
        if plan is not None:
            return plan
        tiles = x.unflatten(1, (layout.num_tiles, layout.tile_area)) if tiled else to_tiles(x, layout, index.gather_index)
        return _build_plan(finite_or_zero(tiles.detach()), layout, config, dtype, None, index, kernels)


def _fused_plan(
    x: torch.Tensor,
    src_rows: torch.Tensor,
    layout: TileLayout,
    config: ToMAConfig,
    dtype: torch.dtype,
    index: LayoutIndex | None,
    kernels: KernelIndex,
) -> Plan | None:
    """The plan from the plan kernel, or None where that kernel cannot run."""
    from toma.kernels.triton_ops import plan_tiles

    index = index if index is not None else layout_index(layout, x.device)
    with profiled("toma::select"):
        # similarities, the greedy, the assignment and its weights; non-finite tokens
        # count as zero vectors inside the kernel
        planned = plan_tiles(x, src_rows, layout.slots, config.temperature, dtype, kernels.token_mask, kernels.keep)
    if planned is None:
        return None
    dest, a, merge_w, mass, log_mass, _ = planned
    flat_mass, flat_log = mass.flatten(1), log_mass.flatten(1)
    if index.keep_index is not None:
        flat_mass = flat_mass.index_select(1, index.keep_index)
        flat_log = flat_log.index_select(1, index.keep_index)
    # unmerge_w: a transposed view of the assignment, as on the torch path
    plan = Plan(layout, dest, merge_w, a.transpose(-1, -2), index.keep_index, index.spread_index, flat_mass, dtype, kernels,
                index)
    plan.memo("log_mass", lambda: flat_log)  # computed by the kernel
    return plan


def _build_plan(
    tiles: torch.Tensor,
    layout: TileLayout,
    config: ToMAConfig,
    dtype: torch.dtype,
    generator: torch.Generator | None,
    index: LayoutIndex | None,
    kernels: KernelIndex | None = None,
) -> Plan:
    device = tiles.device
    k = layout.slots
    index = index if index is not None else layout_index(layout, device)
    tmask = index.token_mask
    with profiled("toma::select"):
        sim = cosine_similarity(tiles)
        if config.selection == "facility":
            dest = facility_location(sim, k, tmask)
        elif config.selection == "random":
            mask = None if tmask is None else tmask.expand(sim.shape[:-1])
            dest = random_selection(sim.shape[:-1], k, mask, generator=generator, device=device)
        else:
            dest = grid_selection(layout, device).expand(tiles.shape[0], -1, -1)
    with profiled("toma::weights"):
        a = assignment(sim, dest, config.temperature, tmask, index.slot_mask)
        mass = destination_mass(a)
        flat_mass = mass.flatten(1)
        if index.keep_index is not None:
            flat_mass = flat_mass.index_select(1, index.keep_index)
        return Plan(
            layout=layout,
            dest=dest,
            merge_w=merge_weights(a, mass).to(dtype),
            # a transposed view: batched matmul reads it as is, no copy
            unmerge_w=a.to(dtype).transpose(-1, -2),
            keep_index=index.keep_index,
            spread_index=index.spread_index,
            mass=flat_mass,
            dtype=dtype,
            kernels=kernels,
            index=index,
        )


def profiled(name: str) -> contextlib.AbstractContextManager:
    """A ``torch.profiler`` range called ``name`` around a hot-path step.

    Free when no profiler runs (an open range costs two dispatcher calls, which on a
    launch-bound GPU forward add up over dozens of merged blocks); inside torch.compile it
    is left out (the compiler would only warn that it ignores it).
    """
    if torch.compiler.is_compiling() or not torch.autograd._profiler_enabled():
        return _NO_RANGE
    return torch.profiler.record_function(name)


_NO_RANGE = contextlib.nullcontext()  # stateless, so one instance serves every call


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
            plan = build_fused_plan(src, tiled, layout, self.config, x.dtype, index, kernels)
        else:
            tiles = src.unflatten(1, (layout.num_tiles, layout.tile_area)) if tiled else to_tiles(src, layout, index.gather_index)
            plan = build_plan(tiles, layout, self.config, x.dtype, self._random(x.device), index, kernels)
        self._plans[key] = (0, plan)  # (age in steps, plan)
        return plan

    def _random(self, device: torch.device) -> torch.Generator | None:
        if self.config.selection != "random":
            return None
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(self.config.seed)
        return self._generator


def _as(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # plans are built in the activations' dtype: skip the call (host time) when it matches
    return weights if weights.dtype == dtype else weights.to(dtype)


def _needs_grad(x: torch.Tensor | None) -> bool:
    # the Triton kernels have no backward: training merges run the torch path
    return x is not None and x.requires_grad and torch.is_grad_enabled()
