"""ToMA stacked with cache-dit's DBCache: the regressions particular to it.

cache-dit replaces Flux's forward with a copy of its own when it enables a cache; enabled
after ``apply_toma``, that dropped toma's hook on the model, and the model ran unmerged,
silently (toma.adapters.caches). Both orders on every family, for DBCache, its TaylorSeer
calibrator and DBPrune, are the conformance suite's
(``test_conformance.test_cache_dit_composes_in_either_order``).
"""

from __future__ import annotations

import logging

import pytest
import torch

import toma
from tests.cases import CACHED, cache_dit_settings

cache_dit = pytest.importorskip("cache_dit")  # CI installs it (.ci/run)
logging.getLogger("cache_dit").setLevel(logging.WARNING)

STEPS = 6


def config(kind: str) -> dict:
    """cache-dit's settings for a run of ``STEPS`` (tests.cases.cache_dit_settings)."""
    return cache_dit_settings(kind, STEPS)


def denoise(model, kw, scale: float) -> torch.Tensor:
    """A denoising-like loop: shrinking inputs at decreasing timesteps."""
    outs = []
    with torch.no_grad():
        for i in range(STEPS):
            t = torch.full((kw["hidden_states"].shape[0],), scale * (1 - i / STEPS))
            outs.append(model(**{**kw, "hidden_states": kw["hidden_states"] * (1 - i / STEPS), "timestep": t})[0])
    return torch.stack(outs)


def test_flux_tokens_after_cache_dit_replaced_the_forward():
    # the finding: on a tiny Flux with DBCache enabled after apply_toma, joint attention saw
    # all 264 tokens (8 text + 16x16 image) instead of 136
    from tests.tiny_models import flux_inputs, make_flux

    kw = flux_inputs(1, 16, 16, text=8)
    blocks = {"transformer_blocks": (0, 1), "single_transformer_blocks": (0, 1)}
    for toma_first in (True, False):
        model = make_flux()
        if toma_first:
            toma.apply_toma(model, ratio=0.5, blocks=blocks)
        cache_dit.enable_cache(model, **config("dbcache"))
        if not toma_first:
            toma.apply_toma(model, ratio=0.5, blocks=blocks)
        seen = []
        model.single_transformer_blocks[0].attn.to_q.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[1]))
        with torch.no_grad():
            model(**kw)
        assert seen == [136], toma_first


def test_guard_runs_the_step_hook_once_per_call():
    # Wan's cached forward wraps the model's forward, so toma's hook inside it still runs:
    # the guard must not run it a second time (the step count would advance twice per call,
    # and plans kept for two steps would last one)
    make, inputs, scale, opts, _ = CACHED["wan"]
    kw = inputs()
    model = make()
    patch = toma.apply_toma(model, ratio=0.5, recompute_every=2, **opts)
    cache_dit.enable_cache(model, **config("dbcache"))
    flux = CACHED["flux"][0]()
    flux_patch = toma.apply_toma(flux, ratio=0.5, recompute_every=2, **CACHED["flux"][3])
    cache_dit.enable_cache(flux, **config("dbcache"))
    fkw = CACHED["flux"][1]()
    for i in range(3):
        with torch.no_grad():
            model(**{**kw, "timestep": torch.full((1,), 900.0 - 100 * i)})
            flux(**{**fkw, "timestep": torch.full((1,), 0.9 - 0.1 * i)})
    assert patch.cache.run.step == flux_patch.cache.run.step == 2


@pytest.mark.parametrize("threshold", [0.2, 0.5])
def test_dbcache_skips_the_same_steps_in_tile_and_raster_order(monkeypatch, threshold):
    # DBCache compares the first blocks' output with their input; Wan entered tile order at
    # its first block's input, inside those blocks, so the residual mixed the two orders and
    # the steps skipped depended on the token order, which alone changes nothing (bitwise)
    from toma.adapters.state import PlanCache

    make, inputs, scale, opts, probe = CACHED["wan"]
    kw = inputs()
    settings = config("dbcache")
    settings["cache_config"].residual_diff_threshold = threshold
    computed = []
    for tiled in (True, False):
        if not tiled:
            monkeypatch.setattr(PlanCache, "tile_order_layout", lambda self, *a, **k: None)
        model = make()
        toma.apply_toma(model, ratio=0.5, **opts)
        cache_dit.enable_cache(model, **settings)
        calls = []
        model.get_submodule(probe).register_forward_hook(lambda m, a, o: calls.append(1))
        denoise(model, kw, scale)
        computed.append(len(calls))
    assert computed[0] == computed[1]
