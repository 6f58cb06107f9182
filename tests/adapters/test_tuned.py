"""The tune records and the warning apply_toma gives for a setting tune measured as slower."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import toma
from toma import tuned
from tests.tiny_models import make_sd15_unet


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(tuned.CACHE_ENV, str(tmp_path / "cache"))
    tuned._warn_once.cache_clear()  # a fresh "process" for the once-per-process warning
    yield tmp_path / "cache"
    tuned._warn_once.cache_clear()


def key_of(model, **options):
    patch = toma.apply_toma(model, warn_slower=False, **options)
    key = tuned.model_key(model, [p.name for p in patch.patched], patch.config.to_dict())
    toma.remove_toma(model)
    return key


def entry(key, speedup, reliable=True, **extra):
    return {"key": key, "speedup": speedup, "reliable": reliable, "grid": [8, 8], "batch": 1, "mode": "eager", **extra}


def caught(fn):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return [w for w in seen if issubclass(w.category, tuned.SlowerSettingWarning)]


def test_cache_path_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(tuned.CACHE_ENV, str(tmp_path / "a"))
    assert tuned.cache_path() == tmp_path / "a" / "tune.json"
    monkeypatch.delenv(tuned.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert tuned.cache_path() == tmp_path / "x" / "toma" / "tune.json"


def test_one_computation_spelled_two_ways_has_one_key():
    model = make_sd15_unet()
    same = key_of(model, ratio=0.5, merge_mlp=True)
    assert key_of(model, ratio=0.5, merge_mlp=True, mlp_ratio=0.5, attn_ratio=0.5) == same
    # another level merges other blocks: another key (levels past the model's two are refused,
    # tests/adapters/test_unet.py)
    assert key_of(model, ratio=0.5, merge_mlp=True, levels=2) != same
    assert key_of(model, ratio=0.5, merge_mlp=True, mlp_ratio=0.25) != same
    assert key_of(model, ratio=0.5) != same
    assert key_of(model, ratio=0.5, merge_mlp=True, tile_size=2) != same


def test_record_replaces_entries_of_the_same_measurement(cache_dir):
    path = tuned.record([entry("a", 0.9), entry("b", 1.2)])
    tuned.record([entry("a", 1.1), entry("a", 0.8, batch=2)])
    got = sorted((e["key"], e["batch"], e["speedup"]) for e in tuned.read_entries(path))
    assert got == [("a", 1, 1.1), ("a", 2, 0.8), ("b", 1, 1.2)]


def test_apply_warns_once_for_a_setting_measured_slower(cache_dir):
    model = make_sd15_unet()
    slow = key_of(model, ratio=0.5, merge_mlp=True)
    tuned.record([entry(slow, 0.8, measured_at="2026-11-30"), entry(key_of(model, ratio=0.25), 1.3)])
    first = caught(lambda: toma.apply_toma(model, ratio=0.5, merge_mlp=True))
    assert len(first) == 1
    text = str(first[0].message)
    assert "UNet2DConditionModel" in text and "0.80x at 8x8 tokens, batch 1, eager (2026-11-30)" in text
    assert first[0].filename == __file__  # points at the user's call
    assert caught(lambda: toma.apply_toma(model, ratio=0.5, merge_mlp=True, mlp_ratio=0.5)) == []  # once
    assert caught(lambda: toma.apply_toma(model, ratio=0.25)) == []  # measured faster
    assert caught(lambda: toma.apply_toma(model, ratio=0.75)) == []  # never measured
    toma.remove_toma(model)


def test_no_warning_when_unreliable_switched_off_or_no_file(cache_dir):
    model = make_sd15_unet()
    assert caught(lambda: toma.apply_toma(model, ratio=0.5)) == []  # no file
    tuned.record([entry(key_of(model, ratio=0.5), 0.8, reliable=False), entry(key_of(model, ratio=0.4), 0.8)])
    assert caught(lambda: toma.apply_toma(model, ratio=0.5)) == []
    assert caught(lambda: toma.apply_toma(model, ratio=0.4, warn_slower=False)) == []
    # the warning is still due for the setting that was not warned about
    assert len(caught(lambda: toma.apply_toma(model, ratio=0.4))) == 1
    toma.remove_toma(model)


def test_a_tuned_cpu_float32_setting_does_not_warn_for_another_dtype(cache_dir):
    model = make_sd15_unet()
    tuned.record([entry(key_of(model, ratio=0.5), 0.8)])
    model.to(torch.float64)
    assert caught(lambda: toma.apply_toma(model, ratio=0.5)) == []
    toma.remove_toma(model)


def test_an_unreadable_record_file_warns_once_and_apply_still_works(cache_dir):
    cache_dir.mkdir()
    (cache_dir / "tune.json").write_text("{broken")
    model = make_sd15_unet()
    seen = caught(lambda: toma.apply_toma(model, ratio=0.5))
    assert len(seen) == 1 and "tune.json cannot be read" in str(seen[0].message)
    assert toma.get_toma(model) is not None
    assert caught(lambda: toma.apply_toma(model, ratio=0.4)) == []
    (cache_dir / "tune.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="is not a version-1 'toma-tune-cache' file"):
        tuned.read_entries()
    toma.remove_toma(model)
