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

``--host comfyui`` times ComfyUI's own model classes instead (``--arch flux``, ``wan``,
``sdxl``, ``zimage``): unpatched, the ToMA node's patch and the ideal (:mod:`toma.tools.bench.comfyui`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

# nothing here imports torch at module level: the CLI builds this parser for ``--help``
from toma.tools.archs import ARCHS, DEPTH_KEYS, get_arch, latent_frames
from toma.tools.bench.constants import CACHES, CLOCK_NAMES, HOSTS, METHODS, split_method
from toma.tools.common.options import DTYPES, TILE_SIZE_HELP, check_tile_size, parse_tile_size
from toma.tools.common.report import check_output, missing_extra, wrote


DEFAULT_METHODS = "none,toma,tomesd,ideal"
# what --host comfyui times (toma.tools.bench.comfyui.COMFY_METHODS, kept here without torch)
COMFY_METHODS = ("none", "toma", "ideal")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand."""
    from toma.tools.cli import HelpFormatter

    p = subparsers.add_parser(
        "bench",
        help="time denoiser forwards: ToMA vs unpatched, tomesd, ToDo and the ideal",
        description=__doc__.split("\n\n")[0] + " Nothing is downloaded.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--arch", choices=sorted(ARCHS), help="denoiser architecture (required unless --from-json)")
    p.add_argument(
        "--host",
        choices=HOSTS,
        default="diffusers",
        help="whose model classes are timed: diffusers', or ComfyUI's own (flux, wan, sdxl, zimage; the ToMA "
        "node's patch; tiny-flux, tiny-wan, tiny-unet, tiny-zimage for tests)",
    )
    p.add_argument(
        "--comfyui",
        default=None,
        metavar="PATH",
        help="--host comfyui: the ComfyUI checkout to import, where none is imported yet (default: $TOMA_COMFYUI)",
    )
    p.add_argument(
        "--blocks",
        default=None,
        help="--host comfyui: the node's blocks input, e.g. 'double:all single:0-9' or 'levels:1,2' (default: "
        "every block of a DiT, the node's default levels of a UNet)",
    )
    p.add_argument(
        "--text-tokens",
        type=int,
        default=None,
        help="--host comfyui: prompt tokens (default: the arch's, 512 for Flux, Wan and Z-Image, 77 for SDXL)",
    )
    p.add_argument("--resolution", type=int, default=None, help="image side in pixels (default: the arch's native)")
    p.add_argument("--ratios", default="0.25,0.5,0.75", help="comma-separated merge ratios")
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated, from {','.join(METHODS)}, each optionally with a diffusers cache "
        f"(+{', +'.join(CACHES)}; transformers only), e.g. none+fbcache,toma+fbcache (default: "
        f"{DEFAULT_METHODS}; --host comfyui: {','.join(COMFY_METHODS)}, its only ones)",
    )
    p.add_argument(
        "--fbcache-threshold",
        type=float,
        default=None,
        help="+fbcache: relative change of the first block's residual under which later blocks are "
        "skipped (default: diffusers' FirstBlockCacheConfig default)",
    )
    p.add_argument("--steps", type=int, default=1, help="denoiser forwards (falling timesteps) per timed sample")
    p.add_argument("--repeats", type=int, default=3, help="timed samples per variant, interleaved")
    p.add_argument("--warmup", type=int, default=1, help="untimed samples per variant first")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes (2 = a CFG batch)")
    p.add_argument(
        "--dtype", default="auto", help="float32, bfloat16 or float16 (auto: float32 on CPU, bfloat16 on CUDA)"
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--model", default=None, help="local path or cached hub id with real weights (never downloaded)")
    p.add_argument(
        "--depth",
        type=int,
        default=1,
        help="transformers: build DEPTH times fewer blocks at full width (merged blocks scale with them); "
        "--host comfyui: Flux's and Wan's blocks, Z-Image's main layers, and SDXL's 10 per block at 1/4 of the latent",
    )
    p.add_argument(
        "--frames",
        type=int,
        default=None,
        help="video: frames in pixels, 1 + 4k (MiniMax H3: 17k + 5) (default: the arch's)",
    )
    p.add_argument(
        "--levels",
        type=int,
        default=None,
        help="UNet: attention levels merged, from the highest resolution (default 1)",
    )
    p.add_argument("--merge-mlp", action="store_true", help="merge the MLPs too")
    p.add_argument(
        "--tile-size", type=parse_tile_size, default="auto", help=TILE_SIZE_HELP + " (also sets the ideal's K)"
    )
    p.add_argument(
        "--tile-frames",
        type=int,
        default=None,
        help="video: frames a tile spans (default 1: 2-D tiles; 2: spatio-temporal)",
    )
    p.add_argument("--share-batch-plan", action="store_true", help="ToMA: one plan for the whole batch")
    p.add_argument(
        "--recompute-every", type=int, default=None, help="ToMA: fresh plans every this many steps (default 1)"
    )
    p.add_argument(
        "--proportional-attention",
        dest="proportional_attention",
        action="store_true",
        default=None,
        help="ToMA: log-mass bias in merged self-attention (default: ToMAConfig's: on for UNets, and for "
        "transformers on the CPU; off on GPUs until measured there)",
    )
    p.add_argument(
        "--no-proportional-attention",
        dest="proportional_attention",
        action="store_false",
        default=None,
        help="ToMA: no log-mass bias in merged self-attention",
    )
    p.add_argument(
        "--tomesd-max-downsample",
        type=int,
        default=None,
        help="tomesd max_downsample (default: the UNet levels ToMA merges)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time none and toma under torch.compile, each compiled once, in the same interleaved rounds as "
        "the eager rows",
    )
    p.add_argument(
        "--freezing",
        action="store_true",
        help="with --compile: compile with inductor's freezing (weights prepacked; PyTorch's advice for "
        "CPU inference, where inductor's convolutions are otherwise slower than eager's)",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="CUDA only: capture each variant's forward once as a CUDA graph and time its replays "
        "(no Python or kernel-launch overhead, as in a graph-captured or compiled deployment); "
        "variants that cannot be captured are reported as skipped (tomesd, which draws from "
        "a private CUDA generator)",
    )
    p.add_argument(
        "--no-profile",
        action="store_true",
        help="skip the overhead breakdown and kernel-count pass (one more forward per variant)",
    )
    p.add_argument("--out", default="bench-results", help="directory for the JSON and PNG")
    p.add_argument(
        "--name",
        default=None,
        help="file name stem (default: bench_<arch>_<resolution>; --host comfyui: bench_comfyui_<arch>_<resolution>)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    p.add_argument(
        "--clock",
        choices=CLOCK_NAMES,
        default="wall",
        help="wall time, or cpu: the CPU time of this process (steadier on a shared machine at --threads 1; "
        "with more threads it adds theirs up)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--from-json",
        default=None,
        metavar="FILE",
        help="measure nothing: print the table of a saved report (statistics recomputed) and re-plot it",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by the parsed ``args``; returns the exit code."""
    if args.from_json:
        return _rerender(Path(args.from_json), Path(args.out), args.name)
    if args.host == "comfyui":
        return _run_comfyui(args)
    try:
        opts = _options(args)
    except ValueError as err:
        print(f"toma bench: error: {err}", file=sys.stderr)
        return 2
    missing = missing_extra("matplotlib", "bench", "the PNG plot")
    if missing:
        print(f"note: {missing}; writing the JSON only")
    from toma.tools.bench.harness import benchmark

    report = benchmark(**opts, log=print)
    _show_and_write(report, Path(args.out), args.name)
    return 130 if report["interrupted"] else 0


def _rerender(path: Path, out: Path, name: str | None) -> int:
    from toma.tools.bench.report import derive

    try:
        report = json.loads(path.read_text())
        derive(report["results"], report["batches"][0])
    except (OSError, ValueError, KeyError) as err:
        print(f"toma bench: error: --from-json {path}: {err}", file=sys.stderr)
        return 2
    _show_and_write(report, out, name or path.stem)
    return 0


def _show_and_write(report: dict[str, Any], out: Path, name: str | None) -> None:
    from toma.tools.bench.report import format_report, write_outputs

    print(format_report(report))
    print(wrote(write_outputs(report, out, name)))


def _options(args: argparse.Namespace) -> dict[str, Any]:
    if args.arch is None:
        raise ValueError(f"--arch is required (one of {', '.join(sorted(ARCHS))})")
    comfy_only = [
        f"--{n.replace('_', '-')}" for n in ("comfyui", "blocks", "text_tokens") if getattr(args, n) is not None
    ]
    if comfy_only:
        verb = "applies" if len(comfy_only) == 1 else "apply"
        raise ValueError(f"{', '.join(comfy_only)} {verb} to --host comfyui only; got --host {args.host}")
    arch = get_arch(args.arch)
    methods = _split(args.methods or DEFAULT_METHODS, "methods", str)
    bad = [m for m in methods if split_method(m)[0] not in METHODS or split_method(m)[1] not in (None, *CACHES)]
    if bad:
        raise ValueError(
            f"--methods must be drawn from {','.join(METHODS)}, each optionally followed by "
            f"+{' or +'.join(CACHES)}; got {','.join(bad)}"
        )
    if args.fbcache_threshold is not None and not args.fbcache_threshold > 0:
        raise ValueError(f"--fbcache-threshold must be > 0; got {args.fbcache_threshold}")
    ratios = _split(args.ratios, "ratios", float)
    if any(not 0 < r < 1 for r in ratios):
        raise ValueError(f"--ratios must lie in (0, 1); got {args.ratios}")
    batches = _split(args.batch, "batch", int)
    if any(b < 1 for b in batches):
        raise ValueError(f"--batch sizes must be >= 1; got {args.batch}")
    args.levels = 1 if args.levels is None else args.levels
    args.recompute_every = 1 if args.recompute_every is None else args.recompute_every
    for name in ("steps", "repeats", "depth", "levels", "recompute_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    check_tile_size(args.tile_size)
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0; got {args.warmup}")
    if args.depth != 1 and arch.family not in DEPTH_KEYS:
        raise ValueError(
            f"--depth applies to transformers ({', '.join(DEPTH_KEYS)}); got --depth {args.depth} with --arch "
            f"{arch.name}"
        )
    if (args.frames is not None or args.tile_frames is not None) and not arch.frames:
        raise ValueError(f"--frames and --tile-frames apply to video archs; {arch.name} draws images")
    if args.tile_frames is not None and args.tile_frames < 1:
        raise ValueError(f"--tile-frames must be >= 1; got {args.tile_frames}")
    latent_frames(arch, args.frames)  # checks --frames
    device, dtype = _device_and_dtype(args)
    if args.cuda_graph and device.type != "cuda":
        raise ValueError(f"--cuda-graph needs a CUDA device; got --device {device}")
    if args.cuda_graph and args.compile:
        raise ValueError("--cuda-graph and --compile are separate modes: pass one of them")
    if args.freezing and not args.compile:
        raise ValueError("--freezing applies to compiled rows: add --compile")
    _set_threads(args)
    check_output(Path(args.out), "--out", folder=True)  # before minutes of timing
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
        "frames": args.frames,
        "placement": {
            "levels": args.levels,
            "merge_mlp": args.merge_mlp,
            "tile_size": args.tile_size,
            "tile_frames": args.tile_frames,
        },
        "toma_options": {
            "share_batch_plan": args.share_batch_plan,
            "recompute_every": args.recompute_every,
            "proportional_attention": args.proportional_attention,
        },
        "tomesd_max_downsample": args.tomesd_max_downsample,
        "cache_options": {"fbcache": {} if args.fbcache_threshold is None else {"threshold": args.fbcache_threshold}},
        "compile": args.compile,
        "freezing": args.freezing,
        "cuda_graph": args.cuda_graph,
        "profile": not args.no_profile,
        "seed": args.seed,
        "progress": not args.no_progress,
        "clock": args.clock,
    }


def _device_and_dtype(args: argparse.Namespace) -> tuple[Any, Any]:
    """``--device`` and ``--dtype`` as torch objects (auto: CUDA and bfloat16 where there is CUDA)."""
    import torch

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif args.dtype in DTYPES:
        dtype = getattr(torch, DTYPES[args.dtype])
    else:
        raise ValueError(f"--dtype must be one of auto, {', '.join(DTYPES)}; got {args.dtype!r}")
    return device, dtype


def _set_threads(args: argparse.Namespace) -> None:
    """Apply ``--threads``; raises ValueError where it is below 1."""
    import torch

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1; got {args.threads}")
        torch.set_num_threads(args.threads)


# options of the diffusers host that --host comfyui has no use for, with their unset values
_NOT_FOR_COMFYUI = {
    "model": None,
    "levels": None,
    "tile_frames": None,
    "share_batch_plan": False,
    "recompute_every": None,
    "tomesd_max_downsample": None,
    "fbcache_threshold": None,
    "compile": False,
    "freezing": False,
    "cuda_graph": False,
}


def _comfyui_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`toma.tools.bench.comfyui.benchmark_comfyui` from ``args``;
    raises ValueError naming the option for what does not apply to ComfyUI's models or is out
    of range (before ComfyUI is looked for)."""
    from toma.tools.archs.arch import latent_frames as arch_frames

    names = sorted(n for n in ARCHS if n in _comfy_arch_names())
    if args.arch is None:
        raise ValueError(f"--arch is required (with --host comfyui: one of {', '.join(names)})")
    if args.arch not in names:
        raise ValueError(f"--host comfyui has no ComfyUI model for --arch {args.arch}: it builds {', '.join(names)}")
    unused = [f"--{n.replace('_', '-')}" for n, unset in _NOT_FOR_COMFYUI.items() if getattr(args, n) != unset]
    if unused:
        hint = " (the node's levels are --blocks levels:1,2)" if "--levels" in unused else ""
        verb = "does" if len(unused) == 1 else "do"
        raise ValueError(f"{', '.join(unused)} {verb} not apply to --host comfyui{hint}")
    methods = _split(args.methods or ",".join(COMFY_METHODS), "methods", str)
    bad = [m for m in methods if m not in COMFY_METHODS]
    if bad:
        raise ValueError(
            f"--methods with --host comfyui must be drawn from {','.join(COMFY_METHODS)}; got {','.join(bad)}"
        )
    ratios = _split(args.ratios, "ratios", float)
    if any(not 0 < r < 1 for r in ratios):
        raise ValueError(f"--ratios must lie in (0, 1); got {args.ratios}")
    batches = _split(args.batch, "batch", int)
    if any(b < 1 for b in batches):
        raise ValueError(f"--batch sizes must be >= 1; got {args.batch}")
    for name in ("steps", "repeats", "depth"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1; got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0; got {args.warmup}")
    if args.text_tokens is not None and args.text_tokens < 1:
        raise ValueError(f"--text-tokens must be >= 1; got {args.text_tokens}")
    check_tile_size(args.tile_size)
    arch = get_arch(args.arch)
    if args.frames is not None and not arch.frames:
        raise ValueError(f"--frames applies to video archs; {arch.name} draws images")
    arch_frames(arch, args.frames)  # checks --frames
    device, dtype = _device_and_dtype(args)
    _set_threads(args)
    node: dict[str, Any] = {"tile_size": 0 if args.tile_size == "auto" else args.tile_size}
    if args.blocks is not None:
        node["blocks"] = args.blocks
    if args.merge_mlp:
        node["merge_mlp"] = "on"
    if args.proportional_attention is not None:
        node["proportional_attention"] = args.proportional_attention
    check_output(Path(args.out), "--out", folder=True)
    return {
        "arch": args.arch,
        "resolution": args.resolution or arch.resolution,
        "methods": methods,
        "ratios": ratios,
        "batches": batches,
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "dtype": dtype,
        "device": device,
        "depth": args.depth,
        "frames": args.frames,
        "text_tokens": args.text_tokens,
        "node": node,
        "profile": not args.no_profile,
        "seed": args.seed,
        "progress": not args.no_progress,
        "clock": args.clock,
    }


def _comfy_arch_names() -> tuple[str, ...]:
    from toma.tools.bench.comfyui import COMFY_ARCHS

    return tuple(COMFY_ARCHS)


def _run_comfyui(args: argparse.Namespace) -> int:
    """``toma bench --host comfyui``: check the options, find ComfyUI, time, report."""
    try:
        opts = _comfyui_options(args)
        from toma.tools.bench.comfyui import locate_comfyui

        _, where = locate_comfyui(args.comfyui)
    except ValueError as err:
        print(f"toma bench: error: {err}", file=sys.stderr)
        return 2
    print(f"ComfyUI: {where}")
    from toma.tools.bench.comfyui import benchmark_comfyui

    try:
        report = benchmark_comfyui(**opts, log=print)
    except ValueError as err:  # the node's refusal of an input, named there
        print(f"toma bench: error: the ToMA node refused --blocks, --merge-mlp or --tile-size: {err}", file=sys.stderr)
        return 2
    _show_and_write(report, Path(args.out), args.name or f"bench_comfyui_{args.arch}_{opts['resolution']}")
    return 130 if report["interrupted"] else 0


def _split(text: str, name: str, kind: Callable[[str], Any]) -> list[Any]:
    try:
        items = [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be a comma-separated list; got {text!r}") from None
    if not items:
        raise ValueError(f"--{name} must not be empty")
    return list(dict.fromkeys(items))
