"""What the defaults cost on the two trained built-ins: one denoiser forward per setting,
interleaved in one process (each round times every setting once, the lead rotating;
medians of the rounds after a warm-up round), CPU and wall time, ratio 0.5:

* ``none``: unmerged;
* ``4x4``: the old defaults (4x4 tiles, no bias);
* ``2x2``: 2x2 tiles, no bias;
* ``4x4 + bias``: 4x4 tiles with proportional attention;
* ``defaults``: the defaults (on these grids ``tile_size="auto"`` is 2x2, and the bias is on).

    python benchmarks/defaults_cost.py [--rounds 7] [--batch 10] [--threads 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import toma

SETTINGS = {
    "none": None,
    "4x4": {"tile_size": 4, "proportional_attention": False},
    "2x2": {"tile_size": 2, "proportional_attention": False},
    "4x4 + bias": {"tile_size": 4, "proportional_attention": True},
    "defaults": {},
}


def dit_call(batch: int):
    """The built-in DiT's transformer and one guided-batch call at mid-denoising."""
    from toma.tools.builtin.dit import COND_DIM, COND_TOKENS, IMAGE_SIZE, load_dit, velocity

    model = load_dit()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 1, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    t = torch.full((batch,), 0.5)
    tokens = torch.randn(batch, COND_TOKENS, COND_DIM, generator=g)
    pooled = torch.randn(batch, COND_DIM, generator=g)
    return model.transformer, lambda tr: velocity(tr, x, t, tokens, pooled)


def video_call(batch: int):
    """The built-in video DiT's transformer and one call at mid-denoising."""
    from toma.tools.builtin.video import COND_DIM, COND_TOKENS, FRAME_SIZE, FRAMES, load_video_dit, velocity

    model = load_video_dit()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, FRAMES, 1, FRAME_SIZE, FRAME_SIZE, generator=g)
    t = torch.full((batch,), 0.5)
    tokens = torch.randn(batch, COND_TOKENS, COND_DIM, generator=g)
    return model.transformer, lambda tr: velocity(tr, x, t, tokens)


def time_model(transformer, call, rounds: int) -> dict[str, dict[str, float]]:
    names = list(SETTINGS)
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for round_ in range(rounds + 1):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            options = SETTINGS[name]
            if options is not None:
                toma.apply_toma(transformer, ratio=0.5, **options)
            with torch.inference_mode():
                cpu, wall = time.process_time(), time.perf_counter()
                call(transformer)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            toma.remove_toma(transformer)
            if round_:
                samples[name].append((wall, cpu))
    return {
        n: {"wall_s": statistics.median(w for w, _ in s), "cpu_s": statistics.median(c for _, c in s)}
        for n, s in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = {"load_before": os.getloadavg(), "threads": args.threads, "batch": args.batch, "rounds": args.rounds}
    for name, make in (("builtin-dit", dit_call), ("builtin-video", video_call)):
        transformer, call = make(args.batch)
        times = time_model(transformer, call, args.rounds)
        out[name] = times
        base = times["none"]["cpu_s"]
        print(f"{name} (batch {args.batch}, CPU time, medians of {args.rounds} rounds):")
        for setting, t in times.items():
            print(f"  {setting:11} {t['cpu_s'] * 1e3:8.1f} ms  {base / t['cpu_s']:.3f}x")
    out["load_after"] = os.getloadavg()
    print(f"load {out['load_before'][0]:.1f} -> {out['load_after'][0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
