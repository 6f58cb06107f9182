"""What the CPU shortcuts of a plan save: the similarities of in-range tokens (two passes over
the tokens instead of six) and assignment weights without subnormal floats.

``python benchmarks/plan_cost.py [--threads 1] [--repeats 9]``: on random tokens of two real
shapes (Kandinsky 5's 2 x 32 x 48 tokens of 1792 at 512x768, 5 frames; Flux's 64 x 64 of 3072
at 1024px), 4x4 tiles, ratio 0.5, the default temperature 1e-3, medians of ``--repeats``
timings, interleaved:

- similarities: ``finite_similarity`` against the full path it shortcuts
  (``cosine_similarity(finite_or_zero(tiles))``), bitwise equal;
- merge and unmerge matmuls with the plan's weights against the same weights with the
  subnormal ones the softmax alone leaves (what plans held before), and how many those were.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from toma.core.merge import cosine_similarity, merge, merge_weights, unmerge
from toma.core.plan import build_plan, finite_or_zero, finite_similarity
from toma.core.tiling import make_layout, to_tiles

SHAPES = {  # name: (frames, rows, columns, channels)
    "kandinsky5 512x768x5": (2, 32, 48, 1792),
    "flux 1024px": (1, 64, 64, 3072),
}


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tiny = torch.finfo(torch.float32).tiny
    print(f"torch {torch.__version__}, {args.threads} thread(s), medians of {args.repeats}")
    for name, (t, h, w, c) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, t * h * w, c, generator=g)
        layout = make_layout(h, w, (4, 4), 0.5, t=t)
        tiles = to_tiles(x, layout)
        assert torch.equal(finite_similarity(tiles), cosine_similarity(finite_or_zero(tiles)))
        full = median_ms(lambda: cosine_similarity(finite_or_zero(tiles)), args.repeats)
        short = median_ms(lambda: finite_similarity(tiles), args.repeats)
        plan = build_plan(tiles, layout, torch.float32, selection="facility", temperature=1e-3)
        # the softmax's own weights, subnormal ones kept: the assignment before the flush
        sim = cosine_similarity(tiles)
        logits = sim.gather(-2, plan.dest.unsqueeze(-1).expand(*plan.dest.shape, sim.shape[-1]))
        raw = torch.softmax(logits / 1e-3, dim=-2)
        subnormal = int(((raw > 0) & (raw < tiny)).sum())
        raw_merge, raw_unmerge = merge_weights(raw), raw.transpose(-1, -2)
        merged = merge(tiles, plan.merge_w)
        timings = {
            "merge (plan's weights)": lambda: merge(tiles, plan.merge_w),
            "merge (with subnormals)": lambda: merge(tiles, raw_merge),
            "unmerge (plan's weights)": lambda: unmerge(merged, plan.unmerge_w),
            "unmerge (with subnormals)": lambda: unmerge(merged, raw_unmerge),
        }
        ms = {k: median_ms(f, args.repeats) for k, f in timings.items()}
        print(f"{name}: {t * h * w} tokens of {c}, {layout.num_tiles} tiles")
        print(f"  similarities: full path {full:.2f} ms, shortcut {short:.2f} ms ({full / short:.1f}x)")
        print(f"  softmax weights below float32's smallest normal: {subnormal} of {raw.numel()}")
        for k, v in ms.items():
            print(f"  {k}: {v:.2f} ms")


if __name__ == "__main__":
    main()
