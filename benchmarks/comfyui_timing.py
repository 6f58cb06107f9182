"""What the ComfyUI CPU benchmarks (``benchmarks/comfyui_*_cpu.py``) share: the vendored
ComfyUI's import, the methods' interleaved CPU-time rounds and the report's figures.

Not a benchmark itself; the scripts import it from their own folder.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


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


def interleaved(
    methods: dict[str, Callable[[], None]], rounds: int, before: Callable[[str], None] | None = None
) -> dict[str, list[float]]:
    """CPU seconds of this process for each method's call, after one warm-up call each:
    ``rounds`` rounds, each calling every method once, in order. ``before(name)``, where
    given, runs ahead of each call, untimed (loading that method's patcher, as sampling
    does once per run, not once per step)."""
    prepare = before or (lambda name: None)
    for name, call in methods.items():
        prepare(name)
        call()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(rounds):
        for name, call in methods.items():
            prepare(name)
            start = time.process_time()
            call()
            times[name].append(time.process_time() - start)
    return times


def figures(times: dict[str, list[float]]) -> dict:
    """The report's timing figures from ``times`` of ``none``, ``toma`` and ``ideal``: the
    samples, their medians, both speed-ups and ToMA's share of the ideal's saving."""
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
