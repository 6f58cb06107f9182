"""Spatial tiles of a raster-ordered token grid.

Tokens arrive as ``(B, N, C)`` with ``N = h * w`` in raster order. Selection and merging
happen independently inside tiles of ``th x tw`` tokens, batched as ``(B, T, n, C)`` with
``T`` tiles of ``n = th * tw`` slots each. Grids whose sides the tile does not divide are
padded at the bottom/right; padded slots are masked out of selection and merging, and
each tile keeps destinations in proportion to its real tokens.

Moving between the raster and the tile layout is a view, a pad when needed and one
permute: no gather or scatter over the sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TileLayout:
    """How an ``h x w`` token grid is cut into tiles, and how many tokens each tile keeps.

    Attributes:
        h, w: token grid size.
        th, tw: tile size in tokens.
        gh, gw: number of tile rows and columns (the grid is padded up to ``gh*th x gw*tw``).
        keep: tokens each tile keeps, one entry per tile in row-major tile order.
    """

    h: int
    w: int
    th: int
    tw: int
    gh: int
    gw: int
    keep: tuple[int, ...] = field(repr=False)

    @property
    def num_tokens(self) -> int:
        """N, the real tokens in the grid."""
        return self.h * self.w

    @property
    def num_tiles(self) -> int:
        """T, the number of tiles."""
        return self.gh * self.gw

    @property
    def tile_area(self) -> int:
        """n, the slots per tile (including padding)."""
        return self.th * self.tw

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
        """Whether the tiles overhang the grid."""
        return self.gh * self.th != self.h or self.gw * self.tw != self.w

    @property
    def uniform(self) -> bool:
        """Whether every tile keeps the same number of tokens (no slot needs masking)."""
        return min(self.keep) == max(self.keep)


def make_layout(h: int, w: int, tile: tuple[int, int], ratio: float) -> TileLayout:
    """Cut an ``h x w`` grid into tiles of ``tile = (th, tw)`` and size each tile's keep.

    A tile with ``p`` real tokens keeps ``round(p * (1 - ratio))`` of them, at least one.
    A tile larger than the grid is shrunk to the grid.
    """
    th, tw = min(tile[0], h), min(tile[1], w)
    gh, gw = math.ceil(h / th), math.ceil(w / tw)
    keep = []
    for i in range(gh):
        rows = min(th, h - i * th)
        for j in range(gw):
            real = rows * min(tw, w - j * tw)
            keep.append(max(1, min(real, math.floor(real * (1.0 - ratio) + 0.5))))
    return TileLayout(h=h, w=w, th=th, tw=tw, gh=gh, gw=gw, keep=tuple(keep))


def token_mask(layout: TileLayout, device: torch.device | str | None = None) -> torch.Tensor | None:
    """Which tile slots hold real tokens: ``(T, n)`` bool, or None when nothing is padded."""
    if not layout.padded:
        return None
    grid = torch.zeros(layout.gh * layout.th, layout.gw * layout.tw, dtype=torch.bool, device=device)
    grid[: layout.h, : layout.w] = True
    return _grid_to_tiles(grid[None, :, :, None], layout)[0, :, :, 0]


def slot_mask(layout: TileLayout, device: torch.device | str | None = None) -> torch.Tensor | None:
    """Which destination slots are used: ``(T, k)`` bool, or None when every tile keeps ``k``."""
    if layout.uniform:
        return None
    keep = torch.tensor(layout.keep, device=device)
    return torch.arange(layout.slots, device=device)[None, :] < keep[:, None]


@dataclass(frozen=True)
class LayoutIndex:
    """A layout's padding as device tensors; built once per layout and device and reused.

    Attributes:
        token_mask: ``(T, n)`` bool, False for padded slots; None when nothing is padded.
        slot_mask: ``(T, k)`` bool, False for unused destination slots; None when every
            tile keeps ``k``.
        keep_index: ``(K,)`` the used slots among the ``T*k``, or None when all are used.
        spread_index: ``(T*k,)`` position among the ``K`` of each slot (unused slots point
            at 0), or None.
    """

    token_mask: torch.Tensor | None
    slot_mask: torch.Tensor | None
    keep_index: torch.Tensor | None
    spread_index: torch.Tensor | None


def layout_index(layout: TileLayout, device: torch.device | str | None = None) -> LayoutIndex:
    """The :class:`LayoutIndex` of ``layout`` on ``device``.

    Index tensors come from the layout's Python description (no ``nonzero`` on the device,
    which would wait for the GPU).
    """
    if layout.uniform:
        return LayoutIndex(token_mask(layout, device), None, None, None)
    k = layout.slots
    keep, spread, seen = [], [], 0
    for t, kept in enumerate(layout.keep):
        keep += range(t * k, t * k + kept)
        spread += [seen + j for j in range(kept)] + [0] * (k - kept)
        seen += kept
    as_index = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return LayoutIndex(token_mask(layout, device), slot_mask(layout, device), as_index(keep), as_index(spread))


def to_tiles(x: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Raster tokens ``(B, N, C)`` to tiles ``(B, T, n, C)``; padded slots hold zeros."""
    b, n, c = x.shape
    if n != layout.num_tokens:
        raise ValueError(f"expected {layout.num_tokens} tokens for a {layout.h}x{layout.w} grid, got {n}")
    grid = x.view(b, layout.h, layout.w, c)
    if layout.padded:
        grid = F.pad(grid, (0, 0, 0, layout.gw * layout.tw - layout.w, 0, layout.gh * layout.th - layout.h))
    return _grid_to_tiles(grid, layout)


def tile_order(x: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Raster tokens ``(B, N, C)`` to ``(B, T*n, C)`` in tile order (one copy).

    Only for layouts without padding, whose tile order is a permutation of the tokens.
    """
    if layout.padded:
        raise ValueError(f"a {layout.h}x{layout.w} grid is padded by {layout.th}x{layout.tw} tiles: no tile order")
    return to_tiles(x, layout).flatten(1, 2)


def raster_order(x: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Inverse of :func:`tile_order`: ``(B, T*n, C)`` back to raster ``(B, N, C)``."""
    return from_tiles(x.unflatten(1, (layout.num_tiles, layout.tile_area)), layout)


def slot_raster_index(layout: TileLayout, device: torch.device | str | None = None) -> torch.Tensor:
    """Raster index of the token in every tile slot, in tile order: ``(T * n,)`` int64.

    Without padding this is the permutation :func:`tile_order` applies; padded slots
    point at the nearest real token (their rows and columns are clamped), so that
    indexing with it never goes out of range.
    """
    rows = torch.arange(layout.gh * layout.th, device=device).clamp_max(layout.h - 1)
    cols = torch.arange(layout.gw * layout.tw, device=device).clamp_max(layout.w - 1)
    grid = rows[:, None] * layout.w + cols[None, :]
    return _grid_to_tiles(grid[None, :, :, None], layout).flatten()


def from_tiles(t: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Tiles ``(B, T, n, C)`` back to raster tokens ``(B, N, C)``, dropping padded slots."""
    b, c = t.shape[0], t.shape[-1]
    grid = t.view(b, layout.gh, layout.gw, layout.th, layout.tw, c).permute(0, 1, 3, 2, 4, 5)
    grid = grid.reshape(b, layout.gh * layout.th, layout.gw * layout.tw, c)
    if layout.padded:
        grid = grid[:, : layout.h, : layout.w]
    return grid.reshape(b, layout.num_tokens, c)


def _grid_to_tiles(grid: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    b, c = grid.shape[0], grid.shape[-1]
    t = grid.reshape(b, layout.gh, layout.th, layout.gw, layout.tw, c).permute(0, 1, 3, 2, 4, 5)
    return t.reshape(b, layout.num_tiles, layout.tile_area, c)
