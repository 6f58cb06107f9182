"""Unpatched, ToMA and the ideal timed by the CPU time of the process, interleaved round by round.

On a CPU shared by more runnable jobs than cores, wall time mostly measures how long the
scheduler kept this job waiting (``toma bench`` then flags its rows as unreliable). With
one torch thread, the CPU time the process spends is its own work, which the others can
only inflate through shared caches and memory bandwidth, alike for every method of a
round. Same model, inputs, placement (the default blocks scaled to ``--depth``) and
methods as ``toma bench``; one forward per sample:

    python benchmarks/cpu_time_ab.py --arch cogvideox --depth 42 --resolution 480 --frames 9 --rounds 3
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import time

import torch

from toma.tools.archs import build_model, call_denoiser, default_placement, get_arch, make_inputs
from toma.tools.bench_harness import MethodPatcher, Variant

METHODS = ("none", "toma", "ideal")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", required=True)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--resolution", type=int, default=None)
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    parser.add_argument("--out", default=None, help="JSON file for the raw samples")
    parser.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE",
                        help="override a placement option of toma and the ideal, e.g. --set levels=2 --set merge_mlp=True "
                             "(VALUE is a Python literal); repeatable")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1; got {args.rounds}")
    torch.set_num_threads(1)  # CPU time equals work only with one thread

    arch = get_arch(args.arch)
    resolution = args.resolution or arch.resolution
    model = build_model(arch, depth=args.depth)
    inputs = make_inputs(arch, resolution, frames=args.frames)
    placement = {**default_placement(arch, model), **dict(parse_setting(text) for text in args.set)}
    patcher = MethodPatcher(model, arch, placement, {}, None)
    print(f"placement: {placement}", flush=True)
    samples: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
    for round_ in range(args.rounds + 1):
        order = METHODS[round_ % 3 :] + METHODS[: round_ % 3]  # each method leads a round in turn
        for method in order:
            patcher.apply(Variant(method, None if method == "none" else args.ratio))
            with torch.no_grad():
                cpu, wall = time.process_time(), time.perf_counter()
                call_denoiser(arch, model, inputs)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            patcher.remove()
            if round_:  # the first round warms up
                samples[method].append((cpu, wall))
            print(f"round {round_} {method}: cpu {cpu:.2f} s, wall {wall:.2f} s", flush=True)

    cpu = {m: statistics.median(c for c, _ in samples[m]) for m in METHODS}
    print(f"{args.arch} depth {args.depth} {resolution}p frames {args.frames}: medians of {args.rounds} CPU-time samples")
    for m in METHODS:
        eff = "" if m == "none" else f", efficiency {(cpu['none'] - cpu[m]) / (cpu['none'] - cpu['ideal']):.0%}"
        print(f"  {m:6s} {cpu[m]:8.2f} s  speedup {cpu['none'] / cpu[m]:.3f}x{eff}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"arch": args.arch, "depth": args.depth, "resolution": resolution, "frames": args.frames,
                       "ratio": args.ratio, "placement": {k: repr(v) for k, v in placement.items()}, "samples_cpu_wall_s": samples, "median_cpu_s": cpu}, f, indent=1)


def parse_setting(text: str) -> tuple[str, object]:
    """``"levels=2"`` -> ``("levels", 2)``: an option name and a Python literal."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--set takes OPTION=VALUE; got {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise SystemExit(f"--set {name}: {value!r} is not a Python literal (e.g. 2, True, 0.25, (1, 2))") from None


if __name__ == "__main__":
    main()
