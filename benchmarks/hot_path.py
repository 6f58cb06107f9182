"""Microbenchmark of ToMA's hot path at the token grids SDXL and Flux merge at 1024x1024.

Times plan building (selection + weights), merge and unmerge (on tokens kept in tile
order, as the adapters run them) and one reordering to tile order and back, in isolation,
and scales them to the merge overhead of one denoiser forward (plans x build + merged
modules x (merge + unmerge) + transformer stacks x reordering). The last column is the
same forward with every merged module reordering its own tokens (the fallback for grids
the tiles do not divide). Cheap enough to compare core changes before/after:

    python benchmarks/hot_path.py [--repeats 30] [--threads N] [--batch 1] [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from toma.config import ToMAConfig
from toma.adapters.state import PlanCache
from toma.core.tiling import raster_order, tile_order

# name: (grid side, channels, plans per forward, merged modules per forward, reorderings
# per forward: tile order and back once per UNet transformer stack, once per Flux forward)
SHAPES = {
    "sdxl 64x64 x640 (levels 1: 10 blocks)": (64, 640, 1, 10, 5),
    "sdxl 32x32 x1280 (level 2: 60 blocks)": (32, 1280, 1, 60, 6),
    "flux 64x64 x3072 (47 blocks, 2 groups)": (64, 3072, 2, 47, 1),
}


def sample_seconds(fn, repeats: int, device: torch.device, warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn()`` after ``warmup`` untimed calls
    (synchronised on CUDA). The one timing loop of the benchmark scripts."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def median_ms(fn, repeats: int, device: torch.device) -> float:
    """Median milliseconds of ``fn()`` after one warm-up call."""
    return 1000 * statistics.median(sample_seconds(fn, repeats, device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tile", type=int, default=4, help="tile side in tokens")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {device}, {args.dtype}, {torch.get_num_threads()} threads, batch "
        f"{args.batch}, ratio 0.5, tile {args.tile}x{args.tile}"
    )
    print(
        f"{'grid':<40}{'build ms':>10}{'merge ms':>10}{'unmerge ms':>12}{'reorder ms':>12}"
        f"{'per forward ms':>16}{'raster order':>14}"
    )
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, (side, channels, plans, modules, stacks) in SHAPES.items():
            x = torch.randn(args.batch, side * side, channels, generator=gen).to(device, dtype)
            cache = PlanCache(ToMAConfig(ratio=0.5, tile_size=args.tile))

            def build() -> None:
                cache.begin_forward((side, side), None)  # a new run: the plan is recomputed
                cache.get(x, (side, side), group="g")

            build()
            plan = cache.get(x, (side, side), group="g")
            layout = plan.layout
            tiled = tile_order(x, layout)
            merged = plan.merge(tiled, tiled=True)
            b = median_ms(build, args.repeats, device)
            # as the adapters run it: tokens kept in tile order between merges
            m = median_ms(lambda: plan.merge(tiled, tiled=True), args.repeats, device)
            u = median_ms(lambda: plan.unmerge(merged, tiled=True), args.repeats, device)
            r = median_ms(lambda: raster_order(tile_order(x, layout), layout), args.repeats, device)
            # each merged module reordering its own tokens (the adapters' fallback for padded grids)
            mr = median_ms(lambda: plan.merge(x), args.repeats, device)
            ur = median_ms(lambda: plan.unmerge(merged), args.repeats, device)
            per_forward = plans * b + modules * (m + u) + stacks * r
            raster = plans * b + modules * (mr + ur)
            print(f"{name:<40}{b:>10.2f}{m:>10.2f}{u:>12.2f}{r:>12.2f}{per_forward:>16.1f}{raster:>14.1f}")


if __name__ == "__main__":
    main()
