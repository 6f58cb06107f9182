"""A patched model's state by lifetime (toma.adapters.state): patch, run and forward.

The checkpointing tests (test_conformance, test_robustness) prove that a recomputed block
sees its own forward's state; these pin down what each state object holds and when it
is renewed.
"""

from __future__ import annotations

import torch

from toma.adapters.state import ForwardState, PlanCache, RunState, TileState
from toma.config import ToMAConfig


def tokens(n: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, n, 8, generator=torch.Generator().manual_seed(seed))


def test_a_run_starts_when_the_timestep_rises_and_forwards_keep_its_step():
    cache = PlanCache(ToMAConfig(selection="random"))
    cache.begin_forward((8, 8), 900.0)
    cache.get(tokens(), (8, 8), "g")
    generator = cache.run.generator
    assert cache.step == 0 and generator is not None
    cache.begin_forward((8, 8), 900.0)  # the other CFG call of the step
    assert cache.step == 0 and cache.run.generator is generator and not cache._plans  # recompute_every=1
    cache.begin_forward((8, 8), 800.0)
    assert cache.step == 1 and cache.run.generator is generator
    cache.begin_forward((8, 8), 950.0)  # a rise: a new run, with its own random source
    assert cache.step == 0 and cache.run.generator is None and cache.run.last_timestep == 950.0


def test_plans_kept_across_steps_age_in_the_forward_state():
    cache = PlanCache(ToMAConfig(recompute_every=2))
    cache.begin_forward((8, 8), 900.0)
    plan = cache.get(tokens(), (8, 8), "g")
    cache.begin_forward((8, 8), 800.0)
    assert cache.get(tokens(seed=1), (8, 8), "g") is plan  # kept for a second step
    cache.begin_forward((8, 8), 700.0)
    assert cache.get(tokens(seed=1), (8, 8), "g") is not plan


def test_a_forward_state_copy_is_apart_from_later_forwards():
    cache = PlanCache(ToMAConfig())
    order = TileState(cache, "stack")
    cache.begin_forward((8, 8), 900.0)
    plan = cache.get(tokens(), (8, 8), "g")
    layout = cache.layout(8, 8)
    order.layout = layout
    saved = cache.forward.copy()
    cache.begin_forward((4, 4), 800.0)  # another forward: new grid, no plans, raster order
    order.layout = None
    cache.get(tokens(16), (4, 4), "g")
    assert saved.grid == (8, 8) and list(saved.plans.values()) == [(0, plan)] and saved.order("stack").layout is layout
    live, cache.forward = cache.forward, saved  # what a recomputed block's replay does
    assert order.layout is layout and cache.base_grid == (8, 8) and cache.get(tokens(seed=5), (8, 8), "g") is plan
    cache.forward = live
    assert order.layout is None and cache.base_grid == (4, 4)


def test_reset_renews_the_run_and_the_forward_but_keeps_the_patch_tables():
    cache = PlanCache(ToMAConfig())
    cache.begin_forward((8, 8), 900.0)
    cache.get(tokens(), (8, 8), "g")
    TileState(cache).layout = cache.layout(8, 8)
    layouts = dict(cache._layouts)
    cache.reset()
    fresh_run, fresh_forward = RunState(), ForwardState()
    assert vars(cache.run) == vars(fresh_run)
    assert (cache.forward.grid, cache.forward.active, cache.forward.plans, cache.forward.orders) == (
        fresh_forward.grid,
        fresh_forward.active,
        {},
        {},
    )
    assert cache._layouts == layouts and layouts
