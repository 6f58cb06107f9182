"""``toma eval --methods toma+fbcache,none+cachedit,...``: step caches stacked with a method,
on the built-in transformers driven by their own samplers (one image, 2 steps)."""

from __future__ import annotations

import json
import math

import pytest

from toma.tools.cli import main
from toma.tools.eval.caches import count_skips, enable, skip_stats, split_method

pytestmark = pytest.mark.usefixtures("one_thread")


def results(out) -> dict:
    """Rows by method; PSNR as a float (results.json writes the reference's infinity as null)."""
    rows = {row["method"]: row for row in json.loads((out / "results.json").read_text())["results"]}
    for row in rows.values():
        row["psnr"] = math.inf if row["psnr"] is None else row["psnr"]
    return rows


@pytest.mark.parametrize("model", ["builtin-dit", "builtin-video"])
def test_eval_runs_methods_with_caches(tmp_path, model):
    pytest.importorskip("cache_dit")
    out = tmp_path / "ev"
    # FirstBlockCache at a threshold no change reaches skips the second step's later blocks;
    # cache-dit computes every block of its first 8 (warm-up) steps, so that with 2 steps
    # toma+cachedit must give ToMA's images exactly: merged, under the cache. FirstBlockCache
    # runs after cache-dit's removal: on Flux cache-dit left the block stacks reordered, and
    # FirstBlockCache then failed
    methods = "toma,none+cachedit,none+fbcache:100,toma+cachedit:0.1"
    assert (
        main(
            [
                "eval",
                "--model",
                model,
                "--methods",
                methods,
                "--num-images",
                "1",
                "--steps",
                "2",
                "--batch-size",
                "1",
                "--threads",
                "1",
                "--out-dir",
                str(out),
            ]
        )
        == 0
    )
    rows = results(out)
    assert set(rows) == {"none", "toma", "none+fbcache:100", "toma+cachedit:0.1", "none+cachedit"}
    assert rows["none+cachedit"]["ratio"] == rows["none+fbcache:100"]["ratio"] == 0  # a cache alone merges nothing
    assert math.isinf(rows["none+cachedit"]["psnr"])
    assert math.isfinite(rows["none+fbcache:100"]["psnr"])  # the cache skipped work
    assert math.isfinite(rows["toma"]["psnr"]) and rows["toma+cachedit:0.1"]["psnr"] == rows["toma"]["psnr"]
    # the steps skipped, counted: FirstBlockCache's second (index 1) and nothing else
    assert rows["none+fbcache:100"]["skip_steps"] == [[1]] and rows["none+fbcache:100"]["steps_skipped"] == 0.5
    for method in ("none", "toma", "none+cachedit", "toma+cachedit:0.1"):
        assert rows[method]["skip_steps"] == [[]] and rows[method]["steps_skipped"] == 0
    assert all(row["skip_overlap"] is None for row in rows.values())  # no none+cachedit:0.1 ran
    assert "steps skipped" in (out / "results.md").read_text()


def test_skip_stats_fraction_and_overlap():
    # two batches of 4 steps; merged skips {(0, 2), (0, 3), (1, 1)}, alone {(0, 3), (1, 1), (1, 2)}
    stats = skip_stats([[2, 3], [1]], [4, 4], [[3], [1, 2]])
    assert stats["steps_skipped"] == 3 / 8
    assert stats["skip_steps"] == [[2, 3], [1]]
    assert stats["skip_overlap"] == 2 / 4  # two pairs shared of four skipped by either
    assert skip_stats([[], []], [4, 4], [[], []])["skip_overlap"] is None  # neither skipped
    assert skip_stats([[1]], [2], None)["skip_overlap"] is None


def test_count_skips_counts_calls_whose_later_blocks_a_cache_skipped():
    torch = pytest.importorskip("torch")
    from diffusers.hooks import FirstBlockCacheConfig

    from tests.tiny_models import flux_inputs, make_flux

    model = make_flux()
    inputs = flux_inputs(1, 4, 4)
    with torch.no_grad():
        with count_skips(model) as plain:
            model(**inputs)
            model(**inputs)
        assert (plain.calls, plain.skipped) == (2, [])
        # a threshold no change reaches: every call after the first skips the later blocks
        model.enable_cache(FirstBlockCacheConfig(threshold=100.0))
        with model.cache_context("cond"), count_skips(model) as cached:
            for _ in range(3):
                model(**inputs)
        model.disable_cache()
    assert (cached.calls, cached.skipped) == (3, [1, 2])
    with pytest.raises(ValueError, match="no block stack"):
        with count_skips(torch.nn.Linear(2, 2)):
            pass


def test_cache_dit_removal_leaves_the_model_as_it_was():
    pytest.importorskip("cache_dit")
    torch = pytest.importorskip("torch")
    from tests.tiny_models import flux_inputs, make_flux

    model = make_flux()
    inputs = flux_inputs(1, 4, 4)
    order = list(model._modules)
    with torch.no_grad():
        expected = model(**inputs).sample
        remove = enable(model, "fbcache", 100.0, 2)  # leaves an empty hook registry on the model
        model(**inputs)
        remove()
        remove = enable(model, "cachedit", 0.1, 2)
        model(**inputs)
        remove()
        # cache-dit's disable_cache alone leaves the block stacks last and its Flux forward on
        assert list(model._modules) == order and "forward" not in model.__dict__
        assert torch.equal(model(**inputs).sample, expected)
        remove = enable(model, "fbcache", 100.0, 2)  # failed after cache-dit: it took a single block for the first
        with count_skips(model) as skips:
            model(**inputs)
            model(**inputs)
        remove()
    assert skips.skipped == [1]


def test_method_names_with_caches():
    assert split_method("toma") == ("toma", None, None)
    assert split_method("toma+fbcache") == ("toma", "fbcache", None)
    assert split_method("none+cachedit:0.12") == ("none", "cachedit", 0.12)
    for bad, why in [
        ("toma+magic", "the caches are"),
        ("toma+taylorseer:0.1", "takes no threshold"),
        ("toma+fbcache:-1", "number > 0"),
        ("toma+fbcache:x", "number > 0"),
    ]:
        with pytest.raises(ValueError, match=why):
            split_method(bad)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "builtin", "--methods", "toma+fbcache"], "go on transformers"),
        (["--model", "builtin-dit", "--methods", "toma+nocache"], "the caches are"),
        (["--model", "builtin-dit", "--methods", "tomesd+fbcache"], "cannot run on --model builtin-dit"),
    ],
)
def test_eval_refuses_caches_that_cannot_run(tmp_path, capsys, argv, message):
    assert main(["eval", *argv, "--num-images", "1", "--steps", "1", "--out-dir", str(tmp_path / "ev")]) == 2
    assert message in capsys.readouterr().err


def test_cache_dit_enables_quietly(capfd):
    # cache-dit logs each enable at INFO on its CACHE_DIT logger, once per batch and
    # variant of an eval; the eval keeps it to warnings (the logger was misnamed before)
    pytest.importorskip("cache_dit")
    torch = pytest.importorskip("torch")
    from tests.tiny_models import flux_inputs, make_flux

    model = make_flux()
    capfd.readouterr()
    remove = enable(model, "cachedit", 0.1, 2)
    with torch.no_grad():
        model(**flux_inputs(1, 4, 4))
    remove()
    captured = capfd.readouterr()
    assert "Cache-DiT" not in captured.out + captured.err
