"""Inputs and references of the doctor's checks.

* :func:`tile_rows` / :func:`merged_rows`: where each tile slot's token sits in raster
  order and where each destination lands among the merged tokens, worked out from the
  grid's geometry alone, so that :func:`reference_merge` and :func:`reference_unmerge`
  share no code with :mod:`toma.core.tiling`;
* :func:`margin_tokens`: tokens whose facility-location plan is known in advance, with
  every greedy choice won by a wide margin, so that rounding cannot change a destination;
* :func:`smooth_tokens`: image-like tokens (a smooth random field), on which merging
  neighbours loses little, for the attention checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def tile_rows(h: int, w: int, th: int, tw: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``(T, n)`` raster index of the token in each slot, -1 where the slot overhangs the grid.

    Tiles are numbered row by row over the grid and slots row by row inside a tile (the
    layout's documented order), with ``th x tw`` tiles shrunk to the grid where it is smaller.
    """
    th, tw = min(th, h), min(tw, w)
    gh, gw = math.ceil(h / th), math.ceil(w / tw)
    i = torch.arange(gh, device=device).view(gh, 1, 1, 1)
    j = torch.arange(gw, device=device).view(1, gw, 1, 1)
    r = torch.arange(th, device=device).view(1, 1, th, 1)
    c = torch.arange(tw, device=device).view(1, 1, 1, tw)
    row, col = i * th + r, j * tw + c
    index = torch.where((row < h) & (col < w), row * w + col, -1)
    return index.reshape(gh * gw, th * tw)


def merged_rows(keep: tuple[int, ...], slots: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``(T, k)`` row among the merged tokens of each tile's destination slot, -1 for slots a
    tile does not use: tiles' destinations follow each other in tile order."""
    out = torch.full((len(keep), slots), -1, dtype=torch.long)
    first = 0
    for t, kept in enumerate(keep):
        out[t, :kept] = torch.arange(first, first + kept)
        first += kept
    return out.to(device)


def gather_tiles(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``(B, N, C)`` raster tokens as float64 tiles ``(B, T, n, C)``, zeros in padded slots."""
    real = rows >= 0
    tiles = x.double()[:, rows.clamp_min(0)]
    return tiles * real[None, :, :, None]


def reference_merge(x: torch.Tensor, merge_w: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """The merged tokens ``(B, K, C)`` in float64: each used destination slot's weights
    ``merge_w`` ``(Bp, T, k, n)`` applied to its tile's tokens, placed at its merged row."""
    merged = merge_w.double() @ gather_tiles(x, rows)  # (B, T, k, C); Bp = 1 broadcasts
    used = dst >= 0
    out = merged.new_zeros(x.shape[0], int(used.sum()), x.shape[-1])
    out[:, dst[used]] = merged[:, used]
    return out


def reference_unmerge(
    y: torch.Tensor,
    unmerge_w: torch.Tensor,
    rows: torch.Tensor,
    dst: torch.Tensor,
    num_tokens: int,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unmerged tokens ``(B, N, C)`` in raster order, in float64: every real slot mixes
    its tile's destinations with ``unmerge_w`` ``(Bp, T, n, k)``; plus ``residual``."""
    b, _, c = y.shape
    used = dst >= 0
    dests = y.new_zeros(b, *dst.shape, c, dtype=torch.float64)
    dests[:, used] = y.double()[:, dst[used]]
    tiles = unmerge_w.double() @ dests  # (B, T, n, C)
    real = rows >= 0
    out = tiles.new_zeros(b, num_tokens, c)
    out[:, rows[real]] = tiles[:, real]
    return out if residual is None else out + residual.double()


class NoMarginDesign(ValueError):
    """The tile, keep count and channel count leave no design with unambiguous destinations."""


@dataclass(frozen=True)
class MarginTokens:
    """Tokens with a known plan: ``x`` ``(B, N, C)`` float32 (exact in fp16 and bf16 too),
    ``expected`` ``(B, T, k)`` destination slots in the greedy's order (-1 where a tile uses
    fewer slots, and for all slots of a tile with no design), ``margin``, the smallest gap
    between the best and the second-best choice at any greedy step, in cosine-similarity
    units, and ``designed``, the tiles with a design (per batch element)."""

    x: torch.Tensor
    expected: torch.Tensor
    margin: float
    designed: int


def hadamard(size: int) -> torch.Tensor:
    """Sylvester's ``size x size`` matrix of +-1 with orthogonal rows (``size`` a power of 2)."""
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def cluster_sizes(real: int, keep: int) -> list[int]:
    """Sizes of ``keep`` clusters of ``real`` tokens, largest first: clusters of one, and
    clusters of three or more (a cluster of two has two equally good centres)."""
    extra = real - keep
    if extra == 0:
        return [1] * keep
    groups = min(keep, extra // 2)
    if groups == 0:
        raise NoMarginDesign(f"a tile of {real} tokens keeping {keep} needs a cluster of 2, whose centre is ambiguous")
    sizes = [1 + extra // groups + (1 if g < extra % groups else 0) for g in range(groups)]
    return sizes + [1] * (keep - groups)


def margin_tokens(
    h: int,
    w: int,
    th: int,
    tw: int,
    keep: tuple[int, ...],
    slots: int,
    batch: int,
    channels: int,
    generator: torch.Generator,
) -> MarginTokens:
    """Tokens whose destinations the greedy must pick, for every tile of an ``h x w`` grid.

    Each tile's ``keep`` clusters point in mutually orthogonal directions (rows of a
    Hadamard matrix, spread over the channels with random signs and order): their cross
    similarities are exactly 0. A cluster of ``m >= 3`` is a centre ``u`` and ``m - 1``
    satellites ``u + b w_i`` along orthogonal directions ``w_i``, ``cos = 1 / sqrt(1 + b^2)``:
    the centre covers the cluster with ``1 + (m - 1) cos``, a satellite only with
    ``1 + cos + (m - 2) cos^2``, ``(m - 2) cos (1 - cos)`` less. Larger clusters get smaller
    ``b``, so the centres' gains are strictly ordered, and all exceed a lone token's 1; lone
    tokens tie exactly (the greedy's lowest-index rule orders them); a covered satellite
    gains ``1 - cos < 1``. Every entry is a small dyadic number (``b = j / 16``, norms
    scaled by powers of 2), so the tokens are exact in fp16 and bf16 and every dtype sees
    the same design. Tiles whose real tokens and keep count leave no design (one token
    more than they keep: a cluster of two) get random tokens and no expected destinations;
    :class:`NoMarginDesign` when no tile has a design.
    """
    rows = tile_rows(h, w, th, tw)
    n = rows.shape[1]
    size = 1 << max(0, (n - 1).bit_length())
    if channels < size:
        raise NoMarginDesign(
            f"tiles of {n} slots need at least {size} channels for orthogonal directions; got {channels}"
        )
    reps = channels // size
    spread = hadamard(size).repeat(1, reps)
    signs = torch.randint(0, 2, (spread.shape[1],), generator=generator) * 2 - 1
    directions = torch.zeros(size, channels)
    directions[:, : spread.shape[1]] = spread * signs
    directions = directions[:, torch.randperm(channels, generator=generator)]

    x = torch.zeros(batch, h * w, channels)
    expected = torch.full((batch, rows.shape[0], slots), -1, dtype=torch.long)
    margin = math.inf
    groups: dict[tuple[int, int], list[int]] = {}
    for t in range(rows.shape[0]):
        groups.setdefault((int((rows[t] >= 0).sum()), keep[t]), []).append(t)
    undesigned: list[str] = []
    for (real, kept), tiles in groups.items():
        try:
            sizes = cluster_sizes(real, kept)
        except NoMarginDesign as err:
            # such tiles (edge tiles, often) get plain random tokens and are not checked
            undesigned.append(str(err))
            for t in tiles:
                slots = rows[t][rows[t] >= 0]
                x[:, slots] = torch.randn(batch, len(slots), channels, generator=generator)
            continue
        coef, centres, lone, gap = _cluster_template(sizes, real)
        margin = min(margin, gap)
        count = batch * len(tiles)
        # per tile and batch element: which directions, which slots, which norms
        picks = torch.rand(count, size, generator=generator).argsort(1)[:, :real]
        tokens = coef @ directions[picks]  # (count, real, C)
        tokens = tokens * 2.0 ** torch.randint(-1, 2, (count, real, 1), generator=generator)
        order = torch.rand(count, real, generator=generator).argsort(1)  # template token -> real slot
        tiles_t = torch.tensor(tiles)
        real_slots = torch.stack([(rows[t] >= 0).nonzero().flatten() for t in tiles])  # (len(tiles), real)
        for b in range(batch):
            part = slice(b * len(tiles), (b + 1) * len(tiles))
            slot_of = real_slots.gather(1, order[part])  # (tiles, real): the slot of each template token
            x[b, rows[tiles_t[:, None], slot_of]] = tokens[part]
            lone_slots = slot_of[:, lone].sort(1).values if lone else slot_of[:, :0]
            expected[b, tiles_t, :kept] = torch.cat([slot_of[:, centres], lone_slots], 1)
    if not (expected >= 0).any():
        raise NoMarginDesign("; ".join(undesigned))
    return MarginTokens(x, expected, margin, int((expected[0] >= 0).any(-1).sum()))


def _cluster_template(sizes: list[int], real: int) -> tuple[torch.Tensor, list[int], list[int], float]:
    """Coefficients ``(real, real)`` of each template token over ``real`` orthogonal
    directions, the template indices of the cluster centres (in the order the greedy picks
    them) and of the lone tokens, and the smallest margin of the greedy's choices."""
    coef = torch.zeros(real, real)
    centres, lone, gains, margin = [], [], [], math.inf
    token = 0
    for c, m in enumerate(sizes):
        coef[token, token] = 1.0
        if m == 1:
            lone.append(token)
            token += 1
            continue
        b = (4 + c) / 16  # the larger clusters (listed first) get the smaller angles
        cos = 1 / math.sqrt(1 + b * b)
        centres.append(token)
        for s in range(1, m):
            coef[token + s, token] = 1.0
            coef[token + s, token + s] = b
        gains.append(1 + (m - 1) * cos)
        margin = min(margin, (m - 2) * cos * (1 - cos), cos)  # centre vs satellite; a covered satellite vs 1
        token += m
    gains.append(1.0)  # the lone tokens' gain, below every centre's
    margin = min([margin] + [a - b for a, b in zip(gains, gains[1:])]) if len(gains) > 1 else margin
    return coef, centres, lone, margin


def smooth_tokens(batch: int, h: int, w: int, channels: int, generator: torch.Generator) -> torch.Tensor:
    """``(B, h*w, C)`` float32 tokens of a smooth random field (bicubic from an eighth of the
    grid, plus a little noise), each channel scaled to unit variance: neighbouring tokens are
    alike, as in a latent image, which is what merging relies on."""
    coarse = torch.randn(batch, channels, max(2, h // 8), max(2, w // 8), generator=generator)
    field = F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=False)
    field = field + 0.05 * torch.randn(batch, channels, h, w, generator=generator)
    field = field / field.std(dim=(2, 3), keepdim=True).clamp_min(1e-6)
    return field.flatten(2).transpose(1, 2).contiguous()
