"""Compile every Triton kernel variant that settings can reach, for every GPU target: run before a release.

The CI check (tests/core/test_kernel_compile.py) compiles the launches the tests make for four
targets. This compiles the release matrix without a GPU (Triton's own compiler, ptxas
from the triton wheel):

* targets: every row of toma.kernels.targets (sm_70 to sm_120, gfx90a, gfx942, gfx1100);
* fp32, fp16 and bf16;
* tiles of n slots keeping k (the kernels' constexprs N and KB are their powers of two,
  at least 16): 1x1 (n = k = 1, which Triton turns into constants), the default 4x4 at
  ratios 0.5 and 0.25, 2-frame and 8x8 tiles, and 128-slot tiles (8x16, or 2x8x8) at
  ratios 0.875 to 0.25. tile_size has no upper bound; past 128 slots the plan kernel's
  N x N float32 similarity alone outgrows every target's shared memory, and the fit check
  sends such launches to the torch path;
* the flags: soft and hard assignment, token masks, per-tile keeps, the residual unmerge
  (every combination up to 64 slots; for 128 slots the two corner variants that set each
  flag both ways, since each of those compiles takes 20-90 s).

A launch that compiles but needs more shared memory than its target has is reported
("BIG"): at run time the fit check sends it to the torch path. Only a compile error
fails the run. Writes the results as JSON (--out) and prints, per target and dtype, the
largest tile whose plan kernel fits.

    python benchmarks/compile_matrix.py --jobs 2 --out benchmarks/results/compile_matrix.json
    python benchmarks/compile_matrix.py --targets sm_86,gfx942 --max-slots 64   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

from toma.kernels import aot
from toma.kernels.targets import TARGETS

SMALL = [(1, 1), (16, 8), (16, 12), (32, 16), (32, 24), (64, 16), (64, 32), (64, 48)]
LARGE = [(128, 16), (128, 32), (128, 64), (128, 96)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--dtypes", default="fp32,fp16,bf16")
    parser.add_argument("--max-slots", type=int, default=128, help="largest tile (n) to compile")
    parser.add_argument("--channels", type=int, default=3072)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", help="write every compile's result here (JSON)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter does not compile")
    targets = [t for t in args.targets.split(",") if t]
    dtypes = args.dtypes.split(",")
    small = [t for t in SMALL if t[0] <= args.max_slots]
    large = [t for t in LARGE if t[0] <= args.max_slots]
    records = aot.synthetic_launches(small, [args.channels], dtypes)
    records += aot.synthetic_launches(large, [args.channels], dtypes, corners=True)
    records = list({aot.record_key(r): r for r in records}.values())
    print(f"{len(records)} launches x {len(targets)} targets, {args.jobs} at a time", flush=True)
    start = time.perf_counter()
    results = aot.compile_all(records, targets, args.jobs)
    failed = [r for r in results if "error" in r]
    for r in failed:
        print(f"FAIL {r['target']:8} {r['launch']}\n     {r['error'].splitlines()[-1]}")
    # per target and dtype, the largest plan block that fits
    best: dict[tuple[str, str], int] = defaultdict(int)
    big: dict[tuple[str, str], int] = {}
    for r in results:
        if "error" in r or not r["launch"].startswith("plan"):
            continue
        dtype = r["launch"].split("[")[1].split()[0].lstrip("*")
        n = int(r["launch"].split("N=")[1].split(",")[0])
        key = (r["target"], dtype)
        if r["fits"]:
            best[key] = max(best[key], n)
        else:
            big[key] = min(big.get(key, 10**9), n)
    print(f"\n{'target':8} {'dtype':5} largest plan block that fits (N)   smallest that does not")
    for t in targets:
        for d in dtypes:
            print(f"{t:8} {d:5} {best.get((t, d), '-')!s:35} {big.get((t, d), '-')}")
    print(
        f"\n{len(results) - len(failed)} compiled, {len(failed)} failed, "
        f"{sum(1 for r in results if 'error' not in r and not r['fits'])} over shared memory, "
        f"in {time.perf_counter() - start:.0f} s"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
