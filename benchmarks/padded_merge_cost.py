"""Plan, merge and unmerge cost of one merged module, in tile order and from raster order.

Tokens stay in tile order between merges only where the tiles cut the grid exactly. A grid
they do not divide (a video with an odd number of latent frames under 2-frame tiles, such
as Wan's 81 frames -> 21 latent frames) is padded, and every merge and unmerge then moves
the tokens between raster and tile order itself. This times both paths on random tokens
at CogVideoX-5B's width, by process CPU time at one thread (median of the rounds after a
warm-up):

    python benchmarks/padded_merge_cost.py [--channels 3072] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from toma.config import ToMAConfig
from toma.adapters.state import PlanCache
from toma.core.tiling import tile_order

CASES = (  # (t, h, w) token grid, frames per tile
    ((2, 32, 48), 2),  # divides: tile order
    ((3, 32, 48), 2),  # 3 frames under 2-frame tiles: padded, raster order
    ((3, 32, 48), 1),  # the same grid in 2-D tiles: divides again
)


def time_path(
    grid: tuple[int, int, int], tile_frames: int, channels: int, rounds: int, tiled: bool
) -> dict[str, float]:
    """Median milliseconds of building a plan, merging and unmerging ``(1, N, channels)`` tokens."""
    cache = PlanCache(ToMAConfig(ratio=0.5, tile_frames=tile_frames), tile_frames)
    x = torch.randn(1, grid[0] * grid[1] * grid[2], channels, generator=torch.Generator().manual_seed(0))
    if tiled:
        x = tile_order(x, cache.tile_order_layout(grid))
    times: dict[str, list[float]] = {"plan": [], "merge": [], "unmerge": []}
    for round_ in range(rounds + 1):
        cache._plans.clear()  # a fresh plan each round, as at each denoising step
        t0 = time.process_time()
        plan = cache.get(x, grid, group="bench", tiled=tiled)
        t1 = time.process_time()
        merged = plan.merge(x, tiled)
        t2 = time.process_time()
        plan.unmerge(merged, tiled)
        t3 = time.process_time()
        if round_:
            for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[name].append(1000 * seconds)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channels", type=int, default=3072)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"ms per merged module, {args.channels} channels, ratio 0.5, 4x4 tiles, median of {args.rounds}")
    for grid, frames in CASES:
        padded = PlanCache(ToMAConfig(ratio=0.5, tile_frames=frames), frames).tile_order_layout(grid) is None
        for tiled in (False,) if padded else (False, True):
            ms = time_path(grid, frames, args.channels, args.rounds, tiled)
            path = "tile order" if tiled else ("raster, padded" if padded else "raster")
            print(
                f"  grid {grid}, {frames}-frame tiles, {path:14s}: plan {ms['plan']:6.1f}  merge {ms['merge']:6.1f}  "
                f"unmerge {ms['unmerge']:6.1f}"
            )


if __name__ == "__main__":
    main()
