"""Run policy of a patched model, and its state by lifetime.

A patched model's state lives as long as one of three things, and each kind is one object
with a ``reset()``, on the model's :class:`PlanCache`:

* the patch: the tile layouts and their index tensors, built once per grid, ratio and
  device (on the cache itself);
* a denoising run (:class:`RunState`): the step count, the last timestep seen, the random
  source of ``selection="random"``;
* a forward (:class:`ForwardState`): the grid, whether this step merges, the plans, and
  the token order of each stretch between two reorder points (:class:`TokenOrder`, read
  and written through a :class:`TileState` handle).

A checkpointed block recomputed in backward must see its own forward's state, whatever
ran since (:mod:`toma.adapters.replay`): it swaps in a :meth:`ForwardState.copy` made after
that forward, which is why everything a forward's merges read lives in that one object.

:class:`PlanCache` computes a plan at the first merged block of a group (blocks sharing a
token grid) in a denoising step and hands the same plan to the rest of the group,
recomputing every ``recompute_every`` steps, and never across a change of grid, batch,
dtype or device. The plans themselves, and the maths that builds and applies them, are
:mod:`toma.core.plan`'s.
"""

from __future__ import annotations

import math
from typing import Any, Hashable

import torch

from toma.config import ToMAConfig
from toma.core.plan import Plan, build_fused_plan, build_plan, profiled
from toma.core.tiling import (
    KernelIndex,
    LayoutIndex,
    TileLayout,
    kernel_index,
    layout_index,
    lead_target,
    make_layout,
    make_span_layout,
    raster_order,
    reorder_after_prefix,
    scaled_tile_side,
    shard_target,
    tile_order,
    to_tiles,
)
from toma.kernels import merges_from_raster, use_triton


class RunState:
    """What lives as long as a denoising run; :meth:`PlanCache.begin_forward` starts a new
    one when a run starts (a timestep that rises, or after :meth:`PlanCache.new_run`).

    Attributes:
        step: the denoising step of the current forward (-1 before the first).
        last_timestep: the previous forward's timestep, or None.
        generator: the random source of ``selection="random"``, made at first use.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Back to before the first forward of a run."""
        self.step = -1
        self.last_timestep: float | None = None
        self.generator: torch.Generator | None = None


class TokenOrder:
    """The order of the tokens between two reorder points, in one forward.

    Attributes:
        layout: the tile layout the image tokens are in, or None for raster order.
        extra: conditioning tokens (of images other than the one generated) in the
            sequence; between the reorder points they lead the image tokens.
        enter: with ``extra``, the ``(N + extra,)`` index that takes the model's order (the
            image's tokens, then the conditioning ones) to the blocks' order; ``leave`` is
            its inverse.
        packed: the sequences that enter and leave the stretch may be ``[prefix; image]``
            (a ``Packed`` stream): of one longer than the image, only its last ``N``
            tokens are reordered; the prefix stays where it is.
    """

    __slots__ = ("layout", "extra", "enter", "leave", "packed")

    def __init__(self) -> None:
        self.layout: TileLayout | None = None
        self.extra = 0
        self.enter: torch.Tensor | None = None
        self.leave: torch.Tensor | None = None
        self.packed = False

    def convert(self, x: torch.Tensor, enter: bool, shard: Any = None) -> torch.Tensor:
        """Tokens ``x`` ``(B, S, C)`` from the model's order into this stretch's (``enter``),
        or back; ``x`` as is when it is not this stretch's sequence (another length), or
        while the stretch keeps the model's order. Reordering counts as merging's cost.

        Under context parallelism (``shard``: this rank's
        :class:`~toma.adapters.parallel.Shard`, with the layout a shard's), a sequence of
        every rank's tokens (before diffusers splits it, as at Qwen-Image's ``img_in``) has
        each shard's run put in its own tile order, so that the split hands each rank its
        shard in tile order.
        """
        if self.extra:  # conditioning tokens lead: one gather each way
            index = self.enter if enter else self.leave
            if x.ndim != 3 or x.shape[1] != index.numel():
                return x
            with profiled("toma::merge" if enter else "toma::unmerge"):
                return x.index_select(1, index.to(x.device))
        layout = self.layout
        if layout is None or x.ndim != 3:
            return x
        runs = shard.world if shard is not None and x.shape[1] == shard.world * layout.num_tokens else 1
        if self.packed and runs == 1 and x.shape[1] > layout.num_tokens:  # [prefix; image]: the image's part
            with profiled("toma::merge" if enter else "toma::unmerge"):
                return reorder_after_prefix(x, layout, enter)
        if x.shape[1] != runs * layout.num_tokens:
            return x
        with profiled("toma::merge" if enter else "toma::unmerge"):
            if runs == 1:
                return tile_order(x, layout) if enter else raster_order(x, layout)
            each = x.reshape(x.shape[0] * runs, layout.num_tokens, x.shape[2])
            each = tile_order(each, layout) if enter else raster_order(each, layout)
            return each.reshape(x.shape)

    def copy(self) -> "TokenOrder":
        new = TokenOrder()
        new.layout, new.extra, new.enter, new.leave = self.layout, self.extra, self.enter, self.leave
        new.packed = self.packed
        return new


class ForwardState:
    """Everything one forward's merges read: its token grid, whether it merges (the step
    window), its plans, whether they were made under ``inference_mode``, and the token
    order of each stretch between reorder points (keyed by stack; the engine's one order
    is ``"blocks"``), and under context parallelism which shard of the sequence this rank
    holds (:mod:`toma.adapters.parallel`).

    :meth:`PlanCache.begin_forward` updates it in place at each forward (plans kept across
    calls or steps stay); :meth:`copy` is what a checkpointed block's recomputation swaps
    in (:mod:`toma.adapters.replay`).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No grid, no plans, raster order everywhere."""
        self.grid: tuple[int, ...] | None = None
        self.active = True
        self.inference = False
        self.plans: dict[Hashable, tuple[int, Plan]] = {}  # key -> (age in steps, plan)
        self.orders: dict[Hashable, TokenOrder] = {}
        # under context parallelism, this rank's part of the sequence (a
        # toma.adapters.parallel.Shard); grid is then the shard's
        self.shard: tuple | None = None

    def copy(self) -> "ForwardState":
        """This forward's state as it is now, apart from later forwards' changes."""
        new = ForwardState()
        new.grid, new.active, new.inference = self.grid, self.active, self.inference
        new.plans = dict(self.plans)
        new.shard = self.shard
        new.orders = {key: order.copy() for key, order in self.orders.items()}
        return new

    def order(self, key: Hashable) -> TokenOrder:
        """The token order of stretch ``key`` in this forward (raster until set)."""
        found = self.orders.get(key)
        if found is None:
            found = self.orders[key] = TokenOrder()
        return found


class TileState:
    """A merge hook's handle on one stretch's token order: the :class:`TokenOrder` of
    ``key`` in its cache's current :class:`ForwardState`, read and written through the
    same attributes (``layout``, ``extra``, ``enter``, ``leave``)."""

    __slots__ = ("_cache", "_key")

    def __init__(self, cache: "PlanCache", key: Hashable = "blocks") -> None:
        self._cache = cache
        self._key = key

    def _now(self) -> TokenOrder:
        return self._cache.forward.order(self._key)

    @property
    def layout(self) -> TileLayout | None:
        """The tile layout the image tokens are in, or None for raster order."""
        return self._now().layout

    @layout.setter
    def layout(self, value: TileLayout | None) -> None:
        self._now().layout = value

    @property
    def shard(self) -> tuple | None:
        """This rank's :class:`toma.adapters.parallel.Shard` under context parallelism, else None (read only)."""
        return self._cache.forward.shard

    @property
    def extra(self) -> int:
        """Conditioning tokens in the sequence (see :class:`TokenOrder`)."""
        return self._now().extra

    @extra.setter
    def extra(self, value: int) -> None:
        self._now().extra = value

    @property
    def enter(self) -> torch.Tensor | None:
        """The index into the blocks' order, with conditioning tokens (see :class:`TokenOrder`)."""
        return self._now().enter

    @enter.setter
    def enter(self, value: torch.Tensor | None) -> None:
        self._now().enter = value

    @property
    def leave(self) -> torch.Tensor | None:
        """The inverse of :attr:`enter`."""
        return self._now().leave

    @leave.setter
    def leave(self, value: torch.Tensor | None) -> None:
        self._now().leave = value

    @property
    def packed(self) -> bool:
        """Whether sequences ``[prefix; image]`` have their image part reordered (see :class:`TokenOrder`)."""
        return self._now().packed

    @packed.setter
    def packed(self, value: bool) -> None:
        self._now().packed = value

    def convert(self, x: torch.Tensor, enter: bool) -> torch.Tensor:
        """See :meth:`TokenOrder.convert` (with the current forward's shard)."""
        return self._now().convert(x, enter, self._cache.forward.shard)


class PlanCache:
    """Computes plans at the first merged block of each group and reuses them.

    One cache belongs to one patched model. The model's own forward calls
    :meth:`begin_forward` (one call = one denoising step); merged blocks call :meth:`get`.

    Grids are ``(h, w)`` for images or ``(t, h, w)`` for video.

    Args:
        config: the ToMA settings.
        tile_frames: frames a tile spans on ``(t, h, w)`` grids (1: spatial tiles only).
        reference: tokens of a frame at the family's reference resolution, which
            ``tile_size="auto"`` scales tiles to (None: ``"auto"`` keeps 4x4 tiles).
    """

    def __init__(self, config: ToMAConfig, tile_frames: int = 1, reference: int | None = None) -> None:
        self.config = config
        self.tile = (tile_frames, *config.tile)
        self.reference = reference
        # the patch's lifetime: built once per grid, ratio and device
        self._layouts: dict[tuple[Hashable, float], TileLayout] = {}
        self._indices: dict[tuple[Hashable, float, torch.device], LayoutIndex] = {}
        self._kernel_indices: dict[tuple[Hashable, float, torch.device], KernelIndex] = {}
        self.run = RunState()
        self.forward = ForwardState()
        # kept out of torch.compile graphs (it reads and writes Python state); wrapped here
        # rather than with a decorator, which would import torch._dynamo (~2 s) with toma
        self.begin_forward = torch.compiler.disable(self.begin_forward)  # type: ignore[method-assign]

    # the current run's and forward's fields, under the names they have always had
    @property
    def step(self) -> int:
        """The denoising step of the current forward (see :class:`RunState`)."""
        return self.run.step

    @property
    def base_grid(self) -> tuple[int, ...] | None:
        """The current forward's token grid at downsample 1."""
        return self.forward.grid

    @property
    def active(self) -> bool:
        """Whether the current forward's step is inside the config's step window."""
        return self.forward.active

    @property
    def _plans(self) -> dict[Hashable, tuple[int, Plan]]:
        return self.forward.plans

    def begin_forward(self, base_grid: tuple[int, ...], timestep: float | None) -> None:
        """Start a denoiser forward on a token grid of ``base_grid`` (``(h, w)`` or ``(t, h, w)``) at downsample 1.

        A timestep that rises starts a new denoising run: plans from the previous run are
        dropped so that they never carry over to another image. The same timestep again is
        another call of the same step (pipelines such as Wan's run the conditional and
        unconditional passes as two calls): the step count stays, and plans are rebuilt
        unless they are kept across steps anyway. No timestep (``None``) makes every call
        a run of its own.
        """
        run, forward = self.run, self.forward
        last = run.last_timestep
        new_run = timestep is None or last is None or timestep > last
        # plans made under inference_mode are inference tensors, which autograd cannot save
        inference = torch.is_inference_mode_enabled()
        if new_run:
            # random selection draws the same destinations in every run, whatever ran before
            run.reset()
        if new_run or base_grid != forward.grid or inference != forward.inference:
            forward.plans.clear()
            run.step = 0
        elif timestep == last:
            if self.config.recompute_every == 1:
                forward.plans.clear()
        else:
            run.step += 1
            # Plans age here rather than being compared with the step count in get(): under
            # torch.compile, get() then never reads the step, so the merge path is not
            # specialised on it and does not recompile every step.
            every = self.config.recompute_every
            forward.plans = {k: (age + 1, p) for k, (age, p) in forward.plans.items() if age + 1 < every}
        # a bool, not the step, is what get() reads: under torch.compile a window costs
        # one more graph, not one per step
        forward.active = self.config.merges_at(run.step)
        forward.grid = base_grid
        forward.inference = inference
        run.last_timestep = timestep

    def new_run(self) -> None:
        """Make the next forward start a new denoising run, whatever its timestep.

        The timestep rule in :meth:`begin_forward` cannot see a run that stopped early
        followed by one that starts at a lower timestep (img2img, inpainting); pipelines
        call this when they set their timesteps.
        """
        self.run.last_timestep = None

    def reset(self) -> None:
        """Forget the run and the forward: every plan, the step count, the token orders."""
        self.run.reset()
        self.forward.reset()

    def grid_at(self, downsample: int) -> tuple[int, ...] | None:
        """Token grid at a spatial downsample factor of the base grid (conv strides round up)."""
        grid = self.forward.grid
        if grid is None or downsample == 1:
            return grid
        *t, h, w = grid
        return (*t, math.ceil(h / downsample), math.ceil(w / downsample))

    def layout(self, *grid: int, ratio: float | None = None) -> TileLayout:
        """Tile layout of an ``h x w`` or ``t x h x w`` grid under this cache's tile size and
        ``ratio`` (default: the config's ``ratio``)."""
        ratio = self.config.ratio if ratio is None else ratio
        where = self._where(grid)
        if (where, ratio) not in self._layouts:
            shard = self.forward.shard
            tile = self.tile_for(grid)
            if where is not grid:  # a context-parallel shard cut inside a row: its span of the whole grid
                t, h, w = shard.whole
                if shard.leads is not None:  # a packed shard: prefix rows, then its run of the image
                    spans, keep = lead_target(h, w, tile, ratio, shard.leads, t=t)
                    target = keep - shard.leads[spans.index(shard.span)]
                else:
                    target = shard_target(h, w, tile, ratio, shard.world, t=t)
                self._layouts[(where, ratio)] = make_span_layout(h, w, tile, ratio, shard.span, t=t, target=target)
            else:
                *t, h, w = grid
                self._layouts[(where, ratio)] = make_layout(h, w, tile, ratio, t=t[0] if t else 1)
        return self._layouts[(where, ratio)]

    def tile_for(self, grid: tuple[int, ...]) -> tuple[int, int, int]:
        """The ``(frames, height, width)`` tile of ``grid``: the config's, or under
        ``tile_size="auto"`` one scaled to the frame of the forward's whole grid (a
        context-parallel shard's tiles are those one process would use)."""
        if not self.config.auto_tile or self.reference is None:
            return self.tile
        shard = self.forward.shard
        whole = shard.whole if shard is not None and shard.whole is not None else grid
        side = scaled_tile_side(whole[-2] * whole[-1], self.reference, self.tile[1])
        return (self.tile[0], side, side)

    def _where(self, grid: tuple[int, ...]) -> Hashable:
        """What the layouts of ``grid`` depend on: the grid, and where the forward's grid
        is a context-parallel span's stand-in (:class:`toma.adapters.parallel.Shard`), the
        span and the whole grid."""
        shard = self.forward.shard
        if shard is not None and shard.span is not None and grid == self.forward.grid:
            return (grid, shard.span, shard.whole, shard.leads)
        return grid

    @property
    def merging(self) -> bool:
        """Whether this forward merges anything (a ratio above 0, a step inside the window):
        where it does not, tokens must keep the model's own order, so that the output is
        bitwise the unpatched one."""
        return self.config.max_ratio > 0 and self.forward.active

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

    def get(
        self, x: torch.Tensor, grid: tuple[int, ...], group: Hashable, tiled: bool = False, ratio: float | None = None
    ) -> Plan | None:
        """The plan for tokens ``x`` ``(B, N, C)`` on ``grid`` at ``ratio`` (default: the
        config's ``ratio``), computed or reused.

        ``x`` is in raster order, or in tile order when ``tiled``. Returns None when nothing
        should be merged (ratio 0, a step outside the step window, or ``x`` not on ``grid``).
        """
        ratio = self.config.ratio if ratio is None else ratio
        if ratio == 0 or not self.forward.active or x.shape[1] != math.prod(grid) or not grid[-1]:
            return None
        share = self.config.share_batch_plan
        where = self._where(grid)
        key = (group, where, ratio, 1 if share else x.shape[0], x.dtype, x.device)
        plans = self.forward.plans
        cached = plans.get(key)
        if cached is not None:
            return cached[1]
        layout = self.layout(*grid, ratio=ratio)
        src = (x[:1] if share else x).detach()  # plans are constants for autograd: nothing saved here
        index = self._indices.get((where, ratio, x.device))
        if index is None:
            # kept for every later call: made as ordinary tensors even under inference_mode,
            # so that a training call after an inference call may save them for backward
            with torch.inference_mode(False):
                index = self._indices[(where, ratio, x.device)] = layout_index(layout, x.device)
        kernels = None
        if use_triton(x.device):
            kernels = self._kernel_indices.get((where, ratio, x.device))
            if kernels is None:
                with torch.inference_mode(False):
                    kernels = self._kernel_indices[(where, ratio, x.device)] = kernel_index(layout, x.device)
        if kernels is not None and self.config.selection == "facility":
            plan = build_fused_plan(src, tiled, layout, x.dtype, index, kernels, temperature=self.config.temperature)
        else:
            tiles = (
                src.unflatten(1, (layout.num_tiles, layout.tile_area))
                if tiled
                else to_tiles(src, layout, index.gather_index)
            )
            plan = build_plan(
                tiles,
                layout,
                x.dtype,
                selection=self.config.selection,
                temperature=self.config.temperature,
                generator=self._random(x.device),
                index=index,
                kernels=kernels,
            )
        plans[key] = (0, plan)  # (age in steps, plan)
        return plan

    def _random(self, device: torch.device) -> torch.Generator | None:
        if self.config.selection != "random":
            return None
        run = self.run
        if run.generator is None or run.generator.device != device:
            run.generator = torch.Generator(device=device).manual_seed(self.config.seed)
        return run.generator
