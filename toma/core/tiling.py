"""Spatial and spatio-temporal tiles of a raster-ordered token grid.

Tokens arrive as ``(B, N, C)`` with ``N = t * h * w`` in raster order (frames, then rows,
then columns; ``t = 1`` for images). Selection and merging happen independently inside
tiles of ``tt x th x tw`` tokens, batched as ``(B, T, n, C)`` with ``T`` tiles of
``n = tt * th * tw`` slots each. Grids whose sides the tile does not divide are padded at
the end of each axis; padded slots are masked out of selection and merging, and each tile
keeps destinations in proportion to its real tokens.

Moving between the raster and the tile layout is a view, a pad when needed and one
permute: no gather or scatter over the sequence.

A layout may cover only a contiguous run of the grid's raster tokens (a context-parallel
rank's shard, :func:`make_span_layout`): it holds the grid's tiles that the run touches,
and the slots of those tiles outside the run are masked like padding, wherever the run
starts and ends (in the middle of a row too). Such a layout always goes through gathers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TileLayout:
    """How a ``t x h x w`` token grid is cut into tiles, and how many tokens each tile keeps.

    Attributes:
        h, w: token grid rows and columns.
        th, tw: tile size in tokens along rows and columns.
        gh, gw: number of tile rows and columns (the grid is padded up to ``gh*th x gw*tw``).
        keep: tokens each tile keeps, one entry per tile in row-major tile order
            (tile frames, then tile rows, then tile columns).
        t, tt, gt: frames, tile extent in frames and tiles along time (1 for images).
        span: the raster tokens ``[start, stop)`` of the grid the layout covers (see
            :func:`make_span_layout`), or None for all of them.
        tiles: with ``span``, the grid's tiles (numbers in row-major tile order) that hold
            tokens of the span, in that order; ``keep`` has one entry per tile here.
    """

    h: int
    w: int
    th: int
    tw: int
    gh: int
    gw: int
    keep: tuple[int, ...] = field(repr=False)
    t: int = 1
    tt: int = 1
    gt: int = 1
    span: tuple[int, int] | None = None
    tiles: tuple[int, ...] | None = field(default=None, repr=False)

    @property
    def grid(self) -> tuple[int, int, int]:
        """``(t, h, w)``."""
        return (self.t, self.h, self.w)

    @property
    def num_tokens(self) -> int:
        """N, the real tokens in the grid (in the span, for a span layout)."""
        if self.span is not None:
            return self.span[1] - self.span[0]
        return self.t * self.h * self.w

    @property
    def num_tiles(self) -> int:
        """T, the number of tiles (those the span touches, for a span layout)."""
        if self.tiles is not None:
            return len(self.tiles)
        return self.gt * self.gh * self.gw

    @property
    def tile_area(self) -> int:
        """n, the slots per tile (including padding)."""
        return self.tt * self.th * self.tw

    @property
    def slots(self) -> int:
        """k, destination slots per tile (the most any tile keeps)."""
        return max(self.keep)

    @property
    def num_merged(self) -> int:
        """K, the number of tokens left after merging."""
        return sum(self.keep)

    @property
    def padded(self) -> bool:
        """Whether the tiles overhang the grid (or, for a span layout, have masked slots:
        always treated so, since its tiles are no view of the span's tokens)."""
        if self.span is not None:
            return True
        return self.gt * self.tt != self.t or self.gh * self.th != self.h or self.gw * self.tw != self.w

    @property
    def uniform(self) -> bool:
        """Whether every tile keeps the same number of tokens (no slot needs masking)."""
        return min(self.keep) == max(self.keep)


def make_layout(h: int, w: int, tile: tuple[int, ...], ratio: float, t: int = 1) -> TileLayout:
    """Cut a ``t x h x w`` grid into tiles of ``tile`` and size each tile's keep.

    ``tile`` is ``(th, tw)`` or ``(tt, th, tw)``. A tile with ``p`` real tokens keeps
    ``round(p * (1 - ratio))`` of them, at least one. A tile larger than the grid is
    shrunk to the grid.
    """
    tt, th, tw = (1, *tile) if len(tile) == 2 else tile
    tt, th, tw = min(tt, t), min(th, h), min(tw, w)
    gt, gh, gw = math.ceil(t / tt), math.ceil(h / th), math.ceil(w / tw)
    keep = []
    for f in range(gt):
        frames = min(tt, t - f * tt)
        for i in range(gh):
            rows = min(th, h - i * th)
            for j in range(gw):
                real = frames * rows * min(tw, w - j * tw)
                keep.append(max(1, min(real, math.floor(real * (1.0 - ratio) + 0.5))))
    return TileLayout(h=h, w=w, th=th, tw=tw, gh=gh, gw=gw, keep=tuple(keep), t=t, tt=tt, gt=gt)


def make_span_layout(
    h: int, w: int, tile: tuple[int, ...], ratio: float, span: tuple[int, int], t: int = 1, target: int | None = None
) -> TileLayout:
    """The layout of the raster tokens ``span = (start, stop)`` of a ``t x h x w`` grid: the
    grid's tiles of ``tile`` that hold any of them, the slots outside the span masked.

    A tile with ``p`` tokens in the span keeps ``round(p * (1 - ratio))``, at least one, as
    in :func:`make_layout`; with ``target``, keeps are then moved one at a time (added from
    the first tile on, or taken from the last tile back, staying within ``[1, p]``) until
    they sum to ``target``, so that several spans can keep the same number of tokens.
    """
    start, stop = span
    if not 0 <= start < stop <= t * h * w:
        raise ValueError(f"span must be a non-empty run of the {t * h * w} tokens of a {t}x{h}x{w} grid; got {span}")
    whole = make_layout(h, w, tile, ratio, t=t)
    slots = _grid_slot_tokens(whole)
    counts = ((slots >= start) & (slots < stop)).sum(1).tolist()
    tiles = [i for i, c in enumerate(counts) if c]
    real = [counts[i] for i in tiles]
    keep = [max(1, min(p, math.floor(p * (1.0 - ratio) + 0.5))) for p in real]
    if target is not None:
        if not len(tiles) <= target <= stop - start:
            raise ValueError(
                f"target must be between the span's {len(tiles)} tiles and its {stop - start} tokens; got {target}"
            )
        order = range(len(keep)) if target > sum(keep) else range(len(keep) - 1, -1, -1)
        while sum(keep) != target:
            step = 1 if target > sum(keep) else -1
            for i in order:
                if sum(keep) == target:
                    break
                if 1 <= keep[i] + step <= real[i]:
                    keep[i] += step
    return TileLayout(
        h=h,
        w=w,
        th=whole.th,
        tw=whole.tw,
        gh=whole.gh,
        gw=whole.gw,
        keep=tuple(keep),
        t=t,
        tt=whole.tt,
        gt=whole.gt,
        span=(start, stop),
        tiles=tuple(tiles),
    )


def scaled_tile_side(frame_tokens: int, reference_tokens: int | None, base: int = 4) -> int:
    """The tile side, ``base`` or ``base // 2``, whose tiles a frame of ``frame_tokens``
    holds about as many of as a reference frame of ``reference_tokens`` holds ``base`` tiles.

    Of the two sides, the one whose tile count is nearer on a log scale: ``base // 2`` when
    the frame has under half the reference's tokens, else ``base`` (also with no reference).
    Never larger than ``base``: larger grids keep ``base``-sided tiles.
    """
    if reference_tokens is None or base < 2 or 2 * frame_tokens >= reference_tokens:
        return base
    return base // 2


def shard_target(h: int, w: int, tile: tuple[int, ...], ratio: float, world: int, t: int = 1) -> int:
    """The tokens every one of ``world`` equal runs of a ``t x h x w`` grid's raster tokens
    keeps (the ``target`` of :func:`make_span_layout`): ``floor(K / world)`` for the whole
    grid's ``K`` (:func:`make_layout`), so that the runs together keep between ``K - world + 1``
    and ``K`` tokens, moved into the range every run can keep (at least one token per tile
    it touches, at most its tokens) where the floor falls outside it."""
    tokens = t * h * w
    if tokens % world:
        raise ValueError(f"world must divide the {tokens} tokens of a {t}x{h}x{w} grid; got {world}")
    return lead_target(h, w, tile, ratio, (0,) * world, t=t)[1]  # the packed rule with no prefix


def lead_spans(leads: tuple[int, ...], tokens: int) -> tuple[tuple[int, int], ...]:
    """The runs ``(start, stop)`` of ``tokens`` image tokens that equal shards of a packed
    sequence hold after their ``leads[r]`` prefix rows (see :func:`lead_target`)."""
    world, prefix = len(leads), sum(leads)
    if world < 1 or min(leads) < 0 or (prefix + tokens) % world:
        raise ValueError(f"leads must be {world} counts >= 0 whose sum plus {tokens} divides by {world}; got {leads}")
    n = (prefix + tokens) // world
    if max(leads) >= n:
        raise ValueError(f"every shard of {n} rows must hold image tokens; got leads {leads}")
    spans, start = [], 0
    for lead in leads:
        spans.append((start, start + n - lead))
        start += n - lead
    return tuple(spans)


def lead_target(
    h: int, w: int, tile: tuple[int, ...], ratio: float, leads: tuple[int, ...], t: int = 1
) -> tuple[tuple[tuple[int, int], ...], int]:
    """Equal shards of a packed sequence ``[prefix; t x h x w image]`` whose prefix rows are
    spread over them: shard ``r`` holds ``leads[r]`` prefix rows, then a run of the image's
    raster tokens. Returns each shard's run ``(start, stop)`` and the length ``K`` every
    shard keeps, prefix included (shard ``r``'s image keeps ``K - leads[r]``, the ``target``
    of :func:`make_span_layout`).

    ``K = floor((K1 + L) / P)`` for the whole image's ``K1`` (:func:`make_layout`) and the
    ``L`` prefix rows over ``P`` shards, so that the shards' images together keep between
    ``K1 - P + 1`` and ``K1``; moved into the range every shard can keep (each tile it touches
    keeps one, at most its tokens) where that falls outside it. With no prefix this is
    :func:`shard_target`.
    """
    world, prefix, tokens = len(leads), sum(leads), t * h * w
    spans = lead_spans(leads, tokens)
    n = (prefix + tokens) // world
    whole = make_layout(h, w, tile, ratio, t=t)
    least = max(lead + make_span_layout(h, w, tile, ratio, span, t=t).num_tiles for lead, span in zip(leads, spans))
    return tuple(spans), min(n, max(least, (whole.num_merged + prefix) // world))


def _grid_slot_tokens(layout: TileLayout) -> torch.Tensor:
    """``(T, n)`` raster index of every slot's token over the whole grid of ``layout`` (all
    its tiles), -1 for slots past the grid's edges."""
    pt, ph, pw = _padded_shape(layout)
    frames, rows, cols = torch.arange(pt), torch.arange(ph), torch.arange(pw)
    index = (frames[:, None, None] * layout.h + rows[None, :, None]) * layout.w + cols[None, None, :]
    inside = (frames < layout.t)[:, None, None] & (rows < layout.h)[None, :, None] & (cols < layout.w)[None, None, :]
    index = index.masked_fill(~inside, -1)
    return _grid_to_tiles(index[None, ..., None], layout)[0, :, :, 0]


def _span_slots(layout: TileLayout, device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A span layout's ``(T, n)`` index of each slot's token within the span, and which
    slots hold one (the others point at the nearest token of the span)."""
    start, stop = layout.span
    slots = _grid_slot_tokens(layout)[list(layout.tiles)]
    real = (slots >= start) & (slots < stop)
    # masked slots read a token of the span (never out of range) and are masked out of
    # selection and merging
    index = slots.masked_fill(slots < 0, stop - 1).clamp(start, stop - 1) - start
    return index.to(device), real.to(device)


def tile_extents(layout: TileLayout, tile: int) -> tuple[int, int, int]:
    """Real ``(frames, rows, columns)`` of tile number ``tile`` (edge tiles are cut by the grid)."""
    f, rest = divmod(tile, layout.gh * layout.gw)
    i, j = divmod(rest, layout.gw)
    return (
        min(layout.tt, layout.t - f * layout.tt),
        min(layout.th, layout.h - i * layout.th),
        min(layout.tw, layout.w - j * layout.tw),
    )


def token_mask(layout: TileLayout, device: torch.device | str | None = None) -> torch.Tensor | None:
    """Which tile slots hold real tokens: ``(T, n)`` bool, or None when nothing is padded."""
    if not layout.padded:
        return None
    if layout.span is not None:
        return _span_slots(layout, device)[1]
    grid = torch.zeros(*_padded_shape(layout), dtype=torch.bool, device=device)
    grid[: layout.t, : layout.h, : layout.w] = True
    return _grid_to_tiles(grid[None, ..., None], layout)[0, :, :, 0]


def slot_mask(layout: TileLayout, device: torch.device | str | None = None) -> torch.Tensor | None:
    """Which destination slots are used: ``(T, k)`` bool, or None when every tile keeps ``k``."""
    if layout.uniform:
        return None
    keep = torch.tensor(layout.keep, device=device)
    return torch.arange(layout.slots, device=device)[None, :] < keep[:, None]


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
class LayoutIndex(Memo):
    """A layout's padding as device tensors; built once per layout and device and reused.

    Attributes:
        token_mask: ``(T, n)`` bool, False for padded slots; None when nothing is padded.
        slot_mask: ``(T, k)`` bool, False for unused destination slots; None when every
            tile keeps ``k``.
        keep_index: ``(K,)`` the used slots among the ``T*k``, or None when all are used.
        spread_index: ``(T*k,)`` position among the ``K`` of each slot (unused slots point
            at 0), or None.
        gather_index: for a padded layout, ``(T*n,)`` the raster token each slot reads
            (:func:`slot_raster_index`: padded slots read the nearest real token), else None.
        scatter_index: for a padded layout, ``(N,)`` the slot of each raster token, else None.
    """

    token_mask: torch.Tensor | None
    slot_mask: torch.Tensor | None
    keep_index: torch.Tensor | None
    spread_index: torch.Tensor | None
    gather_index: torch.Tensor | None = None
    scatter_index: torch.Tensor | None = None


def layout_index(layout: TileLayout, device: torch.device | str | None = None) -> LayoutIndex:
    """The :class:`LayoutIndex` of ``layout`` on ``device``.

    Index tensors come from the layout's Python description (no ``nonzero`` on the device,
    which would wait for the GPU).
    """
    # built on the host, where the boolean selection reads no device data, then copied
    real = token_mask(layout, "cpu")
    mask = gather = scatter = None
    if real is not None:
        slots, flat = slot_raster_index(layout, "cpu"), real.flatten()
        # every real slot writes its index at its token's place; padded slots write at a
        # spare place past the tokens, dropped after: no boolean selection (a data-dependent
        # shape, which torch.compile cannot trace when a plan is first built in a graph)
        places = torch.where(flat, slots, layout.num_tokens)
        scatter = torch.empty(layout.num_tokens + 1, dtype=torch.long).scatter_(0, places, torch.arange(slots.numel()))
        scatter = scatter[: layout.num_tokens]
        mask, gather, scatter = real.to(device), slots.to(device), scatter.to(device)
    if layout.uniform:
        return LayoutIndex(mask, None, None, None, gather, scatter)
    k = layout.slots
    keep, spread, seen = [], [], 0
    for t, kept in enumerate(layout.keep):
        keep += range(t * k, t * k + kept)
        spread += [seen + j for j in range(kept)] + [0] * (k - kept)
        seen += kept
    as_index = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return LayoutIndex(mask, slot_mask(layout, device), as_index(keep), as_index(spread), gather, scatter)


def to_tiles(x: torch.Tensor, layout: TileLayout, gather: torch.Tensor | None = None) -> torch.Tensor:
    """Raster tokens ``(B, N, C)`` to tiles ``(B, T, n, C)``; padded slots hold zeros.

    With a padded layout's ``gather`` index (:class:`LayoutIndex`), one gather instead of a
    pad and a permutation (two copies), and padded slots hold copies of their nearest real
    token instead: for plans and merges, which mask padded slots out, the same.
    """
    b, n, c = x.shape
    if n != layout.num_tokens:
        raise ValueError(f"expected {layout.num_tokens} tokens for a {layout.t}x{layout.h}x{layout.w} grid, got {n}")
    if gather is None and layout.span is not None:
        gather = slot_raster_index(layout, x.device)
    if gather is not None and layout.padded:
        return x.index_select(1, gather).view(b, layout.num_tiles, layout.tile_area, c)
    grid = x.view(b, layout.t, layout.h, layout.w, c)
    if layout.padded:
        pt, ph, pw = _padded_shape(layout)
        grid = F.pad(grid, (0, 0, 0, pw - layout.w, 0, ph - layout.h, 0, pt - layout.t))
    return _grid_to_tiles(grid, layout)


def tile_order(x: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Raster tokens ``(B, N, C)`` to ``(B, T*n, C)`` in tile order (one copy).

    Only for layouts without padding, whose tile order is a permutation of the tokens.
    """
    _check_unpadded(layout)
    return to_tiles(x, layout).flatten(1, 2)


def _check_unpadded(layout: TileLayout) -> None:
    """Raise unless ``layout``'s tile order is a permutation of its tokens (no padding)."""
    if layout.padded:
        raise ValueError(
            f"a {layout.t}x{layout.h}x{layout.w} grid is padded by {layout.tt}x{layout.th}x{layout.tw} tiles: "
            "no tile order"
        )


def raster_order(x: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Inverse of :func:`tile_order`: ``(B, T*n, C)`` back to raster ``(B, N, C)``."""
    return from_tiles(x.unflatten(1, (layout.num_tiles, layout.tile_area)), layout)


def reorder_after_prefix(x: torch.Tensor, layout: TileLayout, enter: bool) -> torch.Tensor:
    """A packed sequence ``[prefix; image]`` ``(B, P + N, C)`` with its image part in tile
    order (``enter``; :func:`tile_order`) or back in raster order (:func:`raster_order`), the
    prefix in place: the values of concatenating the prefix and the reordered image, written
    into one new tensor in one pass, where the concatenation allocates the reordered image
    as well and copies it again. For layouts without padding."""
    _check_unpadded(layout)
    prefix = x.shape[1] - layout.num_tokens
    if prefix < 0:
        raise ValueError(f"a packed sequence of {x.shape[1]} tokens cannot end with {layout.num_tokens} image tokens")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    out[:, :prefix] = x[:, :prefix]
    image = x[:, prefix:]
    # the image's tokens as a permuted view in the order wanted, copied into a view of the
    # output's image part in that view's shape
    moved = _tile_major(image, layout) if enter else _raster_major(image, layout)
    out[:, prefix:].view(moved.shape).copy_(moved)
    return out


def image_to_tile_order(x: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """A channels-first image ``(B, C, H, W)`` to its tokens ``(B, T*n, C)`` in tile order.

    The values of :func:`tile_order` on the image's raster tokens
    (``x.permute(0, 2, 3, 1).reshape(B, H*W, C)``) in one copy instead of two: the copy that
    flattens the image writes tile order. For single-frame layouts without padding.
    """
    _check_image_layout(x.shape[-2:], layout)
    return _grid_to_tiles(x.permute(0, 2, 3, 1).unsqueeze(1), layout).flatten(1, 2)


def tile_order_to_image(x: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Inverse of :func:`image_to_tile_order`: tokens ``(B, T*n, C)`` in tile order to a
    contiguous channels-first image ``(B, C, H, W)``, in one copy."""
    _check_image_layout((layout.h, layout.w), layout)
    b, c, lay = x.shape[0], x.shape[-1], layout
    grid = x.view(b, lay.gh, lay.gw, lay.th, lay.tw, c).permute(0, 5, 1, 3, 2, 4)
    return grid.reshape(b, c, lay.h, lay.w)


def _check_image_layout(hw: tuple[int, ...], layout: TileLayout) -> None:
    if layout.padded or layout.t != 1 or tuple(hw) != (layout.h, layout.w):
        raise ValueError(
            f"an image of {tuple(hw)} tokens in tile order needs a one-frame layout of that grid without padding; "
            f"got a {layout.t}x{layout.h}x{layout.w} grid (padded: {layout.padded})"
        )


def slot_raster_index(layout: TileLayout, device: torch.device | str | None = None) -> torch.Tensor:
    """Raster index of the token in every tile slot, in tile order: ``(T * n,)`` int64.

    Without padding this is the permutation :func:`tile_order` applies; padded slots
    point at the nearest real token (their rows and columns are clamped), so that
    indexing with it never goes out of range. For a span layout, indices are into the
    span's tokens.
    """
    if layout.span is not None:
        return _span_slots(layout, device)[0].flatten()
    pt, ph, pw = _padded_shape(layout)
    frames = torch.arange(pt, device=device).clamp_max(layout.t - 1)
    rows = torch.arange(ph, device=device).clamp_max(layout.h - 1)
    cols = torch.arange(pw, device=device).clamp_max(layout.w - 1)
    grid = (frames[:, None, None] * layout.h + rows[None, :, None]) * layout.w + cols[None, None, :]
    return _grid_to_tiles(grid[None, ..., None], layout).flatten()


def from_tiles(t: torch.Tensor, layout: TileLayout, scatter: torch.Tensor | None = None) -> torch.Tensor:
    """Tiles ``(B, T, n, C)`` back to raster tokens ``(B, N, C)``, dropping padded slots
    (with a padded layout's ``scatter`` index, in one gather instead of two copies)."""
    b, c = t.shape[0], t.shape[-1]
    if scatter is None and layout.span is not None:
        scatter = layout_index(layout, t.device).scatter_index
    if scatter is not None and layout.padded:
        return t.flatten(1, 2).index_select(1, scatter)
    lay = layout
    grid = _raster_major(t, lay).reshape(b, *_padded_shape(lay), c)
    if lay.padded:
        grid = grid[:, : lay.t, : lay.h, : lay.w]
    return grid.reshape(b, lay.num_tokens, c)


def _padded_shape(layout: TileLayout) -> tuple[int, int, int]:
    return (layout.gt * layout.tt, layout.gh * layout.th, layout.gw * layout.tw)


def _grid_to_tiles(grid: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """``(B, t', h', w', C)`` padded grid to ``(B, T, n, C)`` tiles."""
    b, c = grid.shape[0], grid.shape[-1]
    lay = layout
    return _tile_major(grid, lay).reshape(b, lay.gt * lay.gh * lay.gw, lay.tile_area, c)  # a span layout's too


def _tile_major(grid: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Raster tokens of the padded grid, ``(B, t', h', w', C)`` or flat ``(B, t'h'w', C)``, as a
    view ``(B, gt, gh, gw, tt, th, tw, C)`` in tile order (a copy only where ``reshape`` needs one)."""
    lay = layout
    b, c = grid.shape[0], grid.shape[-1]
    return grid.reshape(b, lay.gt, lay.tt, lay.gh, lay.th, lay.gw, lay.tw, c).permute(0, 1, 3, 5, 2, 4, 6, 7)


def _raster_major(tiles: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Inverse of :func:`_tile_major`: tiles ``(B, T, n, C)`` or their flat tokens ``(B, T*n, C)``
    as a view ``(B, gt, tt, gh, th, gw, tw, C)`` in the padded grid's raster order."""
    lay = layout
    b, c = tiles.shape[0], tiles.shape[-1]
    return tiles.reshape(b, lay.gt, lay.gh, lay.gw, lay.tt, lay.th, lay.tw, c).permute(0, 1, 4, 2, 5, 3, 6, 7)


@dataclass(frozen=True)
class KernelIndex:
    """Where the fused merge kernels (:mod:`toma.kernels`) read and write each tile slot.

    Attributes:
        src_raster: ``(T, n)`` int32 raster row of the token in each slot, -1 for padding.
        src_tiled: ``(T, n)`` int32 row of each slot in tile order (``t * n + slot``).
        dst_rows: ``(T, k)`` int32 merged row of each destination slot, -1 for unused slots.
        keep: ``(T,)`` int32 destinations each tile keeps, or None when all keep ``k``.
        token_mask: ``(T, n)`` int8, 0 for padded slots, or None when nothing is padded.
    """

    src_raster: torch.Tensor
    src_tiled: torch.Tensor
    dst_rows: torch.Tensor
    keep: torch.Tensor | None
    token_mask: torch.Tensor | None


def kernel_index(layout: TileLayout, device: torch.device | str | None = None) -> KernelIndex:
    """The :class:`KernelIndex` of ``layout`` on ``device`` (built from the layout's Python
    description: no device read)."""
    t, n, k = layout.num_tiles, layout.tile_area, layout.slots
    src = slot_raster_index(layout, device).view(t, n)
    mask = token_mask(layout, device)
    if mask is not None:
        src = src.masked_fill(~mask, -1)
    dst, seen = [], 0
    for kept in layout.keep:
        dst += [seen + j for j in range(kept)] + [-1] * (k - kept)
        seen += kept
    as_int = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return KernelIndex(
        src_raster=src.to(torch.int32),
        src_tiled=torch.arange(t * n, dtype=torch.int32, device=device).view(t, n),
        dst_rows=as_int(dst).view(t, k),
        keep=None if layout.uniform else as_int(list(layout.keep)),
        token_mask=None if mask is None else mask.to(torch.int8),
    )
