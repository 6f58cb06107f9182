"""``toma eval``: output files with sane values, pipelines, errors, and 2-process data parallel."""

from __future__ import annotations

import math
import os

import pytest

from tests.tiny_pipelines import read_results
from toma.tools.cli import main


pytestmark = pytest.mark.usefixtures("one_thread")


TINY = ["--num-images", "4", "--steps", "2", "--batch-size", "2", "--threads", "1"]


def test_eval_builtin_writes_sane_results(tmp_path, capsys):
    out = tmp_path / "ev"
    assert main(["eval", *TINY, "--out-dir", str(out)]) == 0
    printed = capsys.readouterr()
    data = read_results(out)
    rows = {r["method"]: r for r in data["results"]}
    assert list(rows) == ["none", "toma", "toma-random", "toma-grid", "tomesd"]
    assert rows["none"]["psnr"] is None  # inf against itself, stored as null
    assert rows["none"]["ssim"] == pytest.approx(1.0) and rows["none"]["speedup"] == pytest.approx(1.0)
    for name, row in rows.items():
        assert row["n_images"] == 4 and row["latency_s"] > 0 and 0 <= row["accuracy"] <= 1
        assert math.isfinite(row["fd_real"]) and row["fd_real"] >= 0
        if name != "none":
            assert 10 < row["psnr"] < 80 and -1 <= row["ssim"] < 1 and row["ratio"] == 0.5
    table = (out / "results.md").read_text()
    assert "| toma | 0.5 | 4 |" in table and "classifier acc." in table
    assert data["machine"]["processes"] == 1
    # timing: two batches of 2 per variant, interleaved; spread, flags and load recorded
    for row in rows.values():
        assert row["timed_batches"] == 2 and row["spread"] >= 0 and isinstance(row["flags"], list)
    assert "time spread" in table
    if hasattr(os, "getloadavg"):
        assert len(data["machine"]["load_average_before"]) == 3 and "load average" in table
    # 4 images cannot carry a Frechet distance: said in the output, the table and the JSON
    assert data["fd_reliable"] is False and "FD to real digits *" in table
    assert "warning: Frechet distances (fd_real, fd_vs_none) from 4 images per variant are unreliable" in printed.out
    assert "unreliable" in table
    # the progress ends in one summary line, not a finished bar drawn twice
    assert printed.err.count("20/20 [") <= 1 and "/20 [" in printed.err, printed.err  # the bar ran, then ended once
    assert printed.err.count("eval images: 20/20 generated in") == 1, printed.err


def test_eval_merges_the_mlp_at_its_own_ratio(tmp_path):
    # the placements of the speed-quality frontier (MLP merged, at a lower ratio) reach eval
    runs = {}
    for name, extra in (("attn", []), ("mlp", ["--merge-mlp", "--mlp-ratio", "0.25"])):
        out = tmp_path / name
        assert main(["eval", *TINY, "--methods", "toma", "--out-dir", str(out), *extra]) == 0
        runs[name] = read_results(out)
    mlp = runs["mlp"]
    assert mlp["toma_options"]["merge_mlp"] is True and mlp["toma_options"]["mlp_ratio"] == 0.25
    assert "merge_mlp" not in runs["attn"]["toma_options"]
    psnr = {name: {r["method"]: r for r in data["results"]}["toma"]["psnr"] for name, data in runs.items()}
    assert psnr["mlp"] != psnr["attn"]  # the MLP merged: other images


def test_eval_merges_in_a_step_window(tmp_path):
    # late-step merging and MLP levels (one of the frontier's questions) reaches eval; a window that
    # covers no step of the run gives the unmerged images exactly
    runs = {}
    for name, extra in (
        ("late", ["--start-step", "1", "--levels", "2", "--merge-mlp", "--mlp-levels", "2"]),
        ("never", ["--start-step", "100"]),
    ):
        out = tmp_path / name
        assert main(["eval", *TINY, "--methods", "toma", "--out-dir", str(out), *extra]) == 0
        runs[name] = read_results(out)
    assert runs["late"]["toma_options"]["start_step"] == 1 and runs["late"]["toma_options"]["mlp_levels"] == [2]
    late, never = ({r["method"]: r for r in runs[n]["results"]}["toma"] for n in ("late", "never"))
    assert math.isfinite(late["psnr"]) and late["psnr"] > 10
    assert never["psnr"] is None and never["ssim"] == 1.0, never  # identical images: no finite PSNR


def test_eval_rejects_bad_options(tmp_path, capsys):
    assert main(["eval", "--methods", "toma,tome", "--out-dir", str(tmp_path)]) == 2
    assert "--methods" in capsys.readouterr().err
    assert main(["eval", "--ratios", "0.5,1.2", "--out-dir", str(tmp_path)]) == 2
    assert "--ratios" in capsys.readouterr().err
    assert main(["eval", "--clip", "--out-dir", str(tmp_path)]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["eval", "--mlp-ratio", "0.25", "--out-dir", str(tmp_path)]) == 2
    assert "mlp_ratio is set but merge_mlp is off" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


@pytest.fixture(scope="module")
def tiny_sd_folder(tmp_path_factory):
    """A tiny random-weight SD 1.x-style pipeline saved with save_pretrained (no download)."""
    from diffusers import DDIMScheduler

    from tests.tiny_pipelines import tiny_sd_pipeline

    root = tmp_path_factory.mktemp("tiny-sd")
    pipe = tiny_sd_pipeline(root / "tok", scheduler=DDIMScheduler(clip_sample=False))
    pipe.save_pretrained(root / "pipe")
    return root / "pipe"


def test_eval_and_generate_on_a_local_pipeline(tiny_sd_folder, tmp_path):
    out = tmp_path / "ev"
    args = ["--model", str(tiny_sd_folder), "--height", "32", "--width", "32", "--threads", "1"]
    code = main(["eval", *args, "--num-images", "2", "--steps", "2", "--methods", "toma,tomesd", "--out-dir", str(out)])
    assert code == 0
    rows = read_results(out)["results"]
    assert [r["method"] for r in rows] == ["none", "toma", "tomesd"]
    assert all(r["n_images"] == 2 and r["latency_s"] > 0 for r in rows)
    assert 0 < rows[1]["psnr"] < 100 and rows[1]["ssim"] <= 1
    assert main(["generate", *args, "--steps", "2", "--prompt", "a fox", "--out", str(tmp_path / "g.png")]) == 0
    assert (tmp_path / "g.png").is_file()


def test_eval_metric_weights_missing_fail_before_generating(tiny_sd_folder, tmp_path, capsys):
    code = main(
        [
            "eval",
            "--model",
            str(tiny_sd_folder),
            "--clip",
            "--clip-model",
            "toma-tests/no-such-clip",
            "--out-dir",
            str(tmp_path / "ev"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "hf download toma-tests/no-such-clip" in err and "Traceback" not in err
    code = main(["eval", "--model", "toma-tests/no-such-pipeline", "--out-dir", str(tmp_path / "ev")])
    assert code == 2 and "hf download toma-tests/no-such-pipeline" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_metric_models(tmp_path_factory):
    """Tiny random CLIP and DINOv2 models with their processors, saved like hub checkpoints."""
    from PIL import Image
    from transformers import (
        BitImageProcessor,
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPProcessor,
        Dinov2Config,
        Dinov2Model,
    )

    from tests.tiny_pipelines import clip_config, tiny_clip_tokenizer

    root = tmp_path_factory.mktemp("metric-models")
    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
    )
    clip = CLIPModel(CLIPConfig(text_config=clip_config().to_dict(), vision_config=vision, projection_dim=8))
    clip.save_pretrained(root / "clip")
    CLIPProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tiny_clip_tokenizer(root / "clip-tok"),
    ).save_pretrained(root / "clip")
    Dinov2Model(Dinov2Config(**vision)).save_pretrained(root / "dino")
    BitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(root / "dino")
    (root / "ref").mkdir()
    for i in range(3):
        Image.effect_noise((40, 40), 30 + 20 * i).convert("RGB").save(root / "ref" / f"{i}.png")
    return root


def test_eval_reports_clip_dino_and_fid_with_local_weights(tiny_sd_folder, tiny_metric_models, tmp_path):
    out = tmp_path / "ev"
    m = tiny_metric_models
    code = main(
        [
            "eval",
            "--model",
            str(tiny_sd_folder),
            "--height",
            "32",
            "--width",
            "32",
            "--threads",
            "1",
            "--num-images",
            "2",
            "--steps",
            "2",
            "--methods",
            "toma",
            "--out-dir",
            str(out),
            "--clip",
            "--clip-model",
            str(m / "clip"),
            "--dino",
            "--dino-model",
            str(m / "dino"),
            "--fid-reference",
            str(m / "ref"),
        ]
    )
    assert code == 0
    none, merged = read_results(out)["results"]
    for row in (none, merged):
        assert -1 <= row["clip_t"] <= 1
        assert math.isfinite(row["fd_dino_reference"]) and row["fd_dino_reference"] >= 0
    # the unmerged images are their own reference: DINO similarity 1, delta 0
    assert none["dino_delta"] == pytest.approx(0, abs=1e-6)
    assert -1 <= merged["dino_similarity"] <= 1 + 1e-6
    table = (out / "results.md").read_text()
    assert "CLIP-T" in table and "DINO delta" in table and "FD (DINOv2) to reference" in table


# ---------------------------------------------------------------------------- timing, offline


def test_variants_are_timed_interleaved_batch_by_batch(monkeypatch):
    from toma.tools.eval import harness as eval_harness

    calls = []
    monkeypatch.setattr(
        eval_harness,
        "apply_method",
        lambda target, method, ratio, options, steps=None: (
            calls.append(("apply", method)) or (lambda: calls.append(("remove", method)))
        ),
    )
    runs = [("none", 0.0), ("toma", 0.5), ("tomesd", 0.5)]
    batches = [["a", "b"], ["c", "d"], ["e"], ["f"]]
    current = []

    def generate(batch):
        current.append(calls[-1][1])
        return [f"{calls[-1][1]}:{x}" for x in batch]

    warmed = []
    out = eval_harness.generate_interleaved(object(), runs, batches, {}, generate, lambda: warmed.append(calls[-1][1]))
    # every batch runs every variant, patched just for it, in an order that rotates by one
    assert current == [
        "none",
        "toma",
        "tomesd",
        "toma",
        "tomesd",
        "none",
        "tomesd",
        "none",
        "toma",
        "none",
        "toma",
        "tomesd",
    ]
    assert calls[:4] == [("apply", "none"), ("remove", "none"), ("apply", "toma"), ("remove", "toma")]
    assert warmed == ["none", "toma", "tomesd"]  # once each, before its first batch
    images, seconds = out[("toma", 0.5)]
    assert images == [["toma:a", "toma:b"], ["toma:c", "toma:d"], ["toma:e"], ["toma:f"]]
    assert len(seconds) == 4 and all(t >= 0 for t in seconds)


def test_timing_spread_leaves_out_the_short_last_batch():
    from toma.tools.eval.harness import timing

    parts = [
        {"count": 5, "batch_seconds": [2.0, 3.0, 0.1], "batch_sizes": [2, 2, 1]},
        {"count": 2, "batch_seconds": [2.5], "batch_sizes": [2]},
    ]
    t = timing(parts)
    assert t["latency_s"] == pytest.approx(7.6 / 7)
    # per image: 1.0, 1.5, 1.25 from the full batches; median 1.25
    assert t["timed_batches"] == 3 and t["spread"] == pytest.approx(0.5 / 1.25)
    assert timing([{"count": 3, "batch_seconds": [1.0], "batch_sizes": [3]}])["spread"] is None


def test_speedups_that_the_spread_exceeds_are_flagged():
    from toma.tools.eval.harness import add_speedup

    def rows(spreads):
        return [
            {"method": "none", "ratio": 0.0, "latency_s": 1.0, "spread": spreads[0]},
            {"method": "toma", "ratio": 0.5, "latency_s": 0.8, "spread": spreads[1]},  # effect 20%
            {"method": "tomesd", "ratio": 0.5, "latency_s": 0.95, "spread": spreads[2]},
        ]  # effect 5%

    quiet = add_speedup(rows([0.02, 0.03, 0.01]))
    assert [r["flags"] for r in quiet] == [[], [], []]
    assert quiet[1]["speedup"] == pytest.approx(1.25)
    noisy = add_speedup(rows([0.1, 0.03, 0.01]))  # the reference's own spread counts too
    assert noisy[0]["flags"] == [] and noisy[1]["flags"] == []
    assert noisy[2]["flags"] == ["samples spread 10%, more than the 5% effect"]
    assert add_speedup(rows([None, 0.5, 0.5]))[1]["flags"] == []  # one batch: nothing to judge by


def test_fd_warning_below_100_images():
    from toma.tools.eval.harness import fd_warning

    assert fd_warning([{"n_images": 100, "fd_real": 1.0}]) is None
    assert "from 99 images" in fd_warning([{"n_images": 99, "fd_real": 1.0, "fd_vs_none": 0.0}])
    assert fd_warning([{"n_images": 10, "psnr": 20.0}]) is None  # no FD reported


# ---------------------------------------------------------------------------- plots


def eval_rows(ratios, methods=("toma", "toma-random", "toma-grid", "tomesd")):
    rows = [{"method": "none", "ratio": 0.0, "psnr": math.inf, "ssim": 1.0, "accuracy": 0.99, "speedup": 1.0}]
    for i, m in enumerate(methods):
        for r in ratios:
            # ToMA and its ablations land within a hair of each other, as they do on the built-in model
            rows.append(
                {
                    "method": m,
                    "ratio": r,
                    "psnr": 30 - 10 * r + 0.01 * i,
                    "ssim": 0.99 - 0.1 * r - 1e-4 * i,
                    "accuracy": 0.99,
                    "speedup": 1 + r + 0.001 * i,
                }
            )
    return rows


def test_eval_plot_ratio_labels_do_not_overlap(tmp_path):
    from toma.tools.eval.report import plot

    fig = plot(eval_rows([0.25, 0.5, 0.75]), tmp_path / "p.png", "t")
    assert (tmp_path / "p.png").is_file()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()  # closing the figure dropped its canvas
    for ax in fig.axes:
        notes = [t for t in ax.texts]
        assert len(notes) == 12  # 4 methods x 3 ratios
        boxes = [t.get_window_extent(renderer) for t in notes]
        clashes = [
            (a.get_text(), b.get_text())
            for i, (a, ba) in enumerate(zip(notes, boxes))
            for b, bb in zip(notes[i + 1 :], boxes[i + 1 :])
            if ba.overlaps(bb)
        ]
        assert not clashes


def test_eval_plot_with_one_ratio_names_it_once(tmp_path):
    from toma.tools.eval.report import plot

    fig = plot(eval_rows([0.5]), tmp_path / "p.png", "t")
    assert all(not ax.texts for ax in fig.axes)  # no "0.5" on every point
    assert fig._suptitle.get_text() == "t, ratio 0.5"
