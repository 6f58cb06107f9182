"""``toma bench``: denoiser latency of ToMA side by side with peers and the ideal.

Builds a full-size denoiser from its config with random weights (or loads real weights
with ``--model``), then times denoiser forwards for every method and ratio in one
process, interleaved round by round after a warm-up, so that a slow spell of a shared
machine hits every method alike. Reports per method and ratio the median/min/max time,
the speedup over the unpatched model and the efficiency (the share of the ideal's time
saving the method captures), plus a profiler breakdown of the merge overhead. Writes JSON
and a PNG plot of latency against ratio.

Methods: ``none`` (unpatched), ``toma``, ``tomesd`` (peer, optional extra), ``ideal``
(ToMA's placement and token counts at zero merge cost, see :mod:`toma.tools.baselines`) and
``todo`` (key/value downsampling, UNet only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from toma import __version__
from toma.tools.archs import (
    ARCHS,
    Arch,
    build_model,
    call_denoiser,
    count_parameters,
    flux_merged_blocks,
    get_arch,
    make_inputs,
    set_timestep,
)
from toma.tools.opcount import count_kernels

METHODS = ("none", "toma", "tomesd", "ideal", "todo")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
OVERHEAD_PARTS = ("select", "weights", "merge", "unmerge")


@dataclass(frozen=True)
class Variant:
    """One timed configuration: a method at a ratio (None for the unpatched model)."""

    method: str
    ratio: float | None
    compiled: bool = False

    @property
    def label(self) -> str:
        """Readable name, e.g. ``toma@0.5`` or ``none+compile``."""
        name = self.method if self.ratio is None else f"{self.method}@{self.ratio:g}"
        return name + ("+compile" if self.compiled else "")


@dataclass
class Measurement:
    """Per-forward seconds of one variant at one batch size, and its overhead profile."""

    variant: Variant
    batch: int
    times: list[float] = field(default_factory=list)
    overhead: dict[str, float] | None = None  # part -> share of the forward
    kernels: int | None = None  # kernel-launching ops in one forward


# ----------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand."""
    p = subparsers.add_parser(
        "bench",
        help="time denoiser forwards: ToMA vs unpatched, tomesd, ToDo and the ideal",
        description=__doc__.split("\n\n")[0] + " Nothing is downloaded.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--arch", choices=sorted(ARCHS), help="denoiser architecture (required unless --from-json)")
    p.add_argument("--resolution", type=int, default=None, help="image side in pixels (default: the arch's native)")
    p.add_argument("--ratios", default="0.25,0.5,0.75", help="comma-separated merge ratios")
    p.add_argument("--methods", default="none,toma,tomesd,ideal", help=f"comma-separated, from {','.join(METHODS)}")
    p.add_argument("--steps", type=int, default=1, help="denoiser forwards (falling timesteps) per timed sample")
    p.add_argument("--repeats", type=int, default=3, help="timed samples per variant, interleaved")
    p.add_argument("--warmup", type=int, default=1, help="untimed samples per variant first")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes (2 = a CFG batch)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16 or float16 (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--model", default=None, help="local path or cached hub id with real weights (never downloaded)")
    p.add_argument("--depth", type=int, default=1, help="Flux: build DEPTH times fewer blocks at full width")
    p.add_argument("--levels", type=int, default=1, help="UNet: attention levels merged, from the highest resolution")
    p.add_argument("--merge-mlp", action="store_true", help="UNet: merge the MLPs too")
    p.add_argument("--tile-size", type=int, default=4, help="ToMA tile side in tokens (also sets the ideal's K)")
    p.add_argument("--share-batch-plan", action="store_true", help="ToMA: one plan for the whole batch")
    p.add_argument("--recompute-every", type=int, default=1, help="ToMA: fresh plans every this many steps")
    p.add_argument("--proportional-attention", dest="proportional_attention", action="store_true", default=None,
                   help="ToMA: log-mass bias in merged self-attention (default: on for UNets, off for Flux)")
    p.add_argument("--no-proportional-attention", dest="proportional_attention", action="store_false", default=None,
                   help="ToMA: no log-mass bias in merged self-attention")
    p.add_argument("--tomesd-max-downsample", type=int, default=None,
                   help="tomesd max_downsample (default: the UNet levels ToMA merges)")
    p.add_argument("--compile", action="store_true",
                   help="also time none and toma under torch.compile (after the eager rounds, not interleaved)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="CUDA only: capture each variant's forward once as a CUDA graph and time its replays "
                        "(no Python or kernel-launch overhead, as in a graph-captured or compiled deployment); "
                        "variants that cannot be captured are reported as skipped (tomesd, which draws from "
                        "a private CUDA generator)")
    p.add_argument("--no-profile", action="store_true",
                   help="skip the overhead breakdown and kernel-count pass (one more forward per variant)")
    p.add_argument("--out", default="bench-results", help="directory for the JSON and PNG")
    p.add_argument("--name", default=None, help="file name stem (default: bench_<arch>_<resolution>)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="measure nothing: print the table of a saved report (statistics recomputed) and re-plot it")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by the parsed ``args``; returns the exit code."""
    if args.from_json:
        return _rerender(Path(args.from_json), Path(args.out), args.name)
    try:
        opts = _options(args)
    except ValueError as err:
        print(f"toma bench: error: {err}", file=sys.stderr)
        return 2
    report = benchmark(**opts, log=print)
    print(format_report(report))
    paths = write_outputs(report, Path(args.out), args.name)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 130 if report["interrupted"] else 0


def _rerender(path: Path, out: Path, name: str | None) -> int:
    try:
        report = json.loads(path.read_text())
        derive(report["results"], report["batches"][0])
    except (OSError, ValueError, KeyError) as err:
        print(f"toma bench: error: --from-json {path}: {err}", file=sys.stderr)
        return 2
    print(format_report(report))
    paths = write_outputs(report, out, name or path.stem)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _options(args: argparse.Namespace) -> dict[str, Any]:
    if args.arch is None:
        raise ValueError(f"--arch is required (one of {', '.join(sorted(ARCHS))})")
    arch = get_arch(args.arch)
    methods = _split(args.methods, "methods", str)
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ValueError(f"--methods must be drawn from {','.join(METHODS)}; got {','.join(bad)}")
    ratios = _split(args.ratios, "ratios", float)
    if any(not 0 < r < 1 for r in ratios):
        raise ValueError(f"--ratios must lie in (0, 1); got {args.ratios}")
    batches = _split(args.batch, "batch", int)
    if any(b < 1 for b in batches):
        raise ValueError(f"--batch sizes must be >= 1; got {args.batch}")
    for name in ("steps", "repeats", "depth", "levels", "tile_size", "recompute_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0; got {args.warmup}")
    if args.depth != 1 and arch.family != "flux":
        raise ValueError(f"--depth applies to Flux only; got --depth {args.depth} with --arch {arch.name}")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif args.dtype in DTYPES:
        dtype = DTYPES[args.dtype]
    else:
        raise ValueError(f"--dtype must be one of auto, {', '.join(DTYPES)}; got {args.dtype!r}")
    if args.cuda_graph and device.type != "cuda":
        raise ValueError(f"--cuda-graph needs a CUDA device; got --device {device}")
    if args.cuda_graph and args.compile:
        raise ValueError("--cuda-graph and --compile are separate modes: pass one of them")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1; got {args.threads}")
        torch.set_num_threads(args.threads)
    return {
        "arch": arch,
        "resolution": args.resolution or arch.resolution,
        "methods": methods,
        "ratios": ratios,
        "batches": batches,
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "dtype": dtype,
        "device": device,
        "model_path": args.model,
        "depth": args.depth,
        "placement": {"levels": args.levels, "merge_mlp": args.merge_mlp, "tile_size": args.tile_size},
        "toma_options": {"share_batch_plan": args.share_batch_plan, "recompute_every": args.recompute_every,
                         "proportional_attention": args.proportional_attention},
        "tomesd_max_downsample": args.tomesd_max_downsample,
        "compile": args.compile,
        "cuda_graph": args.cuda_graph,
        "profile": not args.no_profile,
        "seed": args.seed,
        "progress": not args.no_progress,
    }


def _split(text: str, name: str, kind: Callable[[str], Any]) -> list[Any]:
    try:
        items = [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be a comma-separated list; got {text!r}") from None
    if not items:
        raise ValueError(f"--{name} must not be empty")
    return list(dict.fromkeys(items))


# ----------------------------------------------------------------------------- harness


class _Methods:
    """Applies and removes each method on one model."""

    def __init__(self, model: torch.nn.Module, arch: Arch, placement: dict[str, Any],
                 toma_options: dict[str, Any], tomesd_max_downsample: int | None) -> None:
        self.model = model
        self.arch = arch
        self.placement = dict(placement)
        if arch.family == "flux":
            self.placement = {
                "tile_size": placement["tile_size"],
                "flux_double_blocks": flux_merged_blocks(len(model.transformer_blocks), ARCHS["flux"].config["num_layers"]),
                "flux_single_blocks": flux_merged_blocks(
                    len(model.single_transformer_blocks), ARCHS["flux"].config["num_single_layers"]
                ),
            }
        self.toma_options = toma_options
        self.tomesd_max_downsample = tomesd_max_downsample

    def unavailable(self, method: str) -> str | None:
        """Why ``method`` cannot run here, or None."""
        from toma.tools.baselines import tomesd_available

        if method in ("tomesd", "todo") and self.arch.family != "unet":
            return f"{method} supports UNets only"
        if method == "tomesd" and not tomesd_available():
            return "tomesd is not installed (pip install 'toma-diffusion[peers]')"
        return None

    def apply(self, variant: Variant) -> dict[str, Any]:
        """Patch the model for ``variant``; returns the settings in force."""
        import toma
        from toma.tools import baselines

        r, m = variant.ratio, variant.method
        if m == "none":
            return {}
        if m == "toma":
            patch = toma.apply_toma(self.model, ratio=r, **self.placement, **self.toma_options)
            return {"merged_modules": len(patch.patched), **patch.config.to_dict()}
        if m == "ideal":
            patch = baselines.apply_ideal(self.model, r, **self.placement)
        elif m == "todo":
            patch = baselines.apply_todo(self.model, r, **self.placement)
        else:
            patch = baselines.apply_tomesd(self.model, r, self.tomesd_max_downsample, **self.placement)
        return {"merged_modules": len(patch.patched), **patch.settings}

    def remove(self) -> None:
        """Undo whatever is applied."""
        import toma
        from toma.tools import baselines

        toma.remove_toma(self.model)
        baselines.remove_baseline(self.model)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_sample(call: Callable[[dict[str, Any]], Any], inputs: list[dict[str, Any]], device: torch.device) -> float:
    """Seconds per forward over one run of ``len(inputs)`` consecutive steps."""
    _sync(device)
    start = time.perf_counter()
    for step_inputs in inputs:
        call(step_inputs)
    _sync(device)
    return (time.perf_counter() - start) / len(inputs)


def _profile_forward(call: Callable[[dict[str, Any]], Any], inputs: dict[str, Any], device: torch.device,
                     method: str) -> dict[str, float]:
    """Share of one forward spent in each overhead part of ``method``, from profiler ranges."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from toma.tools.baselines import tomesd_profiled

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with tomesd_profiled(), profile(activities=activities) as prof:
        with record_function("bench::forward"):
            call(inputs)
        _sync(device)
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        # on CUDA the device time is what counts; CPU ranges then only measure launches
        us = max(event.cpu_time_total, getattr(event, "device_time_total", 0.0) or 0.0)
        totals[event.key] = totals.get(event.key, 0.0) + us
    forward = totals.get("bench::forward", 0.0)
    if forward <= 0:
        return {}
    prefix = {"toma": "toma", "ideal": "ideal", "todo": "todo", "tomesd": "tomesd"}[method]
    shares = {part: totals.get(f"{prefix}::{part}", 0.0) / forward for part in OVERHEAD_PARTS}
    shares["total"] = sum(shares.values())
    return shares


def benchmark(
    arch: Arch,
    resolution: int,
    methods: list[str],
    ratios: list[float],
    batches: list[int] = (1,),  # type: ignore[assignment]
    steps: int = 1,
    repeats: int = 3,
    warmup: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    model_path: str | None = None,
    depth: int = 1,
    placement: dict[str, Any] | None = None,
    toma_options: dict[str, Any] | None = None,
    tomesd_max_downsample: int | None = None,
    compile: bool = False,
    cuda_graph: bool = False,
    profile: bool = True,
    seed: int = 0,
    progress: bool = False,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Time every method side by side on one denoiser; returns the report dict.

    Each timed sample is ``steps`` consecutive denoiser forwards with falling timesteps
    (a fresh denoising run each sample), reported as seconds per forward. Variants are
    timed round-robin (with the order rotated every round) after ``warmup`` untimed
    samples each. With ``cuda_graph`` every variant's forward is captured once as a CUDA
    graph (on the first step's inputs) and a sample times ``steps`` replays of it. Ctrl-C
    stops the rounds and returns what was measured, with ``report["interrupted"] = True``.
    """
    device = torch.device(device)
    placement = {"levels": 1, "merge_mlp": False, "tile_size": 4, **(placement or {})}
    toma_options = dict(toma_options or {})
    notes: list[str] = []
    log(f"building {arch.description} ({'weights from ' + model_path if model_path else 'random weights'}) "
        f"in {str(dtype).replace('torch.', '')} on {device}")
    model = build_model(arch, depth=depth, model_path=model_path, dtype=dtype, device=device, seed=seed)
    if arch.family == "flux" and depth != 1:
        notes.append(
            f"Flux at full width but reduced depth: {len(model.transformer_blocks)} double-stream and "
            f"{len(model.single_transformer_blocks)} single-stream blocks (--depth {depth}; the full model has "
            f"{arch.config['num_layers']} and {arch.config['num_single_layers']})"
        )
    harness = _Methods(model, arch, placement, toma_options, tomesd_max_downsample)
    skipped: dict[str, str] = {}
    variants = [Variant("none", None)] if "none" in methods else []
    for m in methods:
        if m == "none":
            continue
        why = harness.unavailable(m)
        if why:
            skipped[m] = why
            log(f"skipping {m}: {why}")
            continue
        variants += [Variant(m, r) for r in ratios]
    step_inputs = {
        b: [set_timestep(arch, make_inputs(arch, resolution, b, dtype, device, seed), s, steps) for s in range(steps)]
        for b in batches
    }

    def call(inputs: dict[str, Any]) -> Any:
        return call_denoiser(arch, model, inputs)

    settings: dict[str, Any] = {}
    graphs: dict[tuple[Variant, int], Callable[[], None]] = {}
    if cuda_graph:
        notes.append("timed as CUDA graph replays of one captured forward per variant (no Python or launch overhead)")
        with torch.inference_mode():
            variants = _capture_graphs(harness, call, variants, batches, step_inputs, device, graphs, settings,
                                       skipped, log)
    results = {(v, b): Measurement(v, b) for v in variants for b in batches}
    interrupted = False
    total = len(variants) * len(batches) * (warmup + repeats)
    bar = _progress(total, progress)
    try:
        with torch.inference_mode():
            for rnd in range(warmup + repeats):
                order = variants[rnd % len(variants):] + variants[: rnd % len(variants)] if variants else []
                for v in order:
                    if not cuda_graph:
                        settings[v.label] = harness.apply(v)
                    try:
                        for b in batches:
                            bar.set_postfix_str(f"{v.label} b{b} {'warm-up' if rnd < warmup else f'round {rnd - warmup + 1}'}")
                            if cuda_graph:
                                replay = graphs[(v, b)]
                                t = _time_sample(lambda _: replay(), step_inputs[b], device)
                            else:
                                t = _time_sample(call, step_inputs[b], device)
                            if rnd >= warmup:
                                results[(v, b)].times.append(t)
                            bar.update(1)
                    finally:
                        harness.remove()
            if profile:
                for v in variants:
                    bar.set_postfix_str(f"profiling {v.label}")
                    harness.apply(v)
                    try:
                        first = step_inputs[batches[0]][0]
                        results[(v, batches[0])].kernels = sum(count_kernels(lambda: call(first)).values())
                        if v.method != "none":
                            results[(v, batches[0])].overhead = _profile_forward(call, first, device, v.method)
                    finally:
                        harness.remove()
            if compile:
                results.update(_compiled(harness, call, variants, batches, step_inputs, warmup, repeats, device, log))
    except KeyboardInterrupt:
        interrupted = True
        harness.remove()
        log("interrupted: reporting what was measured so far")
    finally:
        bar.close()
    report = _report(arch, model, resolution, dtype, device, depth, steps, repeats, warmup, methods, ratios, batches,
                     harness, settings, skipped, notes, results, interrupted, compile)
    report["cuda_graph"] = cuda_graph
    return report


def _capture_graphs(harness: _Methods, call: Callable[[dict[str, Any]], Any], variants: list[Variant],
                    batches: list[int], step_inputs: dict[int, list[dict[str, Any]]], device: torch.device,
                    graphs: dict[tuple[Variant, int], Callable[[], None]], settings: dict[str, Any],
                    skipped: dict[str, str], log: Callable[[str], None]) -> list[Variant]:
    """Capture one CUDA graph per variant and batch into ``graphs``; returns the variants captured.

    A variant whose forward cannot be captured (it synchronises with the host, say) is
    reported in ``skipped`` instead of stopping the benchmark.
    """
    kept = []
    for v in variants:
        settings[v.label] = harness.apply(v)
        try:
            for b in batches:
                graphs[(v, b)] = _capture(call, step_inputs[b][0], device)
            kept.append(v)
        except RuntimeError as err:
            skipped[v.label] = f"CUDA graph capture failed: {str(err).splitlines()[0]}"
            log(f"skipping {v.label}: {skipped[v.label]}")
            torch.cuda.synchronize(device)
        finally:
            harness.remove()
    return kept


def _capture(call: Callable[[dict[str, Any]], Any], inputs: dict[str, Any], device: torch.device) -> Callable[[], None]:
    """Record ``call(inputs)`` as a CUDA graph; returns its replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-ups off the default stream, as capture requires
        for _ in range(2):
            call(inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(inputs)
    return graph.replay


def _compiled(harness: _Methods, call: Callable[[dict[str, Any]], Any], variants: list[Variant], batches: list[int],
              step_inputs: dict[int, list[dict[str, Any]]], warmup: int, repeats: int, device: torch.device,
              log: Callable[[str], None]) -> dict[tuple[Variant, int], Measurement]:
    """Time ``none`` and ``toma`` (first ratio) under torch.compile, one after the other."""
    picked = [v for v in variants if v.method == "none"][:1] + [v for v in variants if v.method == "toma"][:1]
    out: dict[tuple[Variant, int], Measurement] = {}
    for v in picked:
        cv = Variant(v.method, v.ratio, compiled=True)
        harness.apply(v)
        try:
            torch._dynamo.reset()
            compiled = torch.compile(harness.model)

            def ccall(inputs: dict[str, Any]) -> Any:
                return call_denoiser(harness.arch, compiled, inputs)

            for b in batches:
                start = time.perf_counter()
                # two warm-ups at least: the first step compiles, the second settles the guards
                for _ in range(max(warmup, 2)):
                    _time_sample(ccall, step_inputs[b], device)
                log(f"{cv.label} b{b}: compiled and warmed up in {time.perf_counter() - start:.1f}s")
                m = out[(cv, b)] = Measurement(cv, b)
                for _ in range(repeats):
                    m.times.append(_time_sample(ccall, step_inputs[b], device))
        finally:
            harness.remove()
            torch._dynamo.reset()
    return out


class _NoBar:
    def update(self, n: int) -> None: ...
    def set_postfix_str(self, s: str) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="toma bench", unit="sample", file=sys.stderr, dynamic_ncols=True)


# ----------------------------------------------------------------------------- report


def _report(arch: Arch, model: torch.nn.Module, resolution: int, dtype: torch.dtype, device: torch.device,
            depth: int, steps: int, repeats: int, warmup: int, methods: list[str], ratios: list[float],
            batches: list[int], harness: _Methods, settings: dict[str, Any], skipped: dict[str, str],
            notes: list[str], results: dict[tuple[Variant, int], Measurement], interrupted: bool,
            compiled: bool) -> dict[str, Any]:
    rows = [
        {
            "method": v.method,
            "ratio": v.ratio,
            "batch": b,
            "compiled": v.compiled,
            "times_s": m.times,
            "overhead": m.overhead,
            "kernels": m.kernels,
            "settings": settings.get(v.label),
        }
        for (v, b), m in results.items()
        if m.times
    ]
    derive(rows, batches[0])
    placement = dict(harness.placement)
    if "tomesd" in methods and "tomesd" not in skipped:
        from toma.tools.baselines import tomesd_max_downsample

        placement["tomesd_max_downsample"] = harness.tomesd_max_downsample or tomesd_max_downsample(
            model, **harness.placement
        )
    return {
        "toma_version": __version__,
        "arch": arch.name,
        "description": arch.description,
        "parameters": count_parameters(model),
        "resolution": resolution,
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "diffusers": _version("diffusers"),
        "tomesd": _version("tomesd"),
        "depth": depth,
        "blocks": _blocks(model, arch),
        "steps_per_sample": steps,
        "repeats": repeats,
        "warmup": warmup,
        "methods": methods,
        "ratios": ratios,
        "batches": batches,
        "placement": placement,
        "toma_options": harness.toma_options,
        "skipped": skipped,
        "notes": notes,
        "compiled": compiled,
        "interrupted": interrupted,
        "results": sorted(rows, key=lambda r: (r["compiled"], r["batch"], r["ratio"] or 0, METHODS.index(r["method"]))),
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
            usable = b is not None and i is not None and r["ratio"] is not None and b - i > 0
            r["efficiency" + suffix] = (b - t) / (b - i) if usable else None
        if r.get("kernels") is not None and base and base.get("kernels") is not None:
            r["extra_kernels"] = r["kernels"] - base["kernels"]
        first = by_key.get((r["method"], r["ratio"], first_batch, r["compiled"]))
        if r["batch"] != first_batch and first:
            r[f"vs_batch{first_batch}"] = r["median_s"] / first["median_s"]
    return rows


def _blocks(model: torch.nn.Module, arch: Arch) -> dict[str, int]:
    if arch.family == "flux":
        return {"double": len(model.transformer_blocks), "single": len(model.single_transformer_blocks)}
    from diffusers.models.attention import BasicTransformerBlock

    return {"transformer_blocks": sum(isinstance(m, BasicTransformerBlock) for m in model.modules())}


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:{spec}}{suffix}"


def format_report(report: dict[str, Any]) -> str:
    """The report as a plain-text table with a header of the conditions."""
    lines = [
        f"toma bench: {report['description']} ({report['parameters'] / 1e9:.2f}B parameters), "
        f"{report['resolution']}x{report['resolution']}, {report['dtype']}, {report['device']} "
        f"({report['device_name']}), {report['threads']} torch threads",
        f"  {report['steps_per_sample']} forward(s) per sample, {report['repeats']} timed samples per variant "
        f"after {report['warmup']} warm-up, interleaved; placement {report['placement']}",
    ]
    lines += [f"  note: {n}" for n in report["notes"]]
    lines += [f"  skipped {m}: {why}" for m, why in report["skipped"].items()]
    if report["interrupted"]:
        lines.append("  INTERRUPTED: partial results")
    head = (f"{'method':<16}{'ratio':>6}{'batch':>6}{'median s':>10}{'min s':>9}{'max s':>9}{'n':>3}"
            f"{'speedup':>9}{'effic.':>8}{'eff/min':>8}{'overhead':>10}  select/weights/merge/unmerge")
    lines += ["", head, "-" * len(head)]
    for r in report["results"]:
        ov = r["overhead"] or {}
        parts = "/".join(_fmt(ov.get(p, 0) * 100 if ov else None, ".1f") for p in OVERHEAD_PARTS) if ov else ""
        name = r["method"] + ("+compile" if r["compiled"] else "")
        line = (f"{name:<16}{_fmt(r['ratio'], 'g'):>6}{r['batch']:>6}{r['median_s']:>10.3f}{r['min_s']:>9.3f}"
                f"{r['max_s']:>9.3f}{len(r['times_s']):>3}{_fmt(r['speedup'], '.3f', 'x'):>9}"
                f"{_fmt(None if r['efficiency'] is None else r['efficiency'] * 100, '.0f', '%'):>8}"
                f"{_fmt(None if r.get('efficiency_min') is None else r['efficiency_min'] * 100, '.0f', '%'):>8}"
                f"{_fmt(ov.get('total', 0) * 100 if ov else None, '.2f', '%'):>10}  {parts}")
        extra = [f"{k}={v:.2f}" for k, v in r.items() if k.startswith("vs_batch")]
        lines.append(line + ("  " + " ".join(extra) if extra else ""))
    counted = [r for r in report["results"] if r.get("kernels") is not None]
    if counted:
        lines.append("kernels per forward (batch {}): ".format(counted[0]["batch"]) + "; ".join(
            (r["method"] if r["ratio"] is None else f"{r['method']}@{r['ratio']:g}") + " "
            + (f"{r['extra_kernels']:+d}" if r["method"] != "none" and r.get("extra_kernels") is not None
               else str(r["kernels"]))
            for r in counted
        ))
    lines.append("")
    lines.append("speedup = unpatched median / median; efficiency = (unpatched - method) / (unpatched - ideal) at the "
                 "same ratio, from medians (effic.) and from the fastest samples (eff/min, the least disturbed on a "
                 "shared machine); overhead = profiled share of one forward (% of it) in selection, weights, merge, "
                 "unmerge; kernels = ATen ops that launch a kernel (views excluded), unpatched in full, others as "
                 "the number they add")
    return "\n".join(lines)


def write_outputs(report: dict[str, Any], out: Path, name: str | None = None) -> list[Path]:
    """Write ``<name>.json`` and ``<name>.png`` (latency against ratio) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    stem = name or f"bench_{report['arch']}_{report['resolution']}"
    paths = [out / f"{stem}.json"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    png = out / f"{stem}.png"
    if plot_report(report, png):
        paths.append(png)
    return paths


def plot_report(report: dict[str, Any], path: Path) -> bool:
    """Plot median latency against ratio, one line per method (first batch size, eager).

    Returns False (and writes nothing) when matplotlib is missing or nothing was measured.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    batch = report["batches"][0]
    rows = [r for r in report["results"] if r["batch"] == batch and not r["compiled"]]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ratios = sorted({r["ratio"] for r in rows if r["ratio"] is not None}) or [0.0]
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
        ax.errorbar(xs, [r["median_s"] for r in mine],
                    yerr=[[r["median_s"] - r["min_s"] for r in mine], [r["max_s"] - r["median_s"] for r in mine]],
                    marker="o", capsize=3, label=method)
    ax.set_xticks(ratios)
    ax.set_xlabel("merge ratio (fraction of tokens removed)")
    ax.set_ylabel("seconds per denoiser forward (median)")
    ax.set_title(f"{report['arch']} {report['resolution']}px {report['dtype']} {report['device']} batch {batch}",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
