"""``toma eval --methods toma+fbcache,none+cachedit,...``: step caches stacked with a method,
on the built-in transformers driven by their own samplers (one image, 2 steps)."""

from __future__ import annotations

import json
import math

import pytest

from toma.tools.cli import main
from toma.tools.eval.caches import split_method

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
    # toma+cachedit must give ToMA's images exactly: merged, under the cache
    methods = "toma,none+fbcache:100,toma+cachedit:0.1,none+cachedit"
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
