"""Outputs of ``toma eval``: results.json, the markdown table, the quality-vs-speedup plot and samples."""

from __future__ import annotations

import argparse
import math
import os
import platform
from pathlib import Path
from typing import Any

import torch

from toma.tools.common.images import BUILTIN_UPSCALE, make_grid, side_by_side
from toma.tools.common.report import cell, processor_name, pyplot, save_figure, write_json, wrote
from toma.tools.eval.constants import METHODS
from toma.tools.eval.harness import Processes, fd_warning, key

# (row key, column heading, format) in table order; a table shows the keys its rows have
COLUMNS = [
    ("method", "method", "{}"),
    ("ratio", "ratio", "{:g}"),
    ("n_images", "images", "{}"),
    ("psnr", "PSNR vs unmerged (dB)", "{:.2f}"),
    ("psnr_sem", "± s.e.", "{:.2f}"),
    ("ssim", "SSIM vs unmerged", "{:.4f}"),
    ("ssim_sem", "± s.e.", "{:.4f}"),
    ("accuracy", "classifier acc.", "{:.3f}"),
    ("fd_real", "FD to real digits", "{:.2f}"),
    ("fd_vs_none", "FD to unmerged", "{:.2f}"),
    ("temporal_error", "temporal diff. error", "{:.4f}"),
    ("temporal_error_sem", "± s.e.", "{:.4f}"),
    ("clip_t", "CLIP-T", "{:.4f}"),
    ("dino_delta", "DINO delta", "{:.4f}"),
    ("fd_dino_reference", "FD (DINOv2) to reference", "{:.2f}"),
    ("latency_s", "latency (s/image)", "{:.3f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("spread", "time spread", "{:.0%}"),
    ("steps_skipped", "steps skipped", "{:.0%}"),
    ("skip_overlap", "skip overlap with cache alone", "{:.2f}"),
]
FD_COLUMNS = ("fd_real", "fd_vs_none", "fd_dino_reference")


def markdown_table(rows: list[dict[str, Any]], mark_fd: bool = False) -> str:
    """Rows as a markdown table with the columns present in the first row; ``mark_fd``
    puts a ``*`` on the Frechet distance headings (see :func:`notes`)."""
    cols = [c for c in COLUMNS if c[0] in rows[0]]
    heads = [c[1] + (" *" if mark_fd and c[0] in FD_COLUMNS else "") for c in cols]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(cell(row[c[0]], c[2], missing="n/a") for c in cols) + " |")
    return "\n".join(lines) + "\n"


def notes(rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """What the reader must know to trust the table: the machine's load, rows whose timing
    the noise decides, and Frechet distances from too few images."""
    machine = meta["machine"]
    out = []
    before, after = machine.get("load_average_before"), machine.get("load_average_after")
    if before and after:
        busy = max(before[0], after[0]) > (machine["cpu_count"] or 1)
        out.append(
            f"load average {before[0]:.2f} before and {after[0]:.2f} after the run (1 minute) "
            f"on {machine['cpu_count']} CPUs"
            + (", more than the CPUs: the timings shared them" if busy else "")
            + "; variants timed interleaved, batch by batch"
        )
    flagged = [r for r in rows if r.get("flags")]
    for r in flagged:
        out.append(f"UNRELIABLE timing of {key(r['method'], r['ratio'])}: " + "; ".join(r["flags"]))
    if flagged:
        threads = "" if machine.get("torch_threads") == 1 else "--threads 1, "
        out.append(
            f"the machine was too noisy for these speedups: more images (more timed batches), {threads}"
            "or a quiet machine help"
        )
    if rows and all(r.get("spread") is None for r in rows):
        out.append("one timed batch per variant: no spread to judge the timing by (--batch-size below --num-images)")
    warning = fd_warning(rows)
    if warning:
        out.append(f"* warning: {warning}")
    return out


# where a ratio label may go, in points from its point, in order of preference
LABEL_OFFSETS = [(4, 4), (4, -11), (-16, 4), (-16, -11), (4, 13), (-16, 13), (4, -20), (-16, -20), (12, -4), (-26, -4)]


def place_labels(fig: Any, ax: Any, labels: list[tuple[float, float, str, Any]]) -> list[Any]:
    """Annotate points ``(x, y, text, colour)`` so that no two labels overlap where there is room.

    Labels of methods that land on nearly the same point (ToMA and its ablations at one
    ratio) otherwise print on top of each other ("00.55"). Each label takes the first
    offset in ``LABEL_OFFSETS`` whose box clears the labels placed before it, measured with
    the figure's renderer after the final layout.
    """
    fig.tight_layout()  # the layout the figure is saved with, so the boxes measured hold
    renderer = fig.canvas.get_renderer()
    placed: list[Any] = []
    boxes: list[Any] = []
    for x, y, text, colour in labels:
        for dx, dy in LABEL_OFFSETS:
            note = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=7, color=colour)
            note.set_in_layout(False)  # so saving's tight_layout keeps the layout measured here
            box = note.get_window_extent(renderer)
            if not any(box.overlaps(b) for b in boxes):
                break
            note.remove()
        else:
            note = ax.annotate(
                text, (x, y), textcoords="offset points", xytext=LABEL_OFFSETS[0], fontsize=7, color=colour
            )
            note.set_in_layout(False)
            box = note.get_window_extent(renderer)
        placed.append(note)
        boxes.append(box)
    return placed


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Any:
    """Quality (PSNR, SSIM, and accuracy when present) against speedup, one series per method.

    With several ratios each point is labelled with its ratio; with one, the title says it.
    Returns the figure (closed, already saved).
    """
    plt = pyplot()
    panels = [("psnr", "PSNR vs unmerged (dB)"), ("ssim", "SSIM vs unmerged")]
    if "accuracy" in rows[0]:
        panels.append(("accuracy", "classifier accuracy"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    colours = plt.get_cmap("tab10")
    ratios = sorted({r["ratio"] for r in rows if r["method"] != "none"})
    labels: dict[Any, list[tuple[float, float, str, Any]]] = {}
    for ax, (metric, label) in zip(axes[0], panels):
        for method in methods:
            pts = sorted((r["speedup"], r[metric], r["ratio"]) for r in rows if r["method"] == method)
            finite = [(x, y, rt) for x, y, rt in pts if math.isfinite(y)]
            if not finite:
                continue  # the unmerged reference has infinite PSNR
            # fixed colour per method so the panels agree
            style = (
                {"color": "black", "marker": "*", "markersize": 10}
                if method == "none"
                else {"color": colours(_colour_index(method, methods)), "marker": "s" if "+" in method else "o"}
            )
            ax.plot([p[0] for p in finite], [p[1] for p in finite], label=method, **style)
            if method != "none" and len(ratios) > 1:
                labels.setdefault(ax, []).extend((x, y, f"{rt:g}", style["color"]) for x, y, rt in finite)
        ax.set_xlabel("speedup over unmerged (x)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title if len(ratios) != 1 else f"{title}, ratio {ratios[0]:g}")
    for ax, points in labels.items():
        place_labels(fig, ax, points)
    save_figure(fig, path)
    return fig


def _colour_index(method: str, methods: list[str]) -> int:
    """A merging method keeps its colour from run to run; a cached variant (``toma+fbcache``)
    takes the next free one after them, in the order given."""
    if method in METHODS:
        return METHODS.index(method)
    return (len(METHODS) + [m for m in methods if m not in METHODS].index(method)) % 10


def write_samples(gathered: list[dict[str, Any]], runs: list[tuple[str, float]], path: Path, upscale: int) -> None:
    """One row of preview images per variant (from the main process's share)."""

    panels = []
    for method, ratio in runs:
        preview = gathered[0][key(method, ratio)]["preview"]
        if preview:
            images = torch.tensor(preview)
            panels.append((f"{method} {ratio:g}", make_grid(images, ncols=min(len(images), 10), upscale=upscale)))
    if not panels:
        return
    from PIL import Image

    width = max(img.width for _, img in panels) + 20
    rows = [side_by_side([p]) for p in panels]
    sheet = Image.new("RGB", (width, sum(r.height for r in rows)), "white")
    y = 0
    for r in rows:
        sheet.paste(r, (0, y))
        y += r.height
    sheet.save(path)


def machine_info(procs: Processes) -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "platform": platform.platform(),
        "processor": processor_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "processes": procs.world,
    }


def write_outputs(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    meta: dict[str, Any],
    gathered: list[dict[str, Any]],
    runs: list[tuple[str, float]],
) -> None:
    """Write results.json, results.md, the plot and the samples sheet."""
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    warning = fd_warning(rows)
    lines = notes(rows, meta)
    write_json(out / "results.json", {**meta, "fd_reliable": warning is None, "notes": lines, "results": rows})
    table = markdown_table(rows, mark_fd=warning is not None)
    header = (
        f"# toma eval: {meta['model']}\n\n{meta['num_images']} images per variant, {meta['steps']} steps, "
        f"seeds {meta['seed']}..{meta['seed'] + meta['num_images'] - 1}; {meta['machine']['processes']} process(es), "
        f"torch {meta['machine']['torch']}, {meta['machine']['torch_threads']} thread(s) each.\n\n"
    )
    footer = "".join(f"\n{line}\n" for line in lines)
    (out / "results.md").write_text(header + table + footer, encoding="utf-8")
    plot(rows, out / "quality_vs_speedup.png", f"{meta['model']}: quality vs speedup")
    write_samples(gathered, runs, out / "samples.png", BUILTIN_UPSCALE if args.model is None else 1)
    print(table)
    for line in lines:
        print(line)
    print(wrote(out / name for name in ("results.json", "results.md", "quality_vs_speedup.png", "samples.png")))
