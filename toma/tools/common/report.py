"""Reporting pieces shared by ``toma bench`` and ``toma eval``: table cells, JSON and plots.

Each command keeps its own tables and figures (:mod:`toma.tools.bench.report`,
:mod:`toma.tools.eval.report`); what they do alike lives here, also the rule that flags
timings too noisy to trust.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
from pathlib import Path
from typing import Any, Iterable


def cell(value: Any, fmt: str = "{}", missing: str = "-") -> str:
    """``fmt.format(value)`` for a table cell, or ``missing`` for None or NaN.

    Both stand for a value that was not measured or is not defined (a speedup without an
    unpatched row, the PSNR of an empty set), which a number would misreport.
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return fmt.format(value)


def json_safe(obj: Any) -> Any:
    """``obj`` with non-finite floats replaced by ``None``."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON to ``path``; returns ``path``.

    JSON has no inf or NaN (``json`` would write invalid tokens), so non-finite floats
    become null: the unmerged reference's PSNR, for one, is infinite.
    """
    path.write_text(json.dumps(json_safe(obj), indent=2) + "\n", encoding="utf-8")
    return path


def wrote(paths: Iterable[Path]) -> str:
    """The ``wrote a, b, ...`` line that closes a command's output."""
    return "wrote " + ", ".join(str(p) for p in paths)


def processor_name() -> str:
    """The CPU's name where the platform reports one, else the machine type."""
    return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages, or None where the platform has none.

    Load above the CPU count means the timed runs shared the cores with other work.
    """
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def load_note() -> str:
    """One line on the machine's load and torch's threads, to print beside a timing: a
    speedup measured while other work shares the cores can be anything (``""`` where the
    platform has no load average)."""
    import torch

    load, cpus = load_average(), os.cpu_count() or 1
    if load is None:
        return ""
    busy = ", more than the CPUs: other work shared them, so the timings are unreliable" if load[0] > cpus else ""
    return (
        f"machine: load average {load[0]:.2f} (1 minute) on {cpus} CPUs{busy}; torch threads {torch.get_num_threads()}"
    )


def missing_extra(module: str, extra: str, what: str) -> str | None:
    """A one-line message if the optional ``module`` is not installed, naming the extra that
    brings it (``pip install 'toma-diffusion[extra]'``); None when it is there."""
    if importlib.util.find_spec(module) is not None:
        return None
    return f"{what} needs {module}, which is not installed: pip install 'toma-diffusion[{extra}]'"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, which draws to files without a display.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Lay out, save as PNG and close ``fig`` (an open figure holds its memory until closed)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")


def check_output(path: Path, option: str, *, folder: bool, suffixes: tuple[str, ...] = ()) -> None:
    """Make sure results can be written to ``path`` before any work starts.

    Creates the folder (``path`` itself, or its parent for a file) and checks that it is
    writable; for a file, that its suffix is one of ``suffixes``.

    Raises:
        ValueError: naming ``option``, when the path cannot take the results.
    """
    if not folder and suffixes and path.suffix.lower() not in suffixes:
        raise ValueError(f"{option} must end in one of {', '.join(suffixes)}; got {str(path)!r}")
    if not folder and path.is_dir():
        raise ValueError(f"{option} names a folder, not a file: {str(path)!r}")
    target = path if folder else path.parent
    try:
        target.mkdir(parents=True, exist_ok=True)
        probe = target / f".toma-write-check-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise ValueError(f"{option}: cannot write to {str(target)!r} ({err.strerror or err})") from None


def timing_flags(r: dict[str, Any], base: dict[str, Any] | None) -> list[str]:
    """Why a row's figures cannot be trusted: samples that spread by more than the effect
    they measure (against the unpatched row's own spread too), or an efficiency above 100%
    (the ideal is the ceiling, so that is noise).

    ``r`` and ``base`` (the unpatched row) hold ``spread``, (max - min) / median of their
    samples; ``r`` holds ``speedup`` (base time / time) and may hold ``efficiency``. Shared
    by ``toma bench`` and ``toma eval``.
    """
    flags = []
    if base is not None and r is not base and r.get("speedup"):
        effect = abs(1 - 1 / r["speedup"])
        if max(r["spread"], base["spread"]) > effect:
            flags.append(f"samples spread {max(r['spread'], base['spread']):.0%}, more than the {effect:.0%} effect")
    if r.get("efficiency") is not None and r["efficiency"] > 1.0:
        flags.append(f"efficiency {r['efficiency']:.0%} is above the ideal's 100%")
    return flags
