"""``toma tune`` end to end on the built-in model and tiny archs.

Timing on a shared CPU decides nothing here: a fake clock (``bench_harness._time_sample``)
gives each setting a set time, so which setting wins is known; the quality check is real.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import toma
from toma import tuned
from toma.tools.bench import harness as bench_harness
from toma.tools.tune import run as tune_run
from toma.tools.archs import ARCHS, build_model
from toma.tools.cli import main


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(tuned.CACHE_ENV, str(tmp_path / "cache"))
    tuned._warn_once.cache_clear()
    yield tmp_path / "cache"
    tuned._warn_once.cache_clear()


def fake_clock(monkeypatch, seconds, interrupt_at=None):
    """Make every timed sample take ``seconds(options, compiled)`` seconds without running it:
    ``options`` is the applied variant's option dict plus its ratio (None: unpatched)."""
    state = {"variant": None, "calls": 0}
    apply, remove = bench_harness.MethodPatcher.apply, bench_harness.MethodPatcher.remove

    def applying(self, variant):
        state["variant"] = variant
        return apply(self, variant)

    def removing(self):
        state["variant"] = None
        return remove(self)

    def sample(call, inputs, device, *clock):
        state["calls"] += 1
        if state["calls"] == interrupt_at:
            raise KeyboardInterrupt
        compiled = getattr(call, "toma_variant", None)  # a compiled copy's call names its variant
        v = compiled if compiled is not None else state["variant"]
        options = None if v is None or v.method == "none" else {**dict(v.options), "ratio": v.ratio}
        return seconds(options, compiled is not None)

    monkeypatch.setattr(bench_harness.MethodPatcher, "apply", applying)
    monkeypatch.setattr(bench_harness.MethodPatcher, "remove", removing)
    monkeypatch.setattr(bench_harness, "_time_sample", sample)
    return state


def faster_with_mlp(options, compiled):
    """Unpatched 1 s; each candidate faster with its ratio, more so with the MLP merged."""
    if options is None:
        return 1.0
    return 1.0 - 0.4 * options["ratio"] - (0.2 if options["merge_mlp"] else 0.0)


# the tiny UNet's attention at ratio 0.5, at the resolution the tune tests time
TINY_UNET = ["tune", "--arch", "tiny-unet", "--resolution", "64", "--ratios", "0.5", "--parts", "attn"]
BUILTIN = ["tune", "--check-images", "2", "--check-steps", "2", "--repeats", "2", "--warmup", "0", "--no-progress"]


def test_builtin_tune_writes_the_fastest_setting_within_the_bound(tmp_path, monkeypatch, capsys, cache_dir):
    fake_clock(monkeypatch, faster_with_mlp)
    out = tmp_path / "tuned.json"
    argv = [*BUILTIN, "--ratios", "0.5", "--levels", "1", "--mlp-ratios", "same", "--out", str(out)]
    assert main([*argv, "--min-psnr", "0"]) == 0
    text = capsys.readouterr().out
    assert "quality check: mean PSNR of 2 digits sampled with the built-in DDIM sampler (2 steps" in text
    assert "* L1 attn+mlp @0.5" in text and "fastest within the bound: L1 attn+mlp @0.5 (eager), 1.667x" in text
    assert toma.load_config(out) == toma.ToMAConfig(ratio=0.5, merge_mlp=True, tile_size="auto")
    prov = json.loads(out.read_text())["provenance"]
    assert prov["setting"] == "L1 attn+mlp @0.5" and prov["speedup"] == pytest.approx(1 / 0.6)
    assert prov["grid"] == [32, 32] and prov["batch"] == 2 and prov["mode"] == "eager" and prov["reliable"]
    assert prov["quality_bound"] == "PSNR >= 0 dB" and not prov["interrupted"]
    # the records hold both settings with their PSNR; a bound between them picks the attention-only one
    psnr = {e["setting"]: e["psnr_db"] for e in tuned.read_entries()}
    assert set(psnr) == {"L1 attn @0.5", "L1 attn+mlp @0.5"} and psnr["L1 attn+mlp @0.5"] < psnr["L1 attn @0.5"]
    middle = (psnr["L1 attn+mlp @0.5"] + psnr["L1 attn @0.5"]) / 2
    assert main([*argv, "--min-psnr", str(middle)]) == 0
    assert "fastest within the bound: L1 attn @0.5 (eager), 1.250x" in capsys.readouterr().out
    assert toma.load_config(out) == toma.ToMAConfig(ratio=0.5, tile_size="auto")
    # a drop of 0 dB from the default setting (L1 attn @0.5) keeps exactly the settings at least as faithful
    assert main([*argv, "--max-psnr-drop", "0"]) == 0
    assert "fastest within the bound: L1 attn @0.5" in capsys.readouterr().out


def test_a_bound_nothing_meets_writes_no_config(tmp_path, monkeypatch, capsys, cache_dir):
    fake_clock(monkeypatch, faster_with_mlp)
    out = tmp_path / "tuned.json"
    rc = main(
        [
            *BUILTIN,
            "--ratios",
            "0.5",
            "--levels",
            "1",
            "--parts",
            "attn",
            "--min-psnr",
            "1000",
            "--no-record",
            "--out",
            str(out),
        ]
    )
    assert rc == 1
    text = capsys.readouterr().out
    assert "no candidate meets the quality bound (PSNR >= 1000 dB)" in text and "wrote no config" in text
    assert not out.exists() and not cache_dir.exists()


def test_nothing_faster_says_so_and_apply_toma_then_warns(tmp_path, monkeypatch, capsys, cache_dir):
    fake_clock(monkeypatch, lambda options, compiled: 1.0 if options is None else 1.25)
    out = tmp_path / "tuned.json"
    out.write_text("kept")
    rc = main(
        [
            *TINY_UNET,
            "--levels",
            "1",
            "--min-psnr",
            "0",
            "--repeats",
            "2",
            "--warmup",
            "0",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert rc == 1
    text = capsys.readouterr().out
    assert "no candidate within the quality bound is faster than unpatched" in text
    assert f"wrote no config; {out} was left as it was" in text and out.read_text() == "kept"
    assert "0.800x" in text and "random weights, so it says little about images" in text
    model = build_model(ARCHS["tiny-unet"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        toma.apply_toma(model, ratio=0.5)
        toma.apply_toma(model, ratio=0.5)
        toma.apply_toma(model, ratio=0.25)  # not measured
    slower = [w for w in seen if issubclass(w.category, tuned.SlowerSettingWarning)]
    assert len(slower) == 1 and "0.80x at 8x8 tokens, batch 1, eager" in str(slower[0].message)


def test_ctrl_c_keeps_what_was_measured(tmp_path, monkeypatch, capsys):
    # round 1 times none, L1 attn @0.5, L1 attn+mlp @0.5; round 2 (rotated) is cut at its second sample
    fake_clock(monkeypatch, faster_with_mlp, interrupt_at=5)
    out = tmp_path / "tuned.json"
    rc = main(
        [
            *BUILTIN,
            "--ratios",
            "0.5",
            "--levels",
            "1",
            "--mlp-ratios",
            "same",
            "--min-psnr",
            "0",
            "--repeats",
            "3",
            "--out",
            str(out),
        ]
    )
    assert rc == 130
    text = capsys.readouterr().out
    assert "interrupted: the table holds what was measured" in text
    prov = json.loads(out.read_text())["provenance"]
    assert prov["interrupted"] and prov["setting"] == "L1 attn+mlp @0.5" and prov["samples"] == 1


def test_ctrl_c_in_the_quality_check_writes_nothing(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune_run, "psnr_against", interrupted)
    out = tmp_path / "tuned.json"
    rc = main(
        [
            *TINY_UNET,
            "--levels",
            "1",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert rc == 130 and not out.exists()
    assert "wrote no config" in capsys.readouterr().out


def test_budget_stops_after_one_timed_round(tmp_path, monkeypatch, capsys):
    fake_clock(monkeypatch, faster_with_mlp)
    rc = main(
        [
            *BUILTIN,
            "--ratios",
            "0.5",
            "--levels",
            "1",
            "--parts",
            "attn",
            "--min-psnr",
            "0",
            "--repeats",
            "5",
            "--budget-s",
            "0.001",
            "--out",
            str(tmp_path / "t.json"),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "--budget-s 0.001: timing stopped after 1 round(s)" in text
    assert json.loads((tmp_path / "t.json").read_text())["provenance"]["samples"] == 1


def test_duplicates_are_dropped_and_flux_tries_default_and_all_blocks(tmp_path, monkeypatch, capsys):
    fake_clock(monkeypatch, lambda o, c: 1.0 if o is None else 0.9 - 0.1 * ("blocks" in o))
    out = tmp_path / "tuned.json"
    assert (
        main(
            [
                "tune",
                "--arch",
                "tiny-flux",
                "--resolution",
                "64",
                "--ratios",
                "0.5",
                "--min-psnr",
                "0",
                "--repeats",
                "2",
                "--warmup",
                "0",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "* all attn @0.5" in text and "default attn @0.5" in text
    assert dict(toma.load_config(out).blocks) == {"transformer_blocks": (0, 1), "single_transformer_blocks": (0, 1)}
    # the tiny UNet's attention levels are its first and its middle block: levels 3 is refused, and skipped
    assert (
        main(
            [
                *TINY_UNET,
                "--levels",
                "2,3",
                "--min-psnr",
                "0",
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "skipping L3 attn @0.5: levels must be in 1..2: UNet2DConditionModel has 2 attention level(s)" in text


def test_compile_times_the_fastest_eager_candidates_compiled_and_chooses_among_them(tmp_path, monkeypatch, capsys):
    def seconds(options, compiled):
        if options is None:
            return 0.5 if compiled else 1.0
        # compiled, only the attention-only setting keeps a speedup
        return (0.45 if not options["merge_mlp"] else 0.6) if compiled else faster_with_mlp(options, False)

    fake_clock(monkeypatch, seconds)
    out = tmp_path / "tuned.json"
    assert (
        main(
            [
                *BUILTIN,
                "--ratios",
                "0.5",
                "--levels",
                "1",
                "--mlp-ratios",
                "same",
                "--min-psnr",
                "0",
                "--compile",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "fastest within the bound: L1 attn @0.5 (compiled), 1.111x" in text
    assert json.loads(out.read_text())["provenance"]["mode"] == "compiled"
    entries = {(e["setting"], e["mode"]): e["speedup"] for e in tuned.read_entries()}
    assert entries[("L1 attn+mlp @0.5", "compiled")] == pytest.approx(0.5 / 0.6)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ratios", "0.5,1.5"], "--ratios must lie in (0, 1)"),
        (["--ratios", "half"], "--ratios must be a comma-separated list"),
        (["--levels", "0"], "--levels must be >= 1"),
        (["--arch", "tiny-flux", "--levels", "2"], "--levels applies to UNets"),
        (["--blocks", "all"], "--blocks applies to transformers"),
        (["--arch", "tiny-flux", "--blocks", "some"], "--blocks must be drawn from default,all"),
        (["--parts", "attn+foo"], "--parts entries must join distinct attn, cross, mlp"),
        (["--parts", "attn+attn"], "--parts entries must join distinct"),
        (["--arch", "tiny-flux", "--parts", "attn+mlp"], "--parts: Flux merges attention only"),
        (["--mlp-ratios", "2"], "--mlp-ratios must hold 'same' or numbers in (0, 1)"),
        (["--max-psnr-drop", "-1"], "--max-psnr-drop must be a finite number of dB >= 0"),
        (["--min-psnr", "nan"], "--min-psnr must be a finite number"),
        (["--budget-s", "0"], "--budget-s must be > 0"),
        (["--out", "tuned.txt"], "--out must be a .json file"),
        (["--model", "some/model"], "--model needs --arch"),
        (["--dtype", "float16"], "the built-in model runs in float32"),
        (["--device", "cuda"], "the built-in model's sampler runs on the CPU"),
        (["--arch", "tiny-unet", "--frames", "5"], "--frames applies to video archs"),
        (["--arch", "tiny-unet", "--resolution", "60"], "resolution must be a multiple of 8"),
        (["--arch", "tiny-unet", "--depth", "2"], "--depth applies to transformers"),
        (["--batch", "0"], "--batch must be >= 1"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--compile-top", "0"], "--compile-top must be >= 1"),
        (["--freezing"], "--freezing applies to compiled rows: add --compile"),
        (["--tile-size", "0"], "--tile-size must be 'auto' or a whole number of tokens >= 1"),
        (["--arch", "tiny-unet", "--dtype", "float8"], "--dtype must be one of"),
    ],
)
def test_bad_arguments_are_refused_in_one_line_before_any_work(argv, message, monkeypatch, capsys):
    def no_work(*args, **kwargs):
        raise AssertionError("work started")

    monkeypatch.setattr(tune_run, "build_model", no_work)
    monkeypatch.setattr("toma.tools.builtin.unet.load_builtin", no_work)
    assert main(["tune", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("toma tune: error: ") and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "argv,dtype",
    [
        ([], "float32"),
        (["--dtype", "float32"], "float32"),
        (["--arch", "tiny-unet", "--dtype", "fp32"], "float32"),
        (["--arch", "tiny-unet", "--dtype", "bf16"], "bfloat16"),
    ],
)
def test_dtype_spellings_give_torch_dtypes(argv, dtype):
    # regression: --dtype gave the dtype's name (a str), which the built-in model refused as
    # not float32 and .to() could not take
    import argparse

    from toma.tools.tune import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    setup = tune_run._options(parser.parse_args(["tune", *argv]))
    assert setup.dtype is getattr(torch, dtype)
