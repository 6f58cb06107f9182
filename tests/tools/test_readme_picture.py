"""The README's picture (``scripts/readme_picture.py``): its pieces on tiny inputs, its reader
on the committed eval results, and the README showing the file the script writes.

The full picture (three models sampled, ~1.5 min) is not redrawn here.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module("readme_picture")
    finally:
        sys.path.pop(0)


def test_compose_puts_each_image_in_its_cell_with_background_between(script):
    a, b, c = (np.full((2, 3), value, dtype=np.float32) for value in (0.1, 0.2, 0.3))
    sheet = script.compose([[a, b], [c]], pad=1, background=1.0)
    assert sheet.shape == (2 * 2 + 1, 2 * 3 + 1)
    np.testing.assert_array_equal(sheet[0:2, 0:3], a)
    np.testing.assert_array_equal(sheet[0:2, 4:7], b)
    np.testing.assert_array_equal(sheet[3:5, 0:3], c)
    # the padding row and column, and the cell the short row leaves, are background
    assert (sheet[2, :] == 1.0).all() and (sheet[:, 3] == 1.0).all() and (sheet[3:5, 4:7] == 1.0).all()
    with pytest.raises(ValueError, match="rows must hold 2-D images of one shape"):
        script.compose([[a, np.zeros((3, 3))]])
    with pytest.raises(ValueError, match="rows must hold at least one image"):
        script.compose([[]])


def test_panel_rows_put_unmerged_over_merged(script):
    images = [np.zeros((4, 4)), np.ones((4, 4))]
    rows, labels = script.panel_rows(images, [i + 0.5 for i in images])
    assert len(rows) == 2 and labels == ["unmerged", "ToMA 0.5"]
    assert rows[1][1][0, 0] == 1.5
    # one clip: its frames make the two rows
    clip = np.arange(3, dtype=np.float32)[:, None, None] * np.ones((3, 4, 4), dtype=np.float32)
    rows, labels = script.panel_rows([clip], [clip + 0.5])
    assert labels == ["unmerged", "ToMA 0.5"] and [len(row) for row in rows] == [3, 3]
    assert [frame[0, 0] for frame in rows[1]] == [0.5, 1.5, 2.5]
    clips = [np.zeros((3, 4, 4)), np.ones((3, 4, 4))]
    rows, labels = script.panel_rows(clips, [c + 0.5 for c in clips])
    assert labels == ["clip 1: unmerged", "clip 1: ToMA 0.5", "clip 2: unmerged", "clip 2: ToMA 0.5"]
    assert [len(row) for row in rows] == [3, 3, 3, 3]  # a frame per column
    assert rows[2][0][0, 0] == 1.0 and rows[3][2][0, 0] == 1.5


def test_read_points_takes_the_merging_rows_of_the_committed_results(script):
    for name, _, path, _ in script.MODELS:
        rows = json.loads((ROOT / path).read_text(encoding="utf-8"))["results"]
        unmerged = next(r for r in rows if r["method"] == "none")
        points = script.read_points(ROOT / path)
        wanted = [r for r in rows if r["method"] != "none" and "+" not in r["method"] and r["ratio"] == 0.5]
        assert [p.method for p in points] == [r["method"] for r in wanted], name
        for p, row in zip(points, wanted):
            assert (p.speedup, p.psnr, p.psnr_sem, p.accuracy) == (
                row["speedup"],
                row["psnr"],
                row["psnr_sem"],
                row["accuracy"],
            )
            assert p.unmerged_accuracy == unmerged["accuracy"]
    # the step caches stacked on ToMA stay out of the picture
    dit = script.read_points(ROOT / script.MODELS[1][2])
    assert [p.method for p in dit] == ["toma"]


def test_read_points_names_the_file_it_cannot_use(script, tmp_path):
    bad = tmp_path / "results.json"
    bad.write_text(json.dumps({"rows": []}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"results\.json: no 'results' list"):
        script.read_points(bad)
    bad.write_text(json.dumps({"results": [{"method": "toma", "ratio": 0.5}]}), encoding="utf-8")
    with pytest.raises(ValueError, match="no 'none' row"):
        script.read_points(bad)
    none = {"method": "none", "ratio": 0.0, "speedup": 1.0, "psnr": None, "psnr_sem": None, "accuracy": 0.9}
    bad.write_text(json.dumps({"results": [none]}), encoding="utf-8")
    with pytest.raises(ValueError, match="no 'toma' row at ratio 0.5"):
        script.read_points(bad)


def test_draw_picture_writes_a_png_of_small_samples(script, tmp_path):
    rng = np.random.default_rng(0)
    images = [rng.random((8, 8), dtype=np.float32) for _ in range(3)]
    clips = [rng.random((4, 6, 6), dtype=np.float32)]
    samples = {"builtin-unet": (images, images), "builtin-video": (clips, clips)}
    points = {name: script.read_points(ROOT / path) for name, _, path, _ in script.MODELS}
    out = tmp_path / "picture.png"
    script.draw_picture(samples, points, out, caption="tiny")
    from PIL import Image

    with Image.open(out) as picture:
        assert picture.format == "PNG" and picture.size == (1200, 540)


def test_readme_shows_the_picture_the_script_writes(script):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## What it looks like\n", 1)[1].split("\n## ", 1)[0]
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", section)
    assert images == [str(script.OUT.relative_to(ROOT))]
    assert "python scripts/readme_picture.py" in section
    assert script.OUT.is_file() and script.OUT.stat().st_size < 250_000
