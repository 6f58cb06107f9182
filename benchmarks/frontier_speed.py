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
need not be the eval's 20, except for the step-window placements (``start_step`` /
``stop_step``, counted in the eval's 20 steps), which are timed only when named in ``--only``.

    python benchmarks/frontier_speed.py --rounds 5 --json frontier_speed.json
    python benchmarks/frontier_speed.py --steps 20 --ratios 0.5,0.75 --extra-ratios '' --rounds 3 \
        --only l1,l2_mlp,l2_mlp2,l2_mlp_late,l2_mlp_last5,l2_mlp_early,l2_mlp_from5,l1_late --json windows_speed.json
    python benchmarks/frontier_table.py bench-results/unet_frontier --speed frontier_speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from toma.tools.eval.harness import apply_method

# placement name -> ToMA options; the names are unet_frontier.sh's output folders
PLACEMENTS: dict[str, dict] = {
    "l1": {"levels": 1},
    "l2": {"levels": 2},
    "l1_mlp": {"levels": 1, "merge_mlp": True},
    "l2_mlp": {"levels": 2, "merge_mlp": True},
    "l2_mlp25": {"levels": 2, "merge_mlp": True, "mlp_ratio": 0.25},
    "l1_tile8": {"levels": 1, "tile_size": 8},
    "l2_mlp_xattn": {"levels": 2, "merge_mlp": True, "merge_crossattn": True},
    "l2_mlp2": {"levels": 2, "merge_mlp": True, "mlp_levels": (2,)},
    # step windows of the eval's 20 steps: only with --steps 20 (see WINDOW_STEPS)
    "l2_mlp_late": {"levels": 2, "merge_mlp": True, "start_step": 10},
    "l2_mlp_last5": {"levels": 2, "merge_mlp": True, "start_step": 15},
    "l2_mlp_early": {"levels": 2, "merge_mlp": True, "stop_step": 10},
    "l2_mlp_from5": {"levels": 2, "merge_mlp": True, "start_step": 5},
    "l1_late": {"levels": 1, "start_step": 10},
}

# the denoising steps the step windows above are counted in (toma eval's default)
WINDOW_STEPS = 20


# placements also timed at --extra-ratios (unet_frontier.sh's "@mid" runs)
EXTRA = ("l1", "l1_tile8", "tomesd")


def windowed(options: dict) -> bool:
    return "start_step" in options or "stop_step" in options


def settings(
    ratios: list[float], extra: list[float], only: list[str] | None = None
) -> list[tuple[str, str, float, dict]]:
    """(placement, method, ratio, options) of every timed setting, unmerged first.

    ``only``: placement names (and ``"tomesd"``) to time; None means every placement
    without a step window, and tomesd.
    """
    wanted = ([p for p in PLACEMENTS if not windowed(PLACEMENTS[p])] + ["tomesd"]) if only is None else only
    out = [("l1", "none", 0.0, {})]
    for place, options in PLACEMENTS.items():
        if place in wanted:
            out += [(place, "toma", r, options) for r in ratios + (extra if place in EXTRA else [])]
    if "tomesd" in wanted:
        out += [("l1", "tomesd", r, {"levels": 1}) for r in ratios + (extra if "tomesd" in EXTRA else [])]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", default="0.25,0.5,0.75")
    parser.add_argument("--extra-ratios", default="0.6,0.7", help=f"more ratios for {', '.join(EXTRA)}")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--batch", type=int, default=20, help="digits per sample (the eval's --batch-size)")
    parser.add_argument(
        "--steps", type=int, default=5, help=f"denoising steps ({WINDOW_STEPS} for step-window placements)"
    )
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated placements (and/or tomesd) to time; default: all without a step window",
    )
    parser.add_argument("--json", default=None, help="write {placement/method/ratio: speedup, ...} here")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from toma.tools.builtin.unet import load_builtin, sample

    model = load_builtin()
    labels = torch.arange(args.batch) % 10
    floats = lambda text: [float(r) for r in text.split(",") if r.strip()]  # noqa: E731
    only = None if args.only is None else [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(only or []) - set(PLACEMENTS) - {"tomesd"})
    if unknown:
        parser.error(f"--only: unknown placement(s) {unknown}; known: {[*PLACEMENTS, 'tomesd']}")
    todo = settings(floats(args.ratios), floats(args.extra_ratios), only)
    if any(windowed(o) for *_, o in todo) and args.steps != WINDOW_STEPS:
        parser.error(f"step-window placements count {WINDOW_STEPS} steps (toma eval's): pass --steps {WINDOW_STEPS}")
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
    result = {
        "protocol": f"built-in digits UNet, batch {args.batch} (guided: {2 * args.batch} in the UNet), "
        f"{args.steps} DDIM steps, process CPU time, 1 thread, median of {args.rounds} "
        "interleaved rounds",
        "settings": [],
    }
    for i, (place, method, ratio, _) in enumerate(todo):
        med = statistics.median(times[i])
        spread = (max(times[i]) - min(times[i])) / med
        result["settings"].append(
            {
                "placement": place,
                "method": method,
                "ratio": ratio,
                "cpu_s": round(med, 3),
                "speedup": round(none / med, 3),
                "spread": round(spread, 3),
            }
        )
        print(f"{place:13s} {method:7s} {ratio:5.2f}  {med:7.3f} s  {none / med:6.3f}x  spread {spread:.1%}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
