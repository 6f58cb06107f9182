"""ToMA with tokens kept in tile order between merges against per-module raster reordering.

The adapters keep a transformer stack (UNet) or a whole forward (Flux) in tile order, so
that merges are matmuls on views; grids the tiles do not divide fall back to reordering
at every merged module. This times both paths on the same patched model, alternating
``--rounds`` times (each round eager, and compiled with ``--compile``):

    python benchmarks/tile_order_ab.py --arch sd15 --resolution 512 --threads 2 --compile
    python benchmarks/tile_order_ab.py --arch sdxl --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import torch
from hot_path import sample_seconds  # benchmarks/ is on sys.path when this script runs

import toma
from toma.tools.archs import build_model, call_denoiser, get_arch, make_inputs
from toma.adapters.state import PlanCache


def median_min(fn: Callable[[], Any], repeats: int, device: torch.device) -> tuple[float, float]:
    """Median and minimum seconds of ``fn()`` after two warm-up calls."""
    times = sample_seconds(fn, repeats, device, warmup=2)
    return statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sd15", choices=["sd15", "sdxl", "flux"])
    parser.add_argument("--resolution", type=int, default=None)
    parser.add_argument("--depth", type=int, default=1, help="Flux: build this many times fewer blocks")
    parser.add_argument("--levels", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd forwards")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    arch = get_arch(args.arch)
    resolution = args.resolution or arch.resolution
    model = build_model(arch, depth=args.depth, dtype=dtype, device=device)
    inputs = make_inputs(arch, resolution, 1, dtype=dtype, device=device)
    placement = {} if arch.family == "flux" else {"levels": args.levels}
    toma.apply_toma(model, 0.5, **placement)
    tiled = PlanCache.tile_order_layout
    paths = {"tile order": tiled, "raster order": lambda self, grid, device=None: None}
    print(
        f"{arch.name} {resolution}px {args.dtype} on {device}, {torch.get_num_threads()} threads, ratio 0.5, "
        f"{placement}"
    )
    print(f"{'round':<7}{'path':<14}{'eager median / min s':>24}{'compiled median / min s':>26}")
    with torch.no_grad():
        for r in range(args.rounds):
            for name, choice in paths.items():
                PlanCache.tile_order_layout = choice
                eager = median_min(lambda: call_denoiser(arch, model, inputs), args.repeats, device)
                compiled = ""
                if args.compile:
                    torch._dynamo.reset()
                    fast = torch.compile(model)
                    med, low = median_min(lambda: call_denoiser(arch, fast, inputs), args.repeats, device)
                    compiled = f"{med:.3f} / {low:.3f}"
                print(f"{r + 1:<7}{name:<14}{f'{eager[0]:.3f} / {eager[1]:.3f}':>24}{compiled:>26}", flush=True)
    PlanCache.tile_order_layout = tiled


if __name__ == "__main__":
    main()
