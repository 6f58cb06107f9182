"""The README's quick start runs as written, and the built-in pipelines it uses work.

Every ``python`` and ``bash`` block of the README's "Quick start" section runs here, on the
offline built-in models; a block preceded by ``<!-- quickstart: skip (why) -->`` (a GPU, a
download) is skipped with that reason. Shell lines are ``toma`` commands, run in-process.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

import toma
from toma.tools.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
SKIP = re.compile(r"<!-- quickstart: skip \((?P<why>[^)]+)\) -->")


def quickstart_blocks() -> list[tuple[str, str, str | None]]:
    """``(language, code, skip reason)`` of each fenced block in the README's quick start."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for match in re.finditer(r"(?:(?P<marker><!--[^\n]*-->)\n)?```(?P<lang>\w+)\n(?P<code>.*?)```", section, re.S):
        marker = match.group("marker")
        skip = SKIP.fullmatch(marker) if marker else None
        if marker and skip is None:
            raise ValueError(f"README quick start: unknown marker {marker!r}")
        blocks.append((match.group("lang"), match.group("code"), skip.group("why") if skip else None))
    return blocks


BLOCKS = quickstart_blocks()


def test_the_quick_start_always_runs_python_and_the_command_line():
    runnable = {lang for lang, _, skip in BLOCKS if skip is None}
    assert {"python", "bash"} <= runnable


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"{lang}-{i}" for i, (lang, _, _) in enumerate(BLOCKS)])
def test_readme_quick_start_block_runs(index, tmp_path, monkeypatch, one_thread):
    lang, code, skip = BLOCKS[index]
    if skip is not None:
        pytest.skip(skip)
    monkeypatch.chdir(tmp_path)
    if lang == "python":
        namespace: dict = {"__name__": "__quickstart__"}
        exec(compile(code, f"README.md quick start block {index}", "exec"), namespace)
        pipe = namespace.get("pipe")
        assert pipe is None or toma.get_toma(pipe) is None  # the block ends with remove_toma
        return
    assert lang == "bash", f"a {lang} block in the quick start: mark it or make it python/bash"
    for line in code.splitlines():
        line = line.split("  #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        argv = shlex.split(line)
        assert argv[0] == "toma", f"quick start shell lines are toma commands; got {line!r}"
        assert cli(argv[1:]) == 0, line
        if "--out" in argv:
            assert (tmp_path / argv[argv.index("--out") + 1]).stat().st_size > 0


def _pixels(images) -> list[np.ndarray]:
    return [np.asarray(image) for image in images]


def test_builtin_unet_pipeline_merges_and_undoes_exactly(one_thread):
    pipe = toma.builtin.pipeline("builtin-unet")
    assert type(pipe.unet).__name__ == "UNet2DConditionModel"
    before = _pixels(pipe(labels=[3, 7], num_inference_steps=3).images)
    patch = toma.apply_toma(pipe, ratio=0.5)
    assert patch.patched  # something merges
    merged = _pixels(pipe(labels=[3, 7], num_inference_steps=3).images)
    toma.remove_toma(pipe)
    after = _pixels(pipe(labels=[3, 7], num_inference_steps=3).images)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert any(not np.array_equal(a, b) for a, b in zip(before, merged))  # merging reached the draw
    assert before[0].shape == (32, 32) and before[0].dtype == np.uint8


@pytest.mark.parametrize("name", ["builtin-dit", "builtin-video"])
def test_builtin_transformer_pipelines_draw_merged(name, one_thread):
    pipe = toma.builtin.pipeline(name)
    assert isinstance(pipe.transformer, torch.nn.Module)
    toma.apply_toma(pipe, ratio=0.5)
    images = pipe(labels=[1], num_inference_steps=1).images
    toma.remove_toma(pipe)
    first = images[0][0] if name == "builtin-video" else images[0]
    assert len(images) == 1 and np.asarray(first).ndim == 2 and np.asarray(first).std() > 0


def test_builtin_pipeline_refuses_bad_names_and_inputs():
    with pytest.raises(ValueError, match="name must be one of 'builtin-unet'"):
        toma.builtin.pipeline("builtin-sdxl")
    pipe = toma.builtin.pipeline()
    with pytest.raises(ValueError, match="labels must be digit classes in 0..9"):
        pipe(labels=[10])
    with pytest.raises(ValueError, match="num_inference_steps must be a whole number >= 1"):
        pipe(labels=[1], num_inference_steps=0)
