"""Each region of ToMA's merge path timed eager and compiled (inductor), by CPU time at one thread.

Where compiled ToMA gains less than eager ToMA, this says which region inductor runs slower
than eager PyTorch: the plan (similarity, greedy, weights), merge, unmerge, the tile reorder,
or attention on the merged tokens with and without proportional attention's bias. Shapes
default to SD 1.5's first attention level at 512 px (64x64 tokens, 320 channels, 8 heads).
Each region is compiled on its own (``fullgraph=True``), so inductor cannot fuse it with its
neighbours as it does inside a model; the model-level numbers come from
``benchmarks/cpu_time_ab.py --compile``. Eager and compiled calls alternate round by round:

    python benchmarks/compile_regions.py --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from toma.config import ToMAConfig
from toma.core.merge import assignment, cosine_similarity
from toma.core.plan import build_plan
from toma.core.selection import facility_location
from toma.core.tiling import layout_index, make_layout, raster_order, tile_order


def regions(
    batch: int, side: int, channels: int, heads: int, ratio: float, tile: int
) -> dict[str, Callable[[], object]]:
    """The merge path's regions on one grid, as calls without arguments (inputs bound)."""
    from diffusers.models.attention_processor import Attention

    layout = make_layout(side, side, (1, tile, tile), ratio)
    index = layout_index(layout)
    config = ToMAConfig(ratio=ratio, tile_size=tile)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, side * side, channels, generator=g)
    xt = tile_order(x, layout)
    tiles = xt.unflatten(1, (layout.num_tiles, layout.tile_area))
    plan = build_plan(
        tiles, layout, x.dtype, selection=config.selection, temperature=config.temperature, generator=None, index=index
    )
    sim = cosine_similarity(tiles)
    merged = plan.merge(xt, tiled=True)
    bias = plan.log_mass[:, None, :].repeat_interleave(heads, dim=0)  # as the UNet adapter passes it
    attn = Attention(query_dim=channels, heads=heads, dim_head=channels // heads).eval()

    def plan_tensors() -> tuple[torch.Tensor, ...]:
        p = build_plan(
            tiles,
            layout,
            x.dtype,
            selection=config.selection,
            temperature=config.temperature,
            generator=None,
            index=index,
        )
        return p.merge_w, p.unmerge_w, p.mass

    return {
        "plan (all)": plan_tensors,
        "similarity": lambda: cosine_similarity(tiles),
        "greedy": lambda: facility_location(sim, layout.slots, index.token_mask),
        "assignment": lambda: assignment(sim, plan.dest, config.temperature, index.token_mask, index.slot_mask),
        "merge": lambda: plan.merge(xt, tiled=True),
        "unmerge": lambda: plan.unmerge(merged, tiled=True),
        "reorder (there and back)": lambda: raster_order(tile_order(x, layout), layout),
        f"attention, {merged.shape[1]} merged, bias": lambda: attn(merged, attention_mask=bias),
        f"attention, {merged.shape[1]} merged": lambda: attn(merged),
        f"attention, {x.shape[1]} tokens": lambda: attn(x),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--side", type=int, default=64, help="token grid side (64: SD 1.5 at 512 px)")
    parser.add_argument("--channels", type=int, default=320)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--tile", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (one call of each variant per round)")
    parser.add_argument("--calls", type=int, default=5, help="calls per timed sample")
    parser.add_argument("--only", default=None, help="comma-separated region names to time (default: all)")
    args = parser.parse_args()
    for name in ("batch", "side", "channels", "heads", "tile", "rounds", "calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    torch.set_num_threads(1)  # CPU time equals work only with one thread

    calls = regions(args.batch, args.side, args.channels, args.heads, args.ratio, args.tile)
    if args.only:
        wanted = args.only.split(",")
        unknown = [w for w in wanted if w not in calls]
        if unknown:
            parser.error(f"--only: unknown regions {unknown}; choose from {list(calls)}")
        calls = {k: calls[k] for k in wanted}
    print(
        f"{args.side}x{args.side} tokens, {args.channels} channels, {args.heads} heads, batch {args.batch}, "
        f"ratio {args.ratio}, tile {args.tile}: median CPU ms per call of {args.rounds} rounds of {args.calls} "
        "calls, eager | compiled"
    )
    with torch.inference_mode():
        for name, fn in calls.items():
            compiled = torch.compile(fn, fullgraph=True)
            for _ in range(2):  # compile, then settle the guards
                compiled()
                fn()
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            for r in range(args.rounds):
                pair = [("eager", fn), ("compiled", compiled)]
                for label, f in pair if r % 2 == 0 else pair[::-1]:
                    start = time.process_time()
                    for _ in range(args.calls):
                        f()
                    times[label].append((time.process_time() - start) / args.calls)
            e, c = (statistics.median(times[k]) * 1e3 for k in ("eager", "compiled"))
            print(f"  {name:32s} {e:9.2f} | {c:9.2f}  compiled/eager {c / e:.2f}", flush=True)


if __name__ == "__main__":
    main()
