"""``toma eval`` and ``toma generate`` on the built-in moving-digits video DiT (shipped weights)."""

from __future__ import annotations

import json

import pytest
import torch

from toma.tools.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_eval_builtin_video_scores_frames_and_motion(tmp_path):
    out = tmp_path / "ev"
    code = main(
        [
            "eval",
            "--model",
            "builtin-video",
            "--methods",
            "toma,toma-grid",
            "--num-images",
            "2",
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--threads",
            "1",
            "--out-dir",
            str(out),
        ]
    )
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in data["results"]}
    assert list(rows) == ["none", "toma", "toma-grid"]
    none, merged = rows["none"], rows["toma"]
    # the unmerged clips against themselves: no change of motion; merged clips move differently
    assert none["temporal_error"] == 0 and none["psnr"] is None
    assert merged["temporal_error"] > 0 and 0 < merged["psnr"] < 99
    for row in rows.values():
        assert row["n_images"] == 2 and 0 <= row["accuracy"] <= 1
        assert "fd_real" not in row  # no statistics of real clips
    assert "temporal diff. error" in (out / "results.md").read_text()
    assert (out / "samples.png").is_file()


def test_eval_builtin_video_accuracy_is_per_frame(monkeypatch, tmp_path):
    # a classifier that gets frame 0 of every clip right and every other frame wrong scores 1/8
    from toma.tools.builtin import video

    def one_right_frame(classifier, clips):
        b, t = clips.shape[:2]
        preds = torch.full((b, t), -1, dtype=torch.long)
        preds[:, 0] = torch.tensor(one_right_frame.labels[:b])
        return preds, torch.randn(b, t, 64, generator=torch.Generator().manual_seed(0))

    one_right_frame.labels = [0, 1]  # eval draws classes 0, 1, ... in order
    monkeypatch.setattr(video, "classify_frames", one_right_frame)
    out = tmp_path / "ev"
    assert (
        main(
            [
                "eval",
                "--model",
                "builtin-video",
                "--methods",
                "toma",
                "--num-images",
                "2",
                "--steps",
                "1",
                "--threads",
                "1",
                "--out-dir",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads((out / "results.json").read_text())["results"]
    assert [r["accuracy"] for r in rows] == [1 / video.FRAMES] * 2


@pytest.mark.parametrize("suffix", [".gif", ".png"])
def test_generate_builtin_video(tmp_path, suffix):
    from PIL import Image

    from toma.tools.builtin.video import FRAME_SIZE, FRAMES

    out = tmp_path / f"clips{suffix}"
    assert (
        main(
            ["generate", "--model", "builtin-video", "--labels", "3,7", "--steps", "2", "--compare", "--out", str(out)]
        )
        == 0
    )
    with Image.open(out) as im:
        if suffix == ".gif":  # every frame holds both clips of both runs
            assert im.n_frames == FRAMES and im.width > 2 * 2 * FRAME_SIZE
        else:  # one row of frames per clip, per run
            assert im.width > FRAMES * FRAME_SIZE and im.height > 2 * 2 * FRAME_SIZE
