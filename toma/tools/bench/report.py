"""Reports of ``toma bench``: the JSON report, its statistics, the text table and the plot.

A report is a plain dict (what :func:`toma.tools.bench.harness.benchmark` returns and
``--from-json`` reads back): the run's conditions and one row per method, ratio, batch
size and compile state with its timed samples and the statistics derived from them.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toma import __version__
from toma.tools.archs import Arch
from toma.tools.bench.constants import METHODS, OVERHEAD_PARTS, method_order, split_method
from toma.tools.common.report import cell, processor_name, pyplot, save_figure, timing_flags, write_json

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RunConditions:
    """What one benchmark run measured under: the model as built, its inputs and the schedule.

    The harness fills it in, so that the report needs neither the model nor the harness's
    objects (the harness imports this module; a report importing the harness back made a circle).
    """

    arch: Arch
    parameters: int  # of the model as built (fewer with --depth)
    blocks: dict[str, int]  # transformer blocks per stack as built
    resolution: int
    dtype: torch.dtype
    device: torch.device
    depth: int
    steps: int  # denoiser forwards per timed sample
    repeats: int
    warmup: int
    methods: list[str]
    ratios: list[float]
    batches: list[int]
    placement: dict[str, Any]  # where the methods merged, as applied (tomesd's max_downsample when it ran)
    toma_options: dict[str, Any]
    compiled: bool  # whether compiled rows were asked for


def build_report(
    conditions: RunConditions, rows: list[dict[str, Any]], skipped: dict[str, str], notes: list[str], interrupted: bool
) -> dict[str, Any]:
    """The report of one benchmark run: its conditions, then one row per measured variant and batch.

    ``rows`` hold each variant's ``method``, ``ratio``, ``batch``, ``compiled``, ``times_s``,
    ``overhead``, ``kernels`` and ``settings``; their statistics are derived here.
    """
    import torch  # here, not at the top: --from-json re-renders a saved report without torch

    c = conditions
    derive(rows, c.batches[0])
    return {
        "toma_version": __version__,
        "arch": c.arch.name,
        "description": c.arch.description,
        "parameters": c.parameters,
        "resolution": c.resolution,
        "dtype": str(c.dtype).replace("torch.", ""),
        "device": str(c.device),
        "device_name": torch.cuda.get_device_name(c.device) if c.device.type == "cuda" else processor_name(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "diffusers": _package_version("diffusers"),
        "tomesd": _package_version("tomesd"),
        "depth": c.depth,
        "blocks": c.blocks,
        "steps_per_sample": c.steps,
        "repeats": c.repeats,
        "warmup": c.warmup,
        "methods": c.methods,
        "ratios": c.ratios,
        "batches": c.batches,
        "placement": c.placement,
        "toma_options": c.toma_options,
        "skipped": skipped,
        "notes": notes,
        "compiled": c.compiled,
        "interrupted": interrupted,
        "results": sorted(rows, key=lambda r: (r["compiled"], r["batch"], r["ratio"] or 0, method_order(r["method"]))),
    }


def derive(rows: list[dict[str, Any]], first_batch: int) -> list[dict[str, Any]]:
    """Fill in the statistics of result rows from their ``times_s`` (in place; also returned).

    Adds median/min/max, speedup over the unpatched row of the same batch (and compile
    state), latency reduction, efficiency against the ideal row of the same ratio and batch,
    each from medians and from the fastest samples (``*_min``: the least disturbed on a
    shared machine), and ``vs_batch<first>``, the median's ratio to the first batch size.
    """

    def key(r: dict[str, Any]) -> tuple:
        return (r["method"], r["ratio"], r["batch"], r["compiled"])

    by_key = {key(r): r for r in rows}
    for r in rows:
        r["median_s"] = statistics.median(r["times_s"])
        r["min_s"], r["max_s"] = min(r["times_s"]), max(r["times_s"])
    for r in rows:
        base = by_key.get(("none", None, r["batch"], r["compiled"]))
        ideal = by_key.get(("ideal", r["ratio"], r["batch"], r["compiled"]))
        for stat, suffix in (("median_s", ""), ("min_s", "_min")):
            t = r[stat]
            b = base[stat] if base else None
            i = ideal[stat] if ideal else None
            r["speedup" + suffix] = b / t if b else None
            r["latency_reduction" + suffix] = 1 - t / b if b else None
            # the ideal has no cache: a cached row's saving is not bounded by it
            usable = (
                b is not None
                and i is not None
                and r["ratio"] is not None
                and b - i > 0
                and split_method(r["method"])[1] is None
            )
            r["efficiency" + suffix] = (b - t) / (b - i) if usable else None
        if r.get("kernels") is not None and base and base.get("kernels") is not None:
            r["extra_kernels"] = r["kernels"] - base["kernels"]
        first = by_key.get((r["method"], r["ratio"], first_batch, r["compiled"]))
        if r["batch"] != first_batch and first:
            r[f"vs_batch{first_batch}"] = r["median_s"] / first["median_s"]
    for r in rows:
        r["spread"] = (r["max_s"] - r["min_s"]) / r["median_s"]
        r["flags"] = timing_flags(r, by_key.get(("none", None, r["batch"], r["compiled"])))
    return rows


def _package_version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def format_report(report: dict[str, Any]) -> str:
    """The report as a plain-text table with a header of the conditions."""
    lines = [
        f"toma bench: {report['description']} ({report['parameters'] / 1e9:.2f}B parameters), "
        f"{report['resolution']}x{report['resolution']}, {report['dtype']}, {report['device']} "
        f"({report['device_name']}), {report['threads']} torch threads",
        f"  {report['steps_per_sample']} forward(s) per sample, {report['repeats']} timed samples per variant "
        f"after {report['warmup']} warm-up, interleaved"
        + ("; CPU time of this process" if report.get("clock") == "cpu" else "")
        + f"; placement {report['placement']}",
    ]
    if report.get("host") == "comfyui":
        lines.append(f"  host: ComfyUI {report.get('comfyui_version') or '(version unknown)'}, the ToMA node's patch")
    before, after = report.get("load_average_before"), report.get("load_average_after")
    if before and after:
        busy = max(before[0], after[0]) > (report["cpu_count"] or 1)
        lines.append(
            f"  load average {before[0]:.2f} before, {after[0]:.2f} after (1 minute) on {report['cpu_count']} CPUs"
            + (": more than the CPUs, the timings shared them" if busy else "")
        )
    lines += [f"  note: {n}" for n in report["notes"]]
    lines += [f"  skipped {m}: {why}" for m, why in report["skipped"].items()]
    if report["interrupted"]:
        lines.append("  INTERRUPTED: partial results")
    head = (
        f"{'method':<16}{'ratio':>6}{'batch':>6}{'median s':>10}{'min s':>9}{'max s':>9}{'n':>3}"
        f"{'speedup':>9}{'effic.':>8}{'eff/min':>8}{'overhead':>10}  select/weights/merge/unmerge"
    )
    lines += ["", head, "-" * len(head)]
    for r in report["results"]:
        ov = r["overhead"] or {}
        parts = "/".join(cell(ov.get(p, 0) * 100 if ov else None, "{:.1f}") for p in OVERHEAD_PARTS) if ov else ""
        name = r["method"] + ("+compile" if r["compiled"] else "")
        line = (
            f"{name:<16}{cell(r['ratio'], '{:g}'):>6}{r['batch']:>6}{r['median_s']:>10.3f}{r['min_s']:>9.3f}"
            f"{r['max_s']:>9.3f}{len(r['times_s']):>3}{cell(r['speedup'], '{:.3f}x'):>9}"
            f"{cell(None if r['efficiency'] is None else r['efficiency'] * 100, '{:.0f}%'):>8}"
            f"{cell(None if r.get('efficiency_min') is None else r['efficiency_min'] * 100, '{:.0f}%'):>8}"
            f"{cell(ov.get('total', 0) * 100 if ov else None, '{:.2f}%'):>10}  {parts}"
        )
        extra = [f"{k}={v:.2f}" for k, v in r.items() if k.startswith("vs_batch")]
        lines.append(line + ("  " + " ".join(extra) if extra else ""))
    counted = [r for r in report["results"] if r.get("kernels") is not None]
    if counted:
        lines.append(
            "kernels per forward (batch {}): ".format(counted[0]["batch"])
            + "; ".join(
                (r["method"] if r["ratio"] is None else f"{r['method']}@{r['ratio']:g}")
                + " "
                + (
                    f"{r['extra_kernels']:+d}"
                    if r["method"] != "none" and r.get("extra_kernels") is not None
                    else str(r["kernels"])
                )
                for r in counted
            )
        )
    flagged = [r for r in report["results"] if r.get("flags")]
    for r in flagged:
        name = r["method"] if r["ratio"] is None else f"{r['method']}@{r['ratio']:g}"
        lines.append(f"UNRELIABLE {name} (batch {r['batch']}): " + "; ".join(r["flags"]))
    if flagged:
        lines.append("  the machine was too noisy for these rows: more --repeats, --threads 1, or a quiet machine help")
    lines.append("")
    lines.append(
        "speedup = unpatched median / median; efficiency = (unpatched - method) / (unpatched - ideal) at the "
        "same ratio, from medians (effic.) and from the fastest samples (eff/min, the least disturbed on a "
        "shared machine); overhead = profiled share of one forward (% of it) in selection, weights, merge, "
        "unmerge; kernels = ATen ops that launch a kernel (views excluded), unpatched in full, others as "
        "the number they add"
    )
    return "\n".join(lines)


def write_outputs(report: dict[str, Any], out: Path, name: str | None = None) -> list[Path]:
    """Write ``<name>.json`` and ``<name>.png`` (latency against ratio) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    stem = name or f"bench_{report['arch']}_{report['resolution']}"
    paths = [write_json(out / f"{stem}.json", report)]
    png = out / f"{stem}.png"
    if plot_report(report, png):
        paths.append(png)
    return paths


def plot_report(report: dict[str, Any], path: Path) -> bool:
    """Plot median latency against ratio, one line per method (first batch size, eager);
    with a single ratio, one bar per method.

    Returns False (and writes nothing) when matplotlib is missing or nothing was measured.
    """
    try:
        plt = pyplot()
    except ImportError:
        return False
    batch = report["batches"][0]
    rows = [r for r in report["results"] if r["batch"] == batch and not r["compiled"]]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ratios = sorted({r["ratio"] for r in rows if r["ratio"] is not None}) or [0.0]
    title = f"{report['arch']} {report['resolution']}px {report['dtype']} {report['device']} batch {batch}"
    if len(ratios) == 1:
        # a ratio axis with one value spreads the methods' small sideways offsets over the
        # whole width, which reads as a trend; bars compare the methods as they are
        _bars(ax, rows)
        ax.set_title(f"{title}, ratio {ratios[0]:g}", fontsize=10)
        save_figure(fig, path)
        return True
    for method in METHODS:
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["ratio"] or 0)
        if not mine:
            continue
        if method == "none":
            ax.axhline(mine[0]["median_s"], color="gray", linestyle="--", label="none (unpatched)")
            continue
        # a small sideways offset per method keeps error bars at the same ratio apart
        shift = 0.006 * (METHODS.index(method) - 2.5)
        xs = [r["ratio"] + shift for r in mine]
        ax.errorbar(
            xs,
            [r["median_s"] for r in mine],
            yerr=[[r["median_s"] - r["min_s"] for r in mine], [r["max_s"] - r["median_s"] for r in mine]],
            marker="o",
            capsize=3,
            label=method,
        )
    ax.set_xticks(ratios)
    ax.set_xlabel("merge ratio (fraction of tokens removed)")
    ax.set_ylabel("seconds per denoiser forward (median)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)
    return True


def _bars(ax: Any, rows: list[dict[str, Any]]) -> None:
    """One bar per method (median seconds, whiskers from min to max), in the report's method order."""
    ordered = sorted(rows, key=lambda r: method_order(r["method"]))
    xs = range(len(ordered))
    medians = [r["median_s"] for r in ordered]
    colours = ["gray" if r["method"] == "none" else f"C{METHODS.index(split_method(r['method'])[0])}" for r in ordered]
    ax.bar(
        xs,
        medians,
        color=colours,
        yerr=[[r["median_s"] - r["min_s"] for r in ordered], [r["max_s"] - r["median_s"] for r in ordered]],
        capsize=4,
    )
    ax.set_xticks(list(xs), [("none (unpatched)" if r["method"] == "none" else r["method"]) for r in ordered])
    for x, r in zip(xs, ordered):
        if r.get("speedup") and r["method"] != "none":
            ax.annotate(
                f"{r['speedup']:.2f}x",
                (x, r["max_s"]),
                textcoords="offset points",
                xytext=(0, 3),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_ylabel("seconds per denoiser forward (median, min-max)")
    ax.grid(alpha=0.3, axis="y")
