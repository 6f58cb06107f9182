"""Choosing destination tokens inside each tile.

All selectors return local slot indices ``(..., k)`` into the ``n`` slots of each tile and
run on every tile and batch element at once. ``facility_location`` is ToMA's selector;
``random_selection`` and ``grid_selection`` exist for ablations.
"""

from __future__ import annotations

import torch

from toma.tiling import TileLayout

SELECTIONS = ("facility", "random", "grid")


def facility_location(sim: torch.Tensor, k: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy facility-location selection of ``k`` destinations per group.

    Maximises ``f(D) = sum_j max_{i in D} (sim[i, j] + 1)``: every token should be close to
    some destination. Shifting cosine similarities by +1 makes ``f`` non-negative with
    ``f({}) = 0``, so the greedy is within ``1 - 1/e`` of the optimum, and its first pick
    is the token with the largest row sum.

    Args:
        sim: ``(..., n, n)`` symmetric similarities in ``[-1, 1]`` (float32 recommended).
        k: destinations to pick, ``1 <= k <= n``.
        mask: optional ``(..., n)`` bool, False for padded slots; those are never picked
            (while a real token is left) and never count as needing coverage.

    Returns:
        ``(..., k)`` int64 indices in pick order, distinct while real tokens remain.
    """
    n = sim.shape[-1]
    # coverage[j] = best similarity of token j to a chosen destination so far; -1 is the
    # floor of cosine similarity, i.e. "not covered". A candidate's gain is
    # sum_j max(sim[i, j], coverage[j]) - sum_j coverage[j]; the second sum is the same for
    # every candidate, so the argmax needs only the first (one op fewer per step).
    coverage = torch.full(sim.shape[:-1], -1.0, dtype=sim.dtype, device=sim.device)
    # -inf for chosen and padded candidates: they rank below every real one
    barred = torch.zeros(sim.shape[:-1], dtype=sim.dtype, device=sim.device)
    if mask is not None:
        mask = mask.expand(sim.shape[:-1])
        coverage = coverage.masked_fill(~mask, 2.0)  # above any similarity: never needs covering
        barred = barred.masked_fill(~mask, float("-inf"))
    slots = torch.arange(n, device=sim.device)
    picks = []
    for _ in range(k):
        score = torch.maximum(sim, coverage.unsqueeze(-2)).sum(-1) + barred
        idx = score.argmax(-1)
        picks.append(idx)
        row = sim.gather(-2, idx[..., None, None].expand(*idx.shape, 1, n)).squeeze(-2)
        coverage = torch.maximum(coverage, row)
        barred = barred.masked_fill(slots == idx.unsqueeze(-1), float("-inf"))
    return torch.stack(picks, -1)


def random_selection(
    shape: tuple[int, ...],
    k: int,
    mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``k`` distinct random destinations per group, real tokens first.

    Args:
        shape: ``(..., n)``, the group dimensions followed by the slots per tile.
        mask: optional ``(..., n)`` bool, False for padded slots.

    Returns:
        ``(..., k)`` int64 indices.
    """
    scores = torch.rand(shape, generator=generator, device=generator.device if generator else device)
    scores = scores.to(device)
    if mask is not None:
        scores = scores - 2.0 * (~mask).to(scores.dtype)
    return scores.topk(k, dim=-1).indices


def grid_selection(layout: TileLayout, device: torch.device | str | None = None) -> torch.Tensor:
    """Evenly spaced destinations inside each tile, the same every call.

    Returns:
        ``(T, k)`` int64 indices; tiles that keep fewer than ``k`` repeat their last pick
        in the unused slots.
    """
    rows = []
    for t, keep in enumerate(layout.keep):
        ti, tj = divmod(t, layout.gw)
        real_rows = min(layout.th, layout.h - ti * layout.th)
        real_cols = min(layout.tw, layout.w - tj * layout.tw)
        real = [r * layout.tw + c for r in range(real_rows) for c in range(real_cols)]
        picks = [real[((2 * j + 1) * len(real)) // (2 * keep)] for j in range(keep)]
        rows.append(picks + [picks[-1]] * (layout.slots - keep))
    return torch.tensor(rows, dtype=torch.long, device=device)
