"""What the ComfyUI benchmarks (``benchmarks/comfyui_*.py``) share: finding ComfyUI, the run
through ``toma bench --host comfyui``'s implementation (:mod:`toma.tools.bench.comfyui`) at one
thread on CPU time, and the figures of the scripts' own JSON reports; for the script that
builds its models itself (the bitwise check), ComfyUI imported as the tests import it.

Not a benchmark itself; the scripts import it from their own folder.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run(arch: str, resolution: int, ratio: float, rounds: int, **options: Any) -> dict:
    """``toma bench --host comfyui --arch <arch> --clock cpu --threads 1 --no-profile`` with one
    warm-up and ``rounds`` interleaved rounds, the ComfyUI of ``$TOMA_COMFYUI`` or
    ``../shared/vendor/ComfyUI``; returns the bench's report. ``options`` go to
    :func:`toma.tools.bench.comfyui.benchmark_comfyui`."""
    import torch

    from toma.tools.bench.comfyui import benchmark_comfyui, locate_comfyui

    torch.set_num_threads(1)
    locate_comfyui(os.environ.get("TOMA_COMFYUI") or str(REPO.parent / "shared" / "vendor" / "ComfyUI"))
    return benchmark_comfyui(
        arch, resolution, ratios=[ratio], repeats=rounds, warmup=1, clock="cpu", profile=False, **options
    )


def rows(report: dict) -> dict[str, dict]:
    """The bench report's rows by method (one ratio, one batch)."""
    return {r["method"]: r for r in report["results"]}


def import_comfyui() -> ModuleType:
    """Import the vendored ComfyUI as the tests do (``tests/comfyui/tiny_comfy.py``;
    ``$TOMA_COMFYUI`` or ``../shared/vendor/ComfyUI``), its writable folders in a temporary
    one; returns the ``tiny_comfy`` helpers."""
    helpers = str(REPO / "tests" / "comfyui")
    if helpers not in sys.path:
        sys.path.insert(0, helpers)
    import tiny_comfy

    root = Path(os.environ.get("TOMA_COMFYUI") or REPO.parent / "shared" / "vendor" / "ComfyUI")
    tiny_comfy.import_comfyui(root, Path(tempfile.mkdtemp()))
    return tiny_comfy


def figures(report: dict) -> dict:
    """The scripts' timing figures from the bench ``report`` of ``none``, ``toma`` and ``ideal``:
    the samples, their medians, both speed-ups and ToMA's share of the ideal's saving."""
    times = {name: row["times_s"] for name, row in rows(report).items()}
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "cpu_seconds": times,
        "median_cpu_seconds": med,
        "speedup_toma": med["none"] / med["toma"],
        "speedup_ideal": med["none"] / med["ideal"],
        "efficiency": (med["none"] - med["toma"]) / (med["none"] - med["ideal"]),
    }


def emit(report: dict, out: Path | None) -> None:
    """Print ``report`` as JSON, and write it to ``out`` too where given."""
    text = json.dumps(report, indent=1)
    print(text)
    if out is not None:
        out.write_text(text + "\n")
