"""Speed of every frontier setting on the built-in digits UNet, all in one process, interleaved.

``toma eval`` times each run's methods against that run's own unmerged reference, so two
placements measured in two runs are compared across whatever the machine did between them
(on a shared 2-core machine that moved speedups by 15%). This script times all the
placements of ``benchmarks/unet_frontier.sh`` (and tomesd) side by side: one round applies
each setting in turn (order rotated every round), samples one batch of digits with the
eval's sampler (DDIM with guidance, so the UNet batch is twice ``--batch``) and removes it;
a setting's figure is the median over rounds of the process CPU time (one thread: the
others' load then only reaches it through shared caches), its speedup that of unmerged
over it. The merge plans are rebuilt every step either way, so ``--steps`` (default 5)
need not be the eval's 20.

    python benchmarks/frontier_speed.py --rounds 5 --json frontier_speed.json
    python benchmarks/frontier_table.py bench-results/unet_frontier --speed frontier_speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from toma.tools.eval_harness import apply_method

# placement name -> ToMA options; the names are unet_frontier.sh's output folders
PLACEMENTS: dict[str, dict] = {
    "l1": {"levels": 1},
    "l2": {"levels": 2},
    "l1_mlp": {"levels": 1, "merge_mlp": True},
    "l2_mlp": {"levels": 2, "merge_mlp": True},
    "l2_mlp25": {"levels": 2, "merge_mlp": True, "mlp_ratio": 0.25},
    "l1_tile8": {"levels": 1, "tile_size": 8},
    "l2_mlp_xattn": {"levels": 2, "merge_mlp": True, "merge_crossattn": True},
}


# placements also timed at --extra-ratios (unet_frontier.sh's "@mid" runs)
EXTRA = ("l1", "l1_tile8", "tomesd")


def settings(ratios: list[float], extra: list[float]) -> list[tuple[str, str, float, dict]]:
    """(placement, method, ratio, options) of every timed setting, unmerged first."""
    out = [("l1", "none", 0.0, {})]
    for place, options in PLACEMENTS.items():
        out += [(place, "toma", r, options) for r in ratios + (extra if place in EXTRA else [])]
    out += [("l1", "tomesd", r, {"levels": 1}) for r in ratios + (extra if "tomesd" in EXTRA else [])]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", default="0.25,0.5,0.75")
    parser.add_argument("--extra-ratios", default="0.6,0.7", help=f"more ratios for {', '.join(EXTRA)}")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--batch", type=int, default=20, help="digits per sample (the eval's --batch-size)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default=None, help="write {placement/method/ratio: speedup, ...} here")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from toma.tools.builtin import load_builtin, sample

    model = load_builtin()
    labels = torch.arange(args.batch) % 10
    floats = lambda text: [float(r) for r in text.split(",") if r.strip()]  # noqa: E731
    todo = settings(floats(args.ratios), floats(args.extra_ratios))
    times: dict[int, list[float]] = {i: [] for i in range(len(todo))}
    for rnd in range(args.rounds + 1):
        shift = rnd % len(todo)
        for i in [*range(shift, len(todo)), *range(shift)]:
            place, method, ratio, options = todo[i]
            remove = apply_method(model.unet, method, ratio, options)
            try:
                with torch.inference_mode():
                    start = time.process_time()
                    sample(model, labels, 0, steps=args.steps, progress=False)
                    spent = time.process_time() - start
            finally:
                remove()
            if rnd:  # the first round warms up
                times[i].append(spent)
        print(f"round {rnd}/{args.rounds} done", flush=True)

    none = statistics.median(times[0])
    result = {"protocol": f"built-in digits UNet, batch {args.batch} (guided: {2 * args.batch} in the UNet), "
                          f"{args.steps} DDIM steps, process CPU time, 1 thread, median of {args.rounds} "
                          "interleaved rounds", "settings": []}
    for i, (place, method, ratio, _) in enumerate(todo):
        med = statistics.median(times[i])
        spread = (max(times[i]) - min(times[i])) / med
        result["settings"].append({"placement": place, "method": method, "ratio": ratio, "cpu_s": round(med, 3),
                                   "speedup": round(none / med, 3), "spread": round(spread, 3)})
        print(f"{place:13s} {method:7s} {ratio:5.2f}  {med:7.3f} s  {none / med:6.3f}x  spread {spread:.1%}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
