"""Destination selection: the greedy against plain references and the brute-force optimum."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from toma.core.merge import cosine_similarity
from toma.core.selection import exact_scores, facility_location, grid_selection, random_selection
from toma.core.tiling import make_layout, token_mask


def exact(sim: torch.Tensor) -> list[list[int]]:
    """The greedy's scores of one group as Python ints (exact arithmetic below)."""
    q, scale = exact_scores(sim)
    return [[int(v) + int(scale) for v in row] for row in q.tolist()]  # shifted by +1, as in f


def objective(q: list[list[int]], chosen: list[int]) -> int:
    """f(D) = sum_j max_{i in D} (sim[i, j] + 1), computed directly, in exact integers."""
    return sum(max(q[i][j] for i in chosen) for j in range(len(q)))


def reference_greedy(sim: torch.Tensor, k: int) -> list[int]:
    """Textbook greedy: add the candidate that raises f the most, lowest index on ties."""
    q = exact(sim)
    chosen: list[int] = []
    for _ in range(k):
        base = objective(q, chosen) if chosen else 0
        gains = [(objective(q, chosen + [i]) - base, -i) for i in range(len(q)) if i not in chosen]
        chosen.append(-max(gains)[1])
    return chosen


def random_sim(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return cosine_similarity(torch.randn(*shape, generator=g))


@pytest.mark.parametrize("n,k", [(6, 1), (9, 3), (16, 8), (12, 11)])
def test_greedy_matches_reference(n, k):
    sims = random_sim(5, n, 6, seed=n * 100 + k)
    picks = facility_location(sims, k)
    for g in range(sims.shape[0]):
        assert picks[g].tolist() == reference_greedy(sims[g], k)


def test_first_pick_is_largest_row_sum():
    sims = random_sim(8, 16, 4, seed=3)
    first = facility_location(sims, 1)[:, 0]
    assert torch.equal(first, exact_scores(sims)[0].sum(-1).argmax(-1))


def test_symmetric_ties_do_not_depend_on_rounding():
    # Tokens 0 and 1 are each other's nearest, away from the cluster {2, 3, 4}. After the
    # first pick (token 2) both gain exactly 1 + s01 - c0 - c1 in real arithmetic; noise
    # below the score step, as another machine's summation order leaves, must not decide
    # between them: the lower index wins every time.
    sim = torch.tensor(
        [
            [1.0, 0.5, 0.1, 0.2, 0.0],
            [0.5, 1.0, 0.0, -0.1, 0.2],
            [0.1, 0.0, 1.0, 0.9, 0.8],
            [0.2, -0.1, 0.9, 1.0, 0.7],
            [0.0, 0.2, 0.8, 0.7, 1.0],
        ]
    )
    for seed in range(20):
        noise = torch.randn(sim.shape, generator=torch.Generator().manual_seed(seed)) * 1e-7
        assert facility_location(sim + noise, 3).tolist() == [2, 0, 1]


def test_pair_tie_goes_to_lower_index():
    s, c = 0.3, -0.2
    sim = torch.tensor([[1.0, s, c], [s, 1.0, c], [c, c, 1.0]])
    assert facility_location(sim, 1).tolist() == [0]  # row sums of 0 and 1 tie
    assert facility_location(sim.flip(0, 1), 1).tolist() == [1]  # now 1 and 2 tie


@pytest.mark.parametrize("seed", range(6))
def test_greedy_within_one_minus_one_over_e_of_optimum(seed):
    n, k = 8, 3
    sim = random_sim(n, 3, seed=seed)
    q = exact(sim)
    greedy = objective(q, facility_location(sim, k).tolist())
    best = max(objective(q, list(c)) for c in itertools.combinations(range(n), k))
    assert greedy >= (1 - 1 / math.e) * best
    assert greedy <= best


def test_picks_are_distinct_even_with_duplicate_tokens():
    x = torch.randn(1, 2, 5).repeat(1, 8, 1)  # 16 tokens, only 2 distinct
    picks = facility_location(cosine_similarity(x), 6)
    assert len(set(picks[0].tolist())) == 6


def test_padded_slots_never_picked_and_not_covered():
    layout = make_layout(5, 6, (4, 4), 0.5)  # padded bottom row and right column of tiles
    mask = token_mask(layout)
    sims = random_sim(layout.num_tiles, layout.tile_area, 8, seed=1)
    picks = facility_location(sims, layout.slots, mask)
    for t, keep in enumerate(layout.keep):
        assert all(bool(mask[t, i]) for i in picks[t, :keep].tolist())
    # a tile's real picks equal the greedy on its real tokens alone
    t = layout.num_tiles - 1
    real = mask[t].nonzero().squeeze(1)
    sub = sims[t][real][:, real]
    expected = real[facility_location(sub, layout.keep[t])]
    assert torch.equal(picks[t, : layout.keep[t]], expected)


def test_random_selection_distinct_and_real():
    layout = make_layout(7, 9, (4, 4), 0.5)
    mask = token_mask(layout)
    g = torch.Generator().manual_seed(0)
    picks = random_selection((3, layout.num_tiles, layout.tile_area), layout.slots, mask.expand(3, -1, -1), generator=g)
    for b in range(3):
        for t, keep in enumerate(layout.keep):
            chosen = picks[b, t, :keep].tolist()
            assert len(set(chosen)) == keep and all(bool(mask[t, i]) for i in chosen)


def test_grid_selection_evenly_spaced_real_tokens():
    layout = make_layout(6, 6, (4, 4), 0.5)
    picks = grid_selection(layout)
    mask = token_mask(layout)
    assert picks.shape == (layout.num_tiles, layout.slots)
    assert picks[0, :8].tolist() == [1, 3, 5, 7, 9, 11, 13, 15]
    for t, keep in enumerate(layout.keep):
        chosen = picks[t, :keep].tolist()
        assert len(set(chosen)) == keep and all(bool(mask[t, i]) for i in chosen)


@pytest.mark.parametrize("k", [1, 2, 8])
def test_greedy_launches_four_kernels_a_step(k):
    # On a GPU at batch 1 a plan is launch-bound: its cost is its kernel count. Five make
    # the scores and one joins the picks; each step then takes four (a sum, an argmax, the
    # gather of the new coverage and the next maximum), with no mask of picked candidates.
    from toma.tools.opcount import count_kernels

    sim = random_sim(3, 16, 16, 8, seed=k)
    ops = count_kernels(lambda: facility_location(sim, k))
    assert sum(ops.values()) == 4 * k + 4, dict(ops)
    assert "scatter_.value" not in ops
