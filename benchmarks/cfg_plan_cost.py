"""Cost of per-element plans versus one shared plan for a CFG batch of 2.

Times ``PlanCache.get`` (selection + weights) and one merge + unmerge at the token grids
SDXL merges at 1024x1024 (64x64 tokens x 640 channels, 32x32 x 1280), for batch 2 with
per-element plans and with ``share_batch_plan=True``, and batch 1 for reference.

    python benchmarks/cfg_plan_cost.py [--repeats 30] [--threads N]
"""

from __future__ import annotations

import argparse

import torch
from hot_path import median_ms  # benchmarks/ is on sys.path when this script runs

from toma.config import ToMAConfig
from toma.adapters.state import PlanCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, ratio 0.5, 4x4 tiles")
    print(f"{'grid x channels':>18} {'batch':>5} {'plans':>8} {'plan ms':>8} {'merge+unmerge ms':>17}")
    for (h, w), c in (((64, 64), 640), ((32, 32), 1280)):
        for batch, share in ((1, False), (2, False), (2, True)):
            cache = PlanCache(ToMAConfig(ratio=0.5, share_batch_plan=share))
            cache.begin_forward((h, w), None)
            x = torch.randn(batch, h * w, c)

            def build():
                cache._plans.clear()
                return cache.get(x, (h, w), group=0)

            plan = build()
            y = plan.merge(x)
            plan_ms = median_ms(build, args.repeats, x.device)
            apply_ms = median_ms(lambda: plan.unmerge(plan.merge(x)), args.repeats, x.device)
            label = "shared" if share else "own"
            print(f"{f'{h}x{w} x {c}':>18} {batch:>5} {label:>8} {plan_ms:>8.2f} {apply_ms:>17.2f}")
            del y


if __name__ == "__main__":
    main()
