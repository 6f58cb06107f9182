"""Unpatched, ToMA and the ideal timed by the CPU time of the process, interleaved round by round.

On a CPU shared by more runnable jobs than cores, wall time mostly measures how long the
scheduler kept this job waiting (``toma bench`` then flags its rows as unreliable). With
one torch thread, the CPU time the process spends is its own work, which the others can
only inflate through shared caches and memory bandwidth, alike for every method of a
round. Same model, inputs, placement (the default blocks scaled to ``--depth``) and
methods as ``toma bench``; one forward per sample:

    python benchmarks/cpu_time_ab.py --arch cogvideox --depth 42 --resolution 480 --frames 9 --rounds 3

With ``--compile`` every method is also timed under ``torch.compile`` (inductor), in the
same interleaved rounds as the eager ones. Each method then patches its own copy of the
model (sharing the weights, so memory stays that of one model) and each copy is compiled
once, before the rounds, rather than recompiled whenever a round applies its method:

    python benchmarks/cpu_time_ab.py --arch sd15 --resolution 512 --rounds 3 --compile [--freezing]

With ``--separate-adds`` (UNets, eager) a fourth variant, ``toma-separate``, runs ToMA with
each merged sub-module unmerging on its own and the block adding its residual after, as
before the blocks' fused residual forward (:mod:`toma.adapters.residual`):

    python benchmarks/cpu_time_ab.py --arch sdxl --resolution 1024 --rounds 3 --set levels=2 --separate-adds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable

import torch

from toma.config import parse_option
from toma.tools.archs import build_model, call_denoiser, default_placement, get_arch, make_inputs
from toma.tools.bench.harness import MethodPatcher, Variant, compile_variants, weight_sharing_copy

METHODS = ("none", "toma", "ideal")


# profiler op names (eager ATen ops; inductor's fused kernels are named after the ATen ops
# they fuse) -> region, first match wins
REGIONS = (
    ("attention (SDPA)", ("scaled_dot_product", "flash_attention")),
    ("bmm (merge, unmerge, similarity)", ("aten::bmm",)),
    ("linear (mm)", ("aten::mm", "aten::addmm")),
    ("convolution", ("convolution",)),
    ("greedy selection (compiled)", ("argmax",)),
)


def region_of(name: str) -> str:
    """The region an op or kernel of the profile belongs to (see :data:`REGIONS`)."""
    for region, keys in REGIONS:
        if any(k in name for k in keys):
            return region
    if "cpp_fused" in name:
        return "other inductor kernels"
    return "other eager ops" if name.startswith("aten::") else "other (Python, runtime)"


def profile_regions(call) -> dict[str, float]:
    """Milliseconds of one ``call()`` by region: the profiler's self time of every op in it.

    The profiler times ops by the clock while they run on the thread, so on a loaded machine
    these are inflated alike for every region: compare shares, not totals.
    """
    from torch.profiler import profile

    with torch.inference_mode(), profile() as prof:
        call()
    shares: dict[str, float] = {}
    for event in prof.key_averages():
        region = region_of(event.key)
        shares[region] = shares.get(region, 0.0) + event.self_cpu_time_total / 1e3
    return shares


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", required=True)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--resolution", type=int, default=None)
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1, help="batch size of the inputs (2 = a CFG batch)")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time every method under torch.compile (inductor), interleaved with the eager ones",
    )
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated subset of none,toma,ideal (none is always timed; efficiency needs ideal)",
    )
    parser.add_argument(
        "--freezing",
        action="store_true",
        help="with --compile: inductor's freezing (weights as constants, prepacked for the CPU's "
        "convolution and matmul libraries), PyTorch's advice for CPU inference",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the rounds, profile one forward of each variant and print its time by region",
    )
    parser.add_argument(
        "--separate-adds",
        action="store_true",
        help="also time ToMA with unmerge and residual add as two kernels (toma-separate; UNets, eager)",
    )
    parser.add_argument("--out", default=None, help="JSON file for the raw samples")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="OPTION=VALUE",
        help="override a placement option of toma and the ideal, e.g. --set levels=2 --set merge_mlp=True "
        "(VALUE is a Python literal); repeatable",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1; got {args.rounds}")
    if args.batch < 1:
        parser.error(f"--batch must be >= 1; got {args.batch}")
    methods = tuple(dict.fromkeys(["none", *args.methods.split(",")]))
    if not set(methods) <= set(METHODS):
        parser.error(f"--methods takes a subset of {','.join(METHODS)}; got {args.methods!r}")
    if args.freezing and not args.compile:
        parser.error("--freezing needs --compile")
    if args.separate_adds and args.compile:
        parser.error("--separate-adds times eager forwards only; drop --compile")
    torch.set_num_threads(1)  # CPU time equals work only with one thread
    if args.profile:  # inductor's kernels then show in the profile under their own names
        from torch._inductor import config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True

    arch = get_arch(args.arch)
    resolution = args.resolution or arch.resolution
    model = build_model(arch, depth=args.depth)
    inputs = make_inputs(arch, resolution, args.batch, frames=args.frames)
    placement = {**default_placement(arch, model), **dict(parse_setting(text) for text in args.set)}
    print(f"placement: {placement}", flush=True)
    if args.compile:
        # a model each, patched once: a compiled model must keep the patch it was compiled with
        picked = [Variant(m, None if m == "none" else args.ratio) for m in methods]
        calls: dict[str, Callable[[dict], object]] = {}
        for v in picked:
            copy_ = weight_sharing_copy(model)
            MethodPatcher(copy_, arch, placement, {}, None).apply(v)
            calls[v.method] = lambda inputs, copy_=copy_: call_denoiser(arch, copy_, inputs)
        with torch.inference_mode():
            compiled = compile_variants(
                MethodPatcher(model, arch, placement, {}, None),
                picked,
                [args.batch],
                {args.batch: [inputs]},
                0,
                torch.device("cpu"),
                print,
                args.freezing,
            )
        calls.update({f"{cv.method}+compile": call for cv, call in compiled.items()})
        variants = (*methods, *(f"{m}+compile" for m in methods))
    else:
        patcher = MethodPatcher(model, arch, placement, {}, None)
        variants = (*methods, "toma-separate") if args.separate_adds else methods
    samples: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    usage: dict[str, list[list[float]]] = {v: [] for v in variants}
    graphs = _graph_count()
    for round_ in range(args.rounds + 1):
        shift = round_ % len(variants)
        order = variants[shift:] + variants[:shift]  # each variant leads a round in turn
        for v in order:
            if not args.compile:
                apply_variant(patcher, v, args.ratio)
            with torch.inference_mode():
                use = _usage()
                cpu, wall = time.process_time(), time.perf_counter()
                calls[v](inputs) if args.compile else call_denoiser(arch, model, inputs)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                use = [b - a for a, b in zip(use, _usage())]
            if not args.compile:
                patcher.remove()
            if round_:  # the first round warms up
                samples[v].append((cpu, wall))
                usage[v].append(use)
            split = f" (user {use[0]:.2f}, system {use[1]:.2f}, {use[2]:.0f} page faults)" if use else ""
            print(f"round {round_} {v}: cpu {cpu:.2f} s{split}, wall {wall:.2f} s", flush=True)

    if _graph_count() != graphs:  # a timed sample then included compiling
        print(f"warning: {_graph_count() - graphs} graphs were compiled during the timed rounds")
    cpu = {v: statistics.median(c for c, _ in samples[v]) for v in variants}
    print(
        f"{args.arch} depth {args.depth} {resolution}p frames {args.frames} batch {args.batch}: "
        f"medians of {args.rounds} CPU-time samples"
    )
    for v in variants:
        base, _, compiled = v.partition("+")
        none, ideal = (f"none+{compiled}", f"ideal+{compiled}") if compiled else ("none", "ideal")
        eff = (
            ""
            if base == "none" or ideal not in cpu
            else f", efficiency {(cpu[none] - cpu[v]) / (cpu[none] - cpu[ideal]):.0%}"
        )
        print(f"  {v:14s} {cpu[v]:8.2f} s  speedup {cpu[none] / cpu[v]:.3f}x{eff}")
    if args.compile:
        print("  compiled/eager time: " + ", ".join(f"{m} {cpu[m + '+compile'] / cpu[m]:.3f}" for m in methods))
    if all(usage[v] and usage[v][0] for v in variants):
        print("  medians of user s, system s and minor page faults:")
        for v in variants:
            user, system, faults = (statistics.median(u[i] for u in usage[v]) for i in range(3))
            print(f"  {v:14s} {user:8.2f} {system:8.2f} {faults:12.0f}")
    regions: dict[str, dict[str, float]] = {}
    if args.profile:
        for v in variants:
            if not args.compile:
                apply_variant(patcher, v, args.ratio)
            regions[v] = profile_regions(
                lambda: calls[v](inputs) if args.compile else call_denoiser(arch, model, inputs)
            )
            if not args.compile:
                patcher.remove()
        names = sorted(
            {r for shares in regions.values() for r in shares}, key=lambda r: -regions[variants[0]].get(r, 0)
        )
        print("profiler ms of one forward by region (self time of its ops; inflated by the machine's load):")
        print(f"  {'region':34s}" + "".join(f"{v:>15s}" for v in variants))
        for r in names:
            print(f"  {r:34s}" + "".join(f"{regions[v].get(r, 0.0):15.1f}" for v in variants))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "arch": args.arch,
                    "depth": args.depth,
                    "resolution": resolution,
                    "frames": args.frames,
                    "batch": args.batch,
                    "ratio": args.ratio,
                    "compile": args.compile,
                    "placement": {k: repr(v) for k, v in placement.items()},
                    "samples_cpu_wall_s": samples,
                    # per sample: user and system CPU s, minor page faults (empty without getrusage)
                    "samples_user_system_faults": usage,
                    "median_cpu_s": cpu,
                    "profile_regions_ms": regions,
                },
                f,
                indent=1,
            )


def _usage() -> list[float]:
    """The process's user and system CPU seconds and minor page faults so far, or nothing
    where there is no ``getrusage`` (Windows). The system time is mostly the kernel mapping
    fresh pages: the allocator returns tensors larger than its mmap threshold (32 MB at most,
    glibc) to the system when freed, and the next one of that size faults every page in."""
    try:
        import resource
    except ImportError:
        return []
    use = resource.getrusage(resource.RUSAGE_SELF)
    return [use.ru_utime, use.ru_stime, float(use.ru_minflt)]


def apply_variant(patcher: MethodPatcher, variant: str, ratio: float) -> None:
    """Patch the eager model with ``variant`` (a method, or ``toma-separate``: ToMA with UNet
    blocks keeping their own forward, so that unmerge and the block's add are two kernels)."""
    method = variant.removesuffix("-separate")
    with _separate_adds(variant != method):
        patcher.apply(Variant(method, None if method == "none" else ratio))


@contextlib.contextmanager
def _separate_adds(on: bool):
    """While on, ToMA's UNet blocks keep their own forward (unmerge, then the block's add)."""
    if not on:
        yield
        return
    from toma.adapters import unet

    fusable, unet.fusable = unet.fusable, lambda block: False
    try:
        yield
    finally:
        unet.fusable = fusable


def parse_setting(text: str) -> tuple[str, object]:
    """``"levels=2"`` -> ``("levels", 2)`` (:func:`toma.config.parse_option`), exiting on a bad one."""
    try:
        return parse_option(text)
    except ValueError as err:
        raise SystemExit(f"--set: {err}") from None


if __name__ == "__main__":
    main()
