"""Choosing destination tokens inside each tile.

All selectors return local slot indices ``(..., k)`` into the ``n`` slots of each tile and
run on every tile and batch element at once. ``facility_location`` is ToMA's selector;
``random_selection`` and ``grid_selection`` exist for ablations.
"""

from __future__ import annotations

import math

import torch

from toma.core.tiling import TileLayout, tile_extents, token_mask

SELECTIONS = ("facility", "random", "grid")


def exact_scores(sim: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Similarities as whole numbers, so that the greedy's sums are exact in any order.

    The greedy ranks candidates by sums of similarities, and facility location has
    structural ties: two uncovered tokens that are each other's nearest both gain
    ``1 + sim[i, j] - cover[i] - cover[j]``. In floating point such a tie is decided by
    rounding, which depends on the summation order of the machine's kernels (AVX2 against
    AVX-512, thread count, GPU against CPU), so the same tokens could give different plans.
    Here ``sim`` is made exactly symmetric with an exact unit diagonal and rounded to a
    multiple of ``1 / scale``; every sum of ``n`` such values (and of the padding sentinel
    ``2 * scale``) stays below ``2**24``, where float32 adds integers exactly. Exact ties
    are then really equal and go to the lowest index, on every machine.

    Args:
        sim: ``(..., n, n)`` similarities in ``[-1, 1]``.

    Returns:
        ``(..., n, n)`` float32 (float64 if ``sim`` is) integer-valued scores in
        ``[-scale, scale]``, and ``scale`` (a power of two; ``2**19`` for 16 tokens).
    """
    return _scores(sim, 1.0)


def _scores(sim: torch.Tensor, diagonal: float) -> tuple[torch.Tensor, float]:
    """:func:`exact_scores` with ``diagonal * scale`` on the diagonal."""
    n = sim.shape[-1]
    scale = float(2 ** (23 - max(1, math.ceil(math.log2(n)))))
    dtype = torch.float64 if sim.dtype == torch.float64 else torch.float32
    sim = sim.to(dtype)
    # a + b == b + a bitwise, so the sum is symmetric even where the matmul was not
    q = torch.round((sim + sim.transpose(-1, -2)) * (scale / 2)).clamp_(-scale, scale)
    q.diagonal(dim1=-2, dim2=-1).fill_(diagonal * scale)
    return q, scale


def facility_location(sim: torch.Tensor, k: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy facility-location selection of ``k`` destinations per group.

    Maximises ``f(D) = sum_j max_{i in D} (sim[i, j] + 1)``: every token should be close to
    some destination. Shifting cosine similarities by +1 makes ``f`` non-negative with
    ``f({}) = 0``, so the greedy is within ``1 - 1/e`` of the optimum, and its first pick
    is the token with the largest row sum. Similarities are first rounded to
    :func:`exact_scores` (steps of ``2**-19`` for 16 tokens), which makes every comparison
    exact: ties go to the lowest slot index whatever the machine's summation order.

    Args:
        sim: ``(..., n, n)`` symmetric similarities in ``[-1, 1]`` (float32 recommended).
        k: destinations to pick, ``1 <= k <= n``.
        mask: optional ``(..., n)`` bool, False for padded slots; those are never picked
            (while a real token is left) and never count as needing coverage.

    Returns:
        ``(..., k)`` int64 indices in pick order, distinct while real tokens remain.
    """
    # The diagonal is 2 * scale rather than scale (above any similarity). Every
    # unpicked candidate's gain rises by the same scale, so the order among them and their
    # exact ties are unchanged; but once picked, a token covers itself above what any other
    # reaches, so a picked candidate gains nothing and loses to every unpicked one, even to a
    # duplicate of a token already picked. That replaces a mask of picked candidates: four
    # kernels a step (three on the first and last), where the mask took six. On a GPU at
    # batch 1 the plan is launch-bound, so the kernel count is its cost. Sums stay exact:
    # n - 1 similarities and the diagonal, or n padding sentinels of 2 * scale, reach at
    # most 2**24.
    q, scale = _scores(sim, 2.0)
    # coverage[j] = best score of token j to a chosen destination so far (None: none chosen,
    # i.e. a floor below every score, so max(q, coverage) = q). A candidate's gain is
    # sum_j max(q[i, j], coverage[j]) - sum_j coverage[j]; the second sum is the same for
    # every candidate, so the argmax needs only the first.
    coverage: torch.Tensor | None = None
    if mask is not None:
        mask = mask.expand(q.shape[:-1])
        # padded candidates sit at the floor, so they gain nothing (and tie with picked ones);
        # padded tokens count as covered at 2 * scale, above every score
        q = torch.where(mask.unsqueeze(-1), q, -scale)
        coverage = torch.where(mask, -scale, 2 * scale).to(q.dtype)
    picks = []
    for step in range(k):
        # row i of best is the coverage after picking i: the next coverage is one of its rows
        best = q if coverage is None else torch.maximum(q, coverage.unsqueeze(-2))
        # the first of equal maxima; once every real token is picked all candidates tie and
        # slot 0 is repeated (as the Triton kernel does)
        idx = best.sum(-1).argmax(-1, keepdim=True)
        picks.append(idx)
        if step < k - 1:
            coverage = best.gather(-2, idx.unsqueeze(-1).expand(*idx.shape, q.shape[-1])).squeeze(-2)
    return torch.cat(picks, -1)


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
    mask = token_mask(layout).tolist() if layout.span is not None else None
    for t, keep in enumerate(layout.keep):
        if mask is not None:  # a span layout's tiles: the slots of the span's tokens
            real = [slot for slot, inside in enumerate(mask[t]) if inside]
        else:
            frames, real_rows, real_cols = tile_extents(layout, t)
            real = [
                (f * layout.th + r) * layout.tw + c
                for f in range(frames)
                for r in range(real_rows)
                for c in range(real_cols)
            ]
        picks = [real[((2 * j + 1) * len(real)) // (2 * keep)] for j in range(keep)]
        rows.append(picks + [picks[-1]] * (layout.slots - keep))
    return torch.tensor(rows, dtype=torch.long, device=device)
