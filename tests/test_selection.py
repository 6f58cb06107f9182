"""Destination selection: the greedy against plain references and the brute-force optimum."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from toma.merge import cosine_similarity
from toma.selection import facility_location, grid_selection, random_selection
from toma.tiling import make_layout, token_mask


def objective(sim: torch.Tensor, chosen: list[int]) -> float:
    """f(D) = sum_j max_{i in D} (sim[i, j] + 1), computed directly."""
    return sum(max(float(sim[i, j]) + 1 for i in chosen) for j in range(sim.shape[0]))


def reference_greedy(sim: torch.Tensor, k: int) -> list[int]:
    """Textbook greedy: add the candidate that raises f the most, lowest index on ties."""
    chosen: list[int] = []
    for _ in range(k):
        base = objective(sim, chosen) if chosen else 0.0
        gains = [(objective(sim, chosen + [i]) - base, -i) for i in range(sim.shape[0]) if i not in chosen]
        chosen.append(-max(gains)[1])
    return chosen


def random_sim(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return cosine_similarity(torch.randn(*shape, generator=g))


@pytest.mark.parametrize("n,k", [(6, 1), (9, 3), (16, 8), (12, 11)])
def test_greedy_matches_reference(n, k):
    sims = random_sim(5, n, 6, seed=n * 100 + k).double()
    picks = facility_location(sims, k)
    for g in range(sims.shape[0]):
        assert picks[g].tolist() == reference_greedy(sims[g], k)


def test_first_pick_is_largest_row_sum():
    sims = random_sim(8, 16, 4, seed=3)
    first = facility_location(sims, 1)[:, 0]
    assert torch.equal(first, sims.sum(-1).argmax(-1))


@pytest.mark.parametrize("seed", range(6))
def test_greedy_within_one_minus_one_over_e_of_optimum(seed):
    n, k = 8, 3
    sim = random_sim(n, 3, seed=seed).double()
    greedy = objective(sim, facility_location(sim, k).tolist())
    best = max(objective(sim, list(c)) for c in itertools.combinations(range(n), k))
    assert greedy >= (1 - 1 / math.e) * best - 1e-9
    assert greedy <= best + 1e-9


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
