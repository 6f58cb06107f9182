"""``toma eval`` and ``toma generate`` with ``--model builtin-dit`` (the built-in digits Flux transformer).

Loads the shipped weights; each test samples a few images with 1 or 2 Euler steps.
"""

from __future__ import annotations

import argparse
import math
import shutil

import pytest
import torch
from PIL import Image

import toma
from toma.tools.builtin import BUILTIN_MODELS, builtin_name, check_methods, load_sampler
from toma.tools.builtin.dit import load_dit, sample
from toma.tools.builtin.unet import classify
from tests.tiny_pipelines import eval_on_two_processes, read_results
from toma.tools.cli import main
from toma.tools.common.options import parse_blocks
from toma.tools.eval.metrics import psnr, ssim

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--model", "builtin-dit", "--num-images", "4", "--steps", "2", "--batch-size", "4", "--threads", "1"]


def test_eval_dit_reports_the_dits_own_images(tmp_path):
    out = tmp_path / "ev"
    assert main(["eval", *TINY, "--seed", "3", "--out-dir", str(out)]) == 0
    data = read_results(out)
    rows = {r["method"]: r for r in data["results"]}
    # tomesd does not apply to a transformer, so the default methods leave it out
    assert list(rows) == ["none", "toma", "toma-random", "toma-grid"]
    assert data["model"] == BUILTIN_MODELS["builtin-dit"].title
    for row in rows.values():
        assert row["n_images"] == 4 and row["latency_s"] > 0
        assert math.isfinite(row["fd_real"]) and row["fd_real"] >= 0

    # the same numbers straight from the DiT: classes i % 10, seeds 3.., 2 Euler steps
    model = load_dit()
    labels, seeds = [0, 1, 2, 3], [3, 4, 5, 6]
    ref = sample(model, labels, seeds, steps=2, progress=False)
    toma.apply_toma(model.transformer, ratio=0.5)
    try:
        merged = sample(model, labels, seeds, steps=2, progress=False)
    finally:
        toma.remove_toma(model.transformer)
    assert rows["none"]["psnr"] is None and rows["none"]["ssim"] == pytest.approx(1.0)
    assert rows["toma"]["psnr"] == pytest.approx(psnr(merged, ref).mean().item(), rel=1e-6)
    assert rows["toma"]["ssim"] == pytest.approx(ssim(merged, ref).mean().item(), rel=1e-6)
    for name, images in (("none", ref), ("toma", merged)):
        preds, _ = classify(model.classifier, images)
        assert rows[name]["accuracy"] == (preds == torch.tensor(labels)).double().mean().item()
    assert "built-in digits DiT" in (out / "results.md").read_text()


def test_eval_dit_refuses_tomesd_before_generating(tmp_path, capsys):
    out = tmp_path / "ev"
    assert main(["eval", *TINY, "--methods", "toma,tomesd", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--methods tomesd" in err and "builtin-dit" in err and "UNet" in err
    assert not out.exists()
    with pytest.raises(ValueError, match="tomesd"):
        check_methods("builtin-dit", ["none", "tomesd"])
    check_methods("builtin", ["none", "toma", "tomesd"])  # the UNet takes every method


def test_eval_dit_blocks_reach_the_transformer(tmp_path, capsys):
    # a stack the transformer lacks fails before the unmerged reference is generated
    out = tmp_path / "bad"
    assert main(["eval", *TINY, "--methods", "toma", "--blocks", "blocks=0", "--out-dir", str(out)]) == 2
    assert "single_transformer_blocks" in capsys.readouterr().err and not (out / "results.json").exists()
    # merging one double block only changes the images less than the default (1 double + 2 single)
    few, default = tmp_path / "few", tmp_path / "default"
    common = [*TINY, "--methods", "toma", "--num-images", "2", "--batch-size", "2"]
    assert main(["eval", *common, "--blocks", "transformer_blocks=1", "--out-dir", str(few)]) == 0
    assert main(["eval", *common, "--out-dir", str(default)]) == 0
    psnr_few = read_results(few)["results"][1]["psnr"]
    psnr_default = read_results(default)["results"][1]["psnr"]
    assert psnr_few > psnr_default
    assert read_results(few)["toma_options"]["blocks"] == {"transformer_blocks": [1]}


def test_parse_blocks():
    assert parse_blocks("transformer_blocks=0-1;single_transformer_blocks=2,3") == {
        "transformer_blocks": (0, 1),
        "single_transformer_blocks": (2, 3),
    }
    assert parse_blocks("single_transformer_blocks=1-3,2,5;") == {"single_transformer_blocks": (1, 2, 3, 5)}
    assert parse_blocks("transformer_blocks=") == {"transformer_blocks": ()}
    for bad in ("", "transformer_blocks", "a=1;a=2", "a=x", "a=3-1", "a=-1", "=1"):
        with pytest.raises(argparse.ArgumentTypeError, match="--blocks"):
            parse_blocks(bad)


def test_bad_blocks_text_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "builtin-dit", "--blocks", "x=1-", "--out", str(tmp_path / "x.png")])
    assert exit_info.value.code == 2 and "--blocks" in capsys.readouterr().err


def test_builtin_names():
    assert builtin_name(None) == "builtin" and builtin_name("builtin-dit") == "builtin-dit"
    assert builtin_name("stabilityai/sdxl-turbo") is None  # a pipeline
    with pytest.raises(ValueError, match="--model"):
        load_sampler("builtin-nope")


def test_generate_dit_grid_and_compare(tmp_path, capsys):
    out = tmp_path / "g.png"
    assert main(["generate", "--model", "builtin-dit", "--steps", "1", "--labels", "0,1,2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "built-in digits DiT" in text and "time per image: unmerged" in text
    assert Image.open(out).size[0] > 3 * 128  # three 128-pixel digits in a row
    cmp = tmp_path / "cmp.png"
    assert (
        main(
            [
                "generate",
                "--model",
                "builtin-dit",
                "--steps",
                "1",
                "--labels",
                "4",
                "--compare",
                "--ratio",
                "0.25",
                "--proportional-attention",
                "--out",
                str(cmp),
            ]
        )
        == 0
    )
    assert Image.open(cmp).size[0] > 2 * 128  # two panels side by side
    assert "speedup" in capsys.readouterr().out


def test_generate_dit_bad_settings(tmp_path, capsys):
    out = tmp_path / "x.png"
    assert main(["generate", "--model", "builtin-dit", "--labels", "3,12", "--out", str(out)]) == 2
    assert "--labels" in capsys.readouterr().err
    assert main(["generate", "--model", "builtin-dit", "--blocks", "blocks=0", "--out", str(out)]) == 2
    assert "single_transformer_blocks" in capsys.readouterr().err
    # the UNet would ignore --blocks, so it is refused there
    assert main(["generate", "--model", "builtin", "--blocks", "transformer_blocks=0", "--out", str(out)]) == 2
    assert "--blocks" in capsys.readouterr().err
    assert main(["eval", "--blocks", "transformer_blocks=0", "--out-dir", str(tmp_path / "ev")]) == 2
    assert "--levels" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "ev").exists()


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate is not installed")
def test_eval_dit_data_parallel_two_cpu_processes(tmp_path):
    # the processes' split of the images is the eval harness's, whichever model it runs
    # (toma/tools/eval/harness.py); this one test of it compares the scores exactly
    single, double = tmp_path / "one", tmp_path / "two"
    common = [
        "eval",
        "--model",
        "builtin-dit",
        "--num-images",
        "4",
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--methods",
        "toma",
    ]
    assert main([*common, "--threads", "1", "--out-dir", str(single)]) == 0
    proc = eval_on_two_processes(common, double, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    one, two = read_results(single), read_results(double)
    assert two["machine"]["processes"] == 2 and two["model"] == one["model"]
    for a, b in zip(one["results"], two["results"]):
        assert (a["method"], b["n_images"]) == (b["method"], 4)
        # same seeds per image and the same batches of 2, so the split changes nothing
        if a["psnr"] is not None:
            assert b["psnr"] == pytest.approx(a["psnr"], rel=1e-6)
        assert b["accuracy"] == a["accuracy"]
