"""The defaults that follow the grid and the device (issue 26, section 2):
``tile_size="auto"`` and ``proportional_attention=None``."""

from __future__ import annotations

import importlib
import math
import warnings

import pytest
import torch

import toma
from tests.tiny_models import FAMILIES, flux_inputs, make_flux, make_wan, wan_inputs
from toma import ToMAConfig
from toma.adapters import FAMILIES as SPECS
from toma.adapters import merging
from toma.adapters.parallel import Shard
from toma.adapters.state import PlanCache
from toma.core.tiling import scaled_tile_side


def run(model, kw):
    with torch.no_grad():
        return model(**kw, return_dict=False)[0]


def test_scaled_tile_side_is_the_nearer_tile_count_on_a_log_scale():
    # brute force: of the sides 4 and 2, the one whose tile count a frame holds is nearer,
    # in log, to what the reference frame holds in 4x4 tiles (ties to 4)
    for reference in (64 * 64, 30 * 52, 16 * 22, 7):
        for frame in range(1, 3 * reference, max(1, reference // 97)):
            want = min((4, 2), key=lambda s: (abs(math.log((frame / s**2) / (reference / 16))), -s))
            assert scaled_tile_side(frame, reference) == want, (frame, reference)
    assert scaled_tile_side(10, None) == 4  # no reference: the base
    assert scaled_tile_side(10, 10_000, base=8) == 4


def test_config_auto_tile():
    assert ToMAConfig().tile_size == "auto" and ToMAConfig().auto_tile
    assert ToMAConfig().tile == (4, 4)
    assert ToMAConfig(tile_size=2).tile == (2, 2) and not ToMAConfig(tile_size=2).auto_tile
    with pytest.raises(TypeError, match="tile_size must be 'auto'"):
        ToMAConfig(tile_size="big")
    cfg = ToMAConfig(tile_size="auto")
    assert toma.config.ToMAConfig(**cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "grid, reference, side",
    [
        ((1, 32, 32), 64 * 64, 2),  # the built-in DiT's grid against Flux's 1024px
        ((8, 16, 16), 30 * 52, 2),  # the built-in video DiT's frames against Wan 480p's
        ((21, 30, 52), 30 * 52, 4),  # Wan 480p itself
        ((1, 64, 64), 64 * 64, 4),  # Flux 1024px
        ((1, 128, 128), 64 * 64, 4),  # larger grids keep 4x4
        ((1, 32, 32), None, 4),  # no reference (UNets)
    ],
)
def test_plan_cache_auto_tile(grid, reference, side):
    cache = PlanCache(ToMAConfig(), 1, reference)
    cache.begin_forward(grid, 1.0)
    assert cache.tile_for(grid) == (1, side, side)
    layout = cache.layout(*grid)
    assert (layout.tt, layout.th, layout.tw) == (1, side, side)
    fixed = PlanCache(ToMAConfig(tile_size=4), 1, reference)
    assert fixed.tile_for(grid) == (1, 4, 4)


def test_auto_tile_of_a_shard_follows_the_whole_grid():
    # a context-parallel rank's rows of a frame hold fewer tokens than the frame: the tile
    # must be the one a single process picks for the whole grid
    cache = PlanCache(ToMAConfig(), 1, 30 * 52)
    whole = (1, 24, 52)  # 1248 tokens, over half of Wan 480p's 1560: 4x4; a rank's half: 2x2
    assert scaled_tile_side(24 * 52, 30 * 52) == 4 and scaled_tile_side(12 * 52, 30 * 52) == 2
    cache.begin_forward((1, 12, 52), 1.0)
    cache.forward.shard = Shard(2, 12 * 52, whole=whole)
    assert cache.tile_for((1, 12, 52)) == (1, 4, 4)


def test_references_of_the_specs():
    # a frame at the family's default resolution keeps 4x4 tiles; the two the built-ins
    # were measured against are Flux at 1024px and Wan at 480p
    specs = {name: getattr(importlib.import_module(module), "SPEC", None) for name, (module, _) in SPECS.items()}
    assert specs["flux"].reference == (64, 64) and specs["wan"].reference == (30, 52)
    for name, spec in specs.items():
        if spec is not None and spec.reference is not None:
            rows, cols = spec.reference
            assert rows > 0 and cols > 0 and scaled_tile_side(rows * cols, rows * cols) == 4, name


def _fixture_tiles(family, **options):
    row = FAMILIES[family]
    kw = row.inputs(1)
    model = row.make()
    patch = toma.apply_toma(model, ratio=0.5, **{**row.options, **options})
    out = run(model, kw)
    return out, {(lay.tt, lay.th, lay.tw) for lay in patch.cache._layouts.values()}


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_default_tiles_on_a_small_grid_are_2x2(family):
    # the tiny grids hold far under half their family's reference frame: "auto" is 2x2,
    # bitwise the explicit setting
    auto, tiles = _fixture_tiles(family)
    assert tiles == {(1, 2, 2)}
    two, _ = _fixture_tiles(family, tile_size=2)
    four, four_tiles = _fixture_tiles(family, tile_size=4)
    assert torch.equal(auto, two)
    assert four_tiles == {(1, 4, 4)} and not torch.equal(auto, four)


def _flux_outputs(**options):
    kw = flux_inputs(1, 8, 8)
    model = make_flux()
    toma.apply_toma(model, ratio=0.5, tile_size=4, **options)
    return run(model, kw)


def _wan_outputs(**options):
    kw = wan_inputs(1, 2, 8, 8)
    model = make_wan(layers=2)
    toma.apply_toma(model, ratio=0.5, tile_size=4, blocks={"blocks": range(2)}, **options)
    return run(model, kw)


@pytest.mark.parametrize("outputs", [_flux_outputs, _wan_outputs], ids=["flux", "wan"])
def test_default_bias_is_on_on_cpu_and_off_elsewhere(outputs, monkeypatch):
    default, on, off = outputs(), outputs(proportional_attention=True), outputs(proportional_attention=False)
    assert torch.equal(default, on) and not torch.equal(on, off)
    # on a device type where it was not measured, None runs without the bias
    monkeypatch.setattr(merging, "AUTO_DEVICES", ())
    assert torch.equal(outputs(), off)
    assert torch.equal(outputs(proportional_attention=True), on)


def test_default_bias_skips_forms_not_measured_cheap(monkeypatch):
    # flex costs +2.75% / +18% of a forward on CPU: None leaves it out, silently; True runs it
    from diffusers.models.attention_dispatch import attention_backend

    off = _flux_outputs(proportional_attention=False)
    flex_calls = []
    real = toma.adapters.attention.P.flex_attention_with_bias
    monkeypatch.setattr(
        toma.adapters.attention.P, "flex_attention_with_bias", lambda *a, **k: flex_calls.append(1) or real(*a, **k)
    )
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(toma.adapters.attention, "_flex", lambda: flex_attention)  # eager: no 20 s compile
    with attention_backend("flex"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = _flux_outputs()
        assert not flex_calls
        _flux_outputs(proportional_attention=True)
        assert flex_calls
    torch.testing.assert_close(auto, off, rtol=1e-4, atol=1e-5)  # flex without a bias vs SDPA
