"""Merge plans: how to merge the tokens of one grid and back.

A :class:`Plan` holds everything needed to merge and unmerge the tokens of one token
grid: the tile layout, the chosen destinations and the merge/unmerge weights. Computing
one (:func:`build_plan`) costs a selection; applying one is two batched matmuls. Which
plan a block uses, and for how long, is run policy: :class:`toma.adapters.state.PlanCache`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from toma.core.merge import assignment, cosine_similarity, destination_mass, merge, merge_weights, unmerge
from toma.core.selection import facility_location, grid_selection, random_selection
from toma.core.tiling import (  # noqa: F401  (Memo: plans' memo, kept importable from here)
    KernelIndex,
    LayoutIndex,
    Memo,
    TileLayout,
    from_tiles,
    layout_index,
    slot_raster_index,
    to_tiles,
)


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
            out = (
                out.flatten(1, 2)
                if tiled
                else from_tiles(out, lay, None if self.index is None else self.index.scatter_index)
            )
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
        out = torch.baddbmm(
            residual.reshape(b * tiles, n, c), weights.reshape(b * tiles, n, k), y.reshape(b * tiles, k, c)
        )
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
    dtype: torch.dtype,
    *,
    selection: str,
    temperature: float,
    generator: torch.Generator | None = None,
    index: LayoutIndex | None = None,
    kernels: KernelIndex | None = None,
) -> Plan:
    """Select destinations and compute merge weights for tokens in tile layout.

    Args:
        tiles: ``(Bp, T, n, C)`` tokens (from :func:`toma.core.tiling.to_tiles`).
        layout: their layout, with the per-tile keep counts.
        dtype: dtype of the activations the plan will be applied to.
        selection: ``"facility"`` (the greedy), ``"random"`` or ``"grid"``.
        temperature: the soft assignment's softmax temperature (0: hard assignment).
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
        if kernels is not None and selection == "facility":
            plan = _fused_plan(
                tiles.detach().flatten(1, 2), kernels.src_tiled, layout, temperature, dtype, index, kernels
            )
            if plan is not None:
                return plan
        return _build_plan(tiles.detach(), layout, selection, temperature, dtype, generator, index, kernels)


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


# Token norms within which normalising the tokens as they are gives bit for bit what
# cosine_similarity's scaling by powers of two gives (tests/core/test_overflow.py): the
# squares and their sums stay far from float32's overflow and subnormal range.
_NORMS_IN_RANGE = (2.0**-32, 2.0**32)


def finite_similarity(tiles: torch.Tensor) -> torch.Tensor:
    """``cosine_similarity(finite_or_zero(tiles))``, bit for bit: the similarities of
    tokens ``(..., n, C)`` whose NaN and +-inf count as 0.

    On the CPU, eager, one pass over the tokens first takes their norms. Where every norm
    is finite and within ``[2**-32, 2**32]`` (as activations are), the tokens are
    normalised as they are: a norm and a division, where cleaning, scaling and normalising
    take six passes, which cost more than the similarity's matmul at DiT widths (3x on
    Kandinsky 5's 3072 x 1792 tokens). Other tokens, and every other device (where reading
    the check would wait for the device) or a compiled graph, take the full path.
    """
    if tiles.device.type == "cpu" and not torch.compiler.is_compiling():
        x = tiles.float()
        # F.normalize's own norm call, so that the division matches it bit for bit
        norms = x.norm(2, -1, keepdim=True)
        low, high = _NORMS_IN_RANGE
        if bool(((norms >= low) & (norms <= high)).all()):  # NaN compares False
            unit = x / norms
            return unit @ unit.transpose(-1, -2)
    return cosine_similarity(finite_or_zero(tiles))


def build_fused_plan(
    x: torch.Tensor,
    tiled: bool,
    layout: TileLayout,
    dtype: torch.dtype,
    index: LayoutIndex,
    kernels: KernelIndex,
    *,
    temperature: float,
) -> Plan:
    """:func:`build_plan` for facility-location selection with the Triton kernels, straight
    from tokens ``x`` ``(Bp, N, C)`` in raster order (tile order when ``tiled``): one launch,
    no copy of the tokens into tiles. Where the plan kernel cannot run, the torch path
    builds the plan (which the merge kernels still apply)."""
    with torch.no_grad():
        plan = _fused_plan(
            x.detach(), kernels.src_tiled if tiled else kernels.src_raster, layout, temperature, dtype, index, kernels
        )
        if plan is not None:
            return plan
        tiles = (
            x.unflatten(1, (layout.num_tiles, layout.tile_area)) if tiled else to_tiles(x, layout, index.gather_index)
        )
        return _build_plan(tiles.detach(), layout, "facility", temperature, dtype, None, index, kernels)


def _fused_plan(
    x: torch.Tensor,
    src_rows: torch.Tensor,
    layout: TileLayout,
    temperature: float,
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
        planned = plan_tiles(x, src_rows, layout.slots, temperature, dtype, kernels.token_mask, kernels.keep)
    if planned is None:
        return None
    dest, a, merge_w, mass, log_mass, _ = planned
    flat_mass, flat_log = mass.flatten(1), log_mass.flatten(1)
    if index.keep_index is not None:
        flat_mass = flat_mass.index_select(1, index.keep_index)
        flat_log = flat_log.index_select(1, index.keep_index)
    # unmerge_w: a transposed view of the assignment, as on the torch path
    plan = Plan(
        layout,
        dest,
        merge_w,
        a.transpose(-1, -2),
        index.keep_index,
        index.spread_index,
        flat_mass,
        dtype,
        kernels,
        index,
    )
    plan.memo("log_mass", lambda: flat_log)  # computed by the kernel
    return plan


def _build_plan(
    tiles: torch.Tensor,
    layout: TileLayout,
    selection: str,
    temperature: float,
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
        sim = finite_similarity(tiles)
        if selection == "facility":
            dest = facility_location(sim, k, tmask)
        elif selection == "random":
            mask = None if tmask is None else tmask.expand(sim.shape[:-1])
            dest = random_selection(sim.shape[:-1], k, mask, generator=generator, device=device)
        else:
            # made once per layout and device: built from Python at every plan, the picks
            # would be copied to the device each time (a wait for the host on a GPU)
            with torch.inference_mode(False):
                picks = index.memo("grid_dest", lambda: grid_selection(layout, device))
            dest = picks.expand(tiles.shape[0], -1, -1)
    with profiled("toma::weights"):
        a = assignment(sim, dest, temperature, tmask, index.slot_mask)
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


def _as(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # plans are built in the activations' dtype: skip the call (host time) when it matches
    return weights if weights.dtype == dtype else weights.to(dtype)


def _needs_grad(x: torch.Tensor | None) -> bool:
    # the Triton kernels have no backward: training merges run the torch path
    return x is not None and x.requires_grad and torch.is_grad_enabled()
