"""Speed-quality frontier from ``toma eval`` runs: one markdown table, Pareto rows marked.

    python benchmarks/frontier_table.py bench-results/unet_frontier [--default l1:toma:0.5] \
        [--speed frontier_speed.json [--speed windows_speed.json]]

Reads ``<dir>/<placement>[@suffix]/results.json`` for every placement folder (as written by
``benchmarks/unet_frontier.sh``) and prints one row per (placement, method, ratio): the
speedup against that run's own unmerged reference, PSNR against it with its standard error,
and classifier accuracy. A row is on the frontier (``*``) when no other row is at least as
fast with a higher PSNR. For each tomesd row it names the most faithful ToMA row that is at
least as fast, which is the issue's "at every tomesd speedup" check, and it lists the rows at
1.3x or more with their accuracy and PSNR change against ``--default``.

With ``--speed`` (the JSON of ``benchmarks/frontier_speed.py``) the speedups are those of
that one-process interleaved timing instead of each eval run's own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_rows(root: Path) -> list[dict]:
    """Every merged row of every ``results.json`` under ``root``, tagged with its placement folder."""
    rows = []
    for path in sorted(root.glob("*/results.json")):
        data = json.loads(path.read_text())
        for row in data["results"]:
            if row["method"] == "none":
                continue
            # "<placement>@<anything>": more ratios of the same placement, from another run
            rows.append(
                {
                    **row,
                    "placement": path.parent.name.split("@")[0],
                    "reference_accuracy": next(r["accuracy"] for r in data["results"] if r["method"] == "none"),
                }
            )
    if not rows:
        raise SystemExit(f"no */results.json under {root}")
    return rows


def frontier(rows: list[dict]) -> set[int]:
    """Indices of rows that no other row beats on both speed (>=) and PSNR (>)."""
    keep = set()
    for i, row in enumerate(rows):
        if not any(o["speedup"] >= row["speedup"] and o["psnr"] > row["psnr"] for j, o in enumerate(rows) if j != i):
            keep.add(i)
    return keep


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--default", default="l1:toma:0.5", help="placement:method:ratio of the default setting")
    parser.add_argument(
        "--speed",
        type=Path,
        action="append",
        default=[],
        help="frontier_speed.py's JSON: use its speedups (repeatable: the first file that times a setting wins)",
    )
    args = parser.parse_args()
    rows = load_rows(args.root)
    if args.speed:
        timed: dict = {}
        for path in args.speed:  # the first file that times a setting gives its speed
            for s in json.loads(path.read_text())["settings"]:
                timed.setdefault((s["placement"], s["method"], s["ratio"]), s["speedup"])
        missing = [r for r in rows if (r["placement"], r["method"], r["ratio"]) not in timed]
        if missing:
            names = ", ".join(map(str, args.speed))
            raise SystemExit(
                f"{names} have no speed for {[(r['placement'], r['method'], r['ratio']) for r in missing]}"
            )
        rows = [{**r, "speedup": timed[(r["placement"], r["method"], r["ratio"])]} for r in rows]
    on_front = frontier(rows)
    place, method, ratio = args.default.split(":")
    default = next(r for r in rows if (r["placement"], r["method"], r["ratio"]) == (place, method, float(ratio)))

    print("| placement | method | ratio | speedup | PSNR (dB) | accuracy | frontier |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for i, r in sorted(enumerate(rows), key=lambda ir: -ir[1]["speedup"]):
        print(
            f"| {r['placement']} | {r['method']} | {r['ratio']} | {r['speedup']:.3f}x | "
            f"{r['psnr']:.2f} ± {r['psnr_sem']:.2f} | {r['accuracy']:.3f} (ref {r['reference_accuracy']:.3f}) | "
            f"{'*' if i in on_front else ''} |"
        )

    print("\ntomesd against ToMA (most faithful ToMA row at least as fast):")
    for r in (r for r in rows if r["method"] == "tomesd"):
        faster = [t for t in rows if t["method"] == "toma" and t["speedup"] >= r["speedup"]]
        best = max(faster, key=lambda t: t["psnr"], default=None)
        verdict = (
            "none as fast"
            if best is None
            else (
                f"{best['placement']} {best['ratio']}: {best['speedup']:.3f}x, {best['psnr']:.2f} dB "
                f"({'higher' if best['psnr'] > r['psnr'] else 'NOT higher'})"
            )
        )
        print(f"  tomesd {r['ratio']}: {r['speedup']:.3f}x, {r['psnr']:.2f} dB -> {verdict}")

    print(
        f"\nrows at >= 1.3x against the default ({args.default}: {default['psnr']:.2f} dB, "
        f"accuracy {default['accuracy']:.3f}):"
    )
    for r in sorted((r for r in rows if r["speedup"] >= 1.3), key=lambda r: -r["psnr"]):
        print(
            f"  {r['placement']} {r['method']} {r['ratio']}: {r['speedup']:.3f}x, "
            f"{r['psnr'] - default['psnr']:+.2f} dB, accuracy {100 * (r['accuracy'] - default['accuracy']):+.1f} pts"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
