"""Draw the README's picture: the three built-in models' samples, unmerged beside ToMA, and quality against speed.

    python scripts/readme_picture.py          # writes benchmarks/results/builtin/readme.png

**Samples** (drawn here: 133 s on 1 thread of a shared 2-core CPU VM at load 2): each
built-in model, loaded by ``toma.builtin.pipeline(name)`` (no download), draws the first
images of its eval run (labels 0, 1, ..., seeds 0, 1, ..., 20 steps, the model's own
guidance) unmerged, then with ``toma.apply_toma(pipe, ratio=0.5)`` (the defaults), then
``toma.remove_toma(pipe)`` restores it. Seeded: a rerun writes the same bytes with the same
torch build. The video model shows its first clip (label 0), all 8 frames.

**Quality against speed** (not timed here: read from the committed ``toma eval`` results,
one protocol for all three: ratio 0.5, 20 steps, 1 CPU thread, variants timed interleaved
batch by batch, speedup = mean time per image against ``none``'s in the same run):

- digits UNet, 200 images (60a5a9c): ``benchmarks/results/builtin/ratio05/results.json``,
  ``toma eval --methods none,toma,toma-random,toma-grid,tomesd --ratios 0.5 --num-images 200
  --steps 20 --threads 1``;
- digits DiT (Flux), 100 images (2326d1e): the ``none`` and ``toma`` rows of
  ``benchmarks/results/cpu/cache_stack_builtin_dit/results.json``, ``TOMA_FLAGS="--tile-size 2
  --proportional-attention" FB="0.1 0.2" DB="0.12 0.24" MODELS=builtin-dit N=100
  benchmarks/cache_stack.sh`` (those flags are what the defaults compute on this grid);
- moving-digits video DiT (Wan), 100 clips (4b03ad7): the same rows of
  ``benchmarks/results/cpu/cache_stack_builtin_video/results.json``, ``TOMA_FLAGS="--tile-size
  2 --proportional-attention" FB="0.1 0.2 0.3" DB="0.24 0.6" MODELS=builtin-video N=100
  BATCH=10 benchmarks/cache_stack.sh``.

The DiT and video runs shared the 2-core machine with other jobs and ``toma eval`` flags their
timings as noisy (batch spreads above the effect): their speedups are rough
(benchmarks/builtin.md, "ToMA with step caches"). Quality and accuracy do not depend on the
machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "builtin" / "readme.png"
RATIO = 0.5
STEPS = 20

# --model name, title in the picture, committed eval results, labels drawn (one image or clip each)
MODELS: tuple[tuple[str, str, str, tuple[int, ...]], ...] = (
    ("builtin-unet", "digits UNet (SD-style)", "benchmarks/results/builtin/ratio05/results.json", tuple(range(5))),
    (
        "builtin-dit",
        "digits DiT (Flux-style)",
        "benchmarks/results/cpu/cache_stack_builtin_dit/results.json",
        tuple(range(5)),
    ),
    (
        "builtin-video",
        "moving digits, video DiT (Wan-style)",
        "benchmarks/results/cpu/cache_stack_builtin_video/results.json",
        (0,),
    ),
)
CAPTION = (
    "Samples: python scripts/readme_picture.py (labels 0.., seeds 0.., 20 steps; toma.apply_toma(pipe, ratio=0.5)). "
    "Plot: toma eval at ratio 0.5, 20 steps, 1 CPU thread (2-core VM), from\n"
    "benchmarks/results/builtin/ratio05 (UNet, 200 images) and benchmarks/results/cpu/cache_stack_builtin_{dit,video} "
    "(100 each). DiT and video timings: rough (busy machine). Accuracy: the digit classifier's (per frame for video)."
)


@dataclass(frozen=True)
class Point:
    """One merged variant of an eval run: its speed and its quality against the unmerged images."""

    method: str
    speedup: float
    psnr: float
    psnr_sem: float
    accuracy: float
    unmerged_accuracy: float


def read_points(path: Path, ratio: float = RATIO) -> list[Point]:
    """The merging methods (step caches left out) at ``ratio`` in a ``toma eval`` ``results.json``.

    Raises:
        ValueError: naming the file, when it holds no ``results`` list, no ``none`` row (the
            unmerged reference) or no ``toma`` row at ``ratio``.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    rows = data.get("results") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: no 'results' list; expected a results.json written by `toma eval`")
    unmerged = [row for row in rows if row.get("method") == "none"]
    if not unmerged:
        raise ValueError(f"{path}: no 'none' row (the unmerged reference the speedups are against)")
    points = [
        Point(
            method=row["method"],
            speedup=float(row["speedup"]),
            psnr=float(row["psnr"]),
            psnr_sem=float(row["psnr_sem"]),
            accuracy=float(row["accuracy"]),
            unmerged_accuracy=float(unmerged[0]["accuracy"]),
        )
        for row in rows
        # "+" marks a step cache stacked on a method (toma+fbcache:0.1): not merging alone
        if row.get("method") != "none" and "+" not in str(row.get("method")) and row.get("ratio") == ratio
    ]
    if not any(point.method == "toma" for point in points):
        raise ValueError(f"{path}: no 'toma' row at ratio {ratio:g}")
    return points


def compose(rows: Sequence[Sequence[np.ndarray]], pad: int = 2, background: float = 1.0) -> np.ndarray:
    """Tile 2-D images of one shape into one array: ``rows[r][c]`` at row ``r``, column ``c``,
    ``pad`` pixels of ``background`` between neighbours; a short row leaves background.

    Raises:
        ValueError: when ``rows`` is empty or its images are not all 2-D of one shape.
    """
    images = [np.asarray(image) for row in rows for image in row]
    if not images:
        raise ValueError("rows must hold at least one image")
    shape = images[0].shape
    if len(shape) != 2 or any(image.shape != shape for image in images):
        raise ValueError(f"rows must hold 2-D images of one shape; got shapes {sorted({i.shape for i in images})}")
    h, w = shape
    cols = max(len(row) for row in rows)
    sheet = np.full((len(rows) * (h + pad) - pad, cols * (w + pad) - pad), background, dtype=np.float32)
    for r, row in enumerate(rows):
        for c, image in enumerate(row):
            sheet[r * (h + pad) : r * (h + pad) + h, c * (w + pad) : c * (w + pad) + w] = image
    return sheet


def panel_rows(
    unmerged: Sequence[np.ndarray], merged: Sequence[np.ndarray]
) -> tuple[list[list[np.ndarray]], list[str]]:
    """The rows of one model's panel and their labels: images ``(H, W)``, or the frames of a
    single clip ``(T, H, W)``, make an unmerged row over a ToMA row; several clips make one
    such pair of rows per clip, a frame per column."""
    if np.asarray(unmerged[0]).ndim == 2 or len(unmerged) == 1:
        one = np.asarray(unmerged[0]).ndim == 3  # a single clip: its frames make the row
        rows = [list(unmerged[0]), list(merged[0])] if one else [list(unmerged), list(merged)]
        return rows, ["unmerged", f"ToMA {RATIO:g}"]
    rows, labels = [], []
    for n, (base, toma_clip) in enumerate(zip(unmerged, merged)):
        rows += [list(base), list(toma_clip)]
        labels += [f"clip {n + 1}: unmerged", f"clip {n + 1}: ToMA {RATIO:g}"]
    return rows, labels


def draw_samples(name: str, labels: Sequence[int], steps: int = STEPS) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``labels`` drawn by the built-in model ``name`` unmerged and with ToMA at :data:`RATIO`
    (seeds 0, 1, ...), as arrays in ``[0, 1]``: images ``(H, W)``, or clips ``(T, H, W)``."""
    import toma

    def arrays(images: list[Any]) -> list[np.ndarray]:
        def one(image: Any) -> np.ndarray:
            return np.asarray(image, dtype=np.float32) / 255.0

        return [np.stack([one(f) for f in item]) if isinstance(item, list) else one(item) for item in images]

    pipe = toma.builtin.pipeline(name)
    unmerged = pipe(labels=list(labels), num_inference_steps=steps, seed=0).images
    toma.apply_toma(pipe, ratio=RATIO)
    try:
        merged = pipe(labels=list(labels), num_inference_steps=steps, seed=0).images
    finally:
        toma.remove_toma(pipe)
    return arrays(unmerged), arrays(merged)


def draw_picture(
    samples: dict[str, tuple[Sequence[np.ndarray], Sequence[np.ndarray]]],
    points: dict[str, list[Point]],
    path: Path,
    caption: str = CAPTION,
) -> None:
    """Write the picture to ``path`` (PNG): a panel of samples per model in ``samples`` (by
    --model name, in :data:`MODELS`' order), and beside them PSNR against speedup of every
    model's ``points``, ToMA's filled, the other methods hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {name: title for name, title, _, _ in MODELS}
    names = [name for name, _, _, _ in MODELS if name in samples]
    panels = [panel_rows(*samples[name]) for name in names]
    sheets = [(compose(rows, pad=1 if rows[0][0].shape[0] < 32 else 2), labels) for rows, labels in panels]
    fig = plt.figure(figsize=(12, 5.4), dpi=100)
    # every panel has the same number of rows per sample, so equal heights show them at one size
    grid = fig.add_gridspec(
        len(names),
        2,
        width_ratios=(1.2, 1),
        height_ratios=[len(labels) for _, labels in sheets],
        left=0.1,
        right=0.98,
        top=0.93,
        bottom=0.17,
        wspace=0.1,
        hspace=0.3,
    )
    colours = {name: f"C{i}" for i, name in enumerate(titles)}
    short = {"builtin-unet": "UNet", "builtin-dit": "DiT", "builtin-video": "video DiT"}
    for i, (name, (sheet, labels)) in enumerate(zip(names, sheets)):
        ax = fig.add_subplot(grid[i, 0])
        ax.imshow(sheet, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
        step = (sheet.shape[0] + 1) / len(labels)
        ax.set_yticks([step * (k + 0.5) for k in range(len(labels))], labels, fontsize=9)
        ax.set_xticks([])
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.set_title(f"{titles[name]}  (--model {name})", fontsize=9, loc="left", color=colours[name])
    ax = fig.add_subplot(grid[:, 1])
    markers = {"toma": "o", "toma-grid": "s", "toma-random": "^", "tomesd": "D"}
    others: dict[str, str] = {}  # the methods beside ToMA that some file holds, by marker
    for name, model_points in points.items():
        for p in model_points:
            filled = p.method == "toma"
            marker = markers.get(p.method, "x")
            ax.errorbar(
                p.speedup,
                p.psnr,
                yerr=p.psnr_sem,
                fmt=marker,
                ms=9 if filled else 6,
                color=colours[name],
                mfc=colours[name] if filled else "none",
                capsize=2,
            )
            if not filled:
                others[p.method] = marker
                continue
            ax.annotate(
                f"ToMA {p.speedup:.2f}x, {p.psnr:.1f} dB\naccuracy {p.unmerged_accuracy:.2f} \u2192 {p.accuracy:.2f}",
                (p.speedup, p.psnr),
                xytext=(0, 9),
                textcoords="offset points",
                fontsize=8,
                color=colours[name],
                ha="center",
                va="bottom",
            )
    handles = [
        plt.Line2D([], [], color=colours[n], marker="o", ls="", label=f"ToMA, {short.get(n, titles[n])}")
        for n in points
    ]
    handles += [
        plt.Line2D([], [], color="0.4", marker=m, mfc="none", ls="", label=method) for method, m in others.items()
    ]
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    ax.axvline(1.0, color="0.6", lw=0.8, ls="--")
    every = [p for ps in points.values() for p in ps]
    ax.set_xlim(0.95, max(p.speedup for p in every) + 0.35)
    # room above each point for its label
    ax.set_ylim(min(p.psnr for p in every) - 4, max(p.psnr for p in every) + 5)
    ax.set_xlabel("speedup over unmerged, end to end (x)")
    ax.set_ylabel("PSNR vs unmerged (dB), mean ± s.e.")
    ax.set_title(f"quality against speed, ratio {RATIO:g}, 1 CPU thread", fontsize=10)
    ax.grid(alpha=0.3)
    fig.text(0.01, 0.015, caption, fontsize=7, color="0.3", va="bottom")
    path.parent.mkdir(parents=True, exist_ok=True)
    # no Software stamp: the file's bytes depend on the pixels only
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Draw every model's samples, read the results files, write the picture."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"the PNG to write (default: {OUT.relative_to(ROOT)})")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1; got {args.threads}")
    import torch

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    samples, points = {}, {}
    for name, _, results, labels in MODELS:
        points[name] = read_points(ROOT / results)
        t0 = time.perf_counter()
        samples[name] = draw_samples(name, labels)
        print(f"{name}: {len(labels)} label(s) unmerged and with ToMA in {time.perf_counter() - t0:.1f} s")
    draw_picture(samples, points, args.out)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1024:.0f} KiB) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
