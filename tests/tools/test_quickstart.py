"""The README's quick start runs as written, and the built-in pipelines it uses work.

Every ``python`` and ``bash`` block of the README's "Quick start" section runs here, on the
offline built-in models; a block preceded by ``<!-- quickstart: skip (why) -->`` (a GPU, a
download) is skipped with that reason. Shell lines are ``toma`` commands, run in-process,
except in the block marked ``<!-- quickstart: comfyui -->``: there ``/path/to/toma-checkout``
is this checkout and ``/path/to/ComfyUI`` a temporary folder, pip runs as a dry run (this
Python has toma already; pip still reads the checkout as the package it would install), the
other lines run as written, and then the vendored ComfyUI scans that folder's
``custom_nodes/`` as it does at start-up (``nodes.init_external_custom_nodes``) and must find
the node. ComfyUI is imported as tests/comfyui/conftest.py imports it (once per run: this
reuses it), through its helpers module ``tiny_comfy``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import toma
from toma.tools.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
SKIP = re.compile(r"<!-- quickstart: skip \((?P<why>[^)]+)\) -->")
COMFYUI = "<!-- quickstart: comfyui -->"
CHECKOUT, COMFYUI_HOME = "/path/to/toma-checkout", "/path/to/ComfyUI"


def quickstart_blocks() -> list[tuple[str, str, str | None]]:
    """``(language, code, skip reason)`` of each fenced block in the README's quick start."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for match in re.finditer(r"(?:(?P<marker><!--[^\n]*-->)\n)?```(?P<lang>\w+)\n(?P<code>.*?)```", section, re.S):
        marker = match.group("marker")
        skip = SKIP.fullmatch(marker) if marker else None
        if marker and skip is None and marker != COMFYUI:
            raise ValueError(f"README quick start: unknown marker {marker!r}")
        lang = "comfyui" if marker == COMFYUI else match.group("lang")
        blocks.append((lang, match.group("code"), skip.group("why") if skip else None))
    return blocks


BLOCKS = quickstart_blocks()


def test_the_quick_start_always_runs_python_and_the_command_line():
    runnable = {lang for lang, _, skip in BLOCKS if skip is None}
    assert {"python", "bash", "comfyui"} <= runnable


@pytest.mark.parametrize(
    "index",
    # the ComfyUI block with the ComfyUI tests, on one xdist worker: ComfyUI is imported once
    [
        pytest.param(i, marks=[pytest.mark.xdist_group("comfyui")] if lang == "comfyui" else [])
        for i, (lang, _, _) in enumerate(BLOCKS)
    ],
    ids=[f"{lang}-{i}" for i, (lang, _, _) in enumerate(BLOCKS)],
)
def test_readme_quick_start_block_runs(index, tmp_path, monkeypatch, one_thread):
    lang, code, skip = BLOCKS[index]
    if skip is not None:
        pytest.skip(skip)
    monkeypatch.chdir(tmp_path)
    if lang == "comfyui":
        run_comfyui_block(code, tmp_path, monkeypatch)
        return
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


def vendored_comfyui(base: Path):
    """The vendored ComfyUI, imported as tests/comfyui/conftest.py imports it (the same
    ``tiny_comfy`` module, so the same stand-ins and one import per run); a skip where it or
    a dependency is missing, a failure in CI."""
    root = Path(os.environ.get("TOMA_COMFYUI") or ROOT.parent / "shared" / "vendor" / "ComfyUI")
    missing = [n for n in ("comfy_aimdo", "comfy_kitchen", "einops", "torchsde") if importlib.util.find_spec(n) is None]
    if not (root / "comfy" / "model_patcher.py").is_file() or missing:
        reason = f"the vendored ComfyUI is not at {root}" if not missing else f"ComfyUI needs {', '.join(missing)}"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the README's ComfyUI quick start: {reason}")
        pytest.skip(reason)
    helpers = str(ROOT / "tests" / "comfyui")
    if helpers not in sys.path:
        sys.path.insert(0, helpers)
    import tiny_comfy

    return tiny_comfy, tiny_comfy.import_comfyui(root, base)


def run_comfyui_block(code: str, tmp_path: Path, monkeypatch) -> None:
    """The README's ComfyUI block against a temporary ComfyUI folder, then ComfyUI's own scan
    of its ``custom_nodes/`` (see the module docstring)."""
    home = tmp_path / "ComfyUI"
    (home / "custom_nodes").mkdir(parents=True)
    commands = 0
    for line in code.splitlines():
        line = line.split("  #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        argv = shlex.split(line.replace(CHECKOUT, str(ROOT)).replace(COMFYUI_HOME, str(home)))
        if argv[:4] == ["python", "-m", "pip", "install"]:
            report = tmp_path / "pip.json"
            # with the interpreter's setuptools where it has one: no download of a build backend
            isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
            extra = ["--dry-run", "--quiet", "--report", str(report), *isolation]
            run = subprocess.run([sys.executable, *argv[1:], *extra], capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, run.stderr[-2000:]
            names = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
            assert names == ["toma-diffusion"], names
        else:
            assert argv[0] == "ln", f"the ComfyUI quick start runs pip and ln only; got {line!r}"
            subprocess.run(argv, check=True, timeout=30)
        commands += 1
    assert commands == 2
    helpers, comfy = vendored_comfyui(tmp_path / "base")
    nodes = comfy.nodes
    saved = dict(nodes.NODE_CLASS_MAPPINGS), dict(nodes.NODE_DISPLAY_NAME_MAPPINGS)
    scanned = ([str(home / "custom_nodes")], set())
    monkeypatch.setitem(comfy.folder_paths.folder_names_and_paths, "custom_nodes", scanned)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scan puts ComfyUI's comfy/ first on it
    try:
        nodes.NODE_CLASS_MAPPINGS.pop("ToMAModel", None)
        asyncio.run(nodes.init_external_custom_nodes())
        from toma.comfyui.node import ToMAModel

        assert nodes.NODE_CLASS_MAPPINGS.get("ToMAModel") is ToMAModel
        assert nodes.NODE_DISPLAY_NAME_MAPPINGS["ToMAModel"] == "ToMA Token Merging"
    finally:
        for mapping, before in zip((nodes.NODE_CLASS_MAPPINGS, nodes.NODE_DISPLAY_NAME_MAPPINGS), saved):
            mapping.clear()
            mapping.update(before)
        helpers.stubs_off()  # later tests find no torchvision stand-in and none of ComfyUI's names


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
