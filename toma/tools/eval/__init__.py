"""``toma eval``: quality and speed of token merging against unmerged generation.

Every method generates from the same seeds and classes (built-in models: the digits UNet
by default, ``--model builtin-dit`` for the digits Flux transformer) or prompts
(``--model`` pipelines). Per method and ratio it reports PSNR and SSIM of the merged images
against the unmerged ones and the latency per image; on the built-in model also the digit
classifier's accuracy and a Frechet distance on its features; on pipelines, when asked,
CLIP-T, DINO similarity to the unmerged image and a Frechet distance to reference images.

Methods: ``none`` (unmerged reference), ``toma`` (facility-location selection),
``toma-random`` and ``toma-grid`` (ToMA's merge with random / grid destinations) and
``tomesd`` (ToMeSD, if installed; UNets only). On transformers, ``METHOD+CACHE`` stacks a
step cache with a method (``none+cachedit`` is the cache alone): FirstBlockCache,
TaylorSeer, cache-dit's DBCache or DBPrune, optionally at a threshold (``+fbcache:0.1``).

Outputs in ``--out-dir``: ``results.json``, ``results.md``, ``quality_vs_speedup.png`` and
``samples.png``. Under ``accelerate launch`` the images are split across processes (data
parallel) and the results merged on the main process.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

# torch-free imports only: the CLI builds this parser for ``--help``; ``run`` loads the rest
from toma.tools.common.options import (
    add_model_option,
    add_frames_option,
    add_toma_options,
    default_threads,
    resolve_device_dtype,
    toma_options,
    validate_toma_options,
)
from toma.tools.common.pipelines import PipelineUnavailableError, check_model_name
from toma.tools.common.report import check_output, load_average, missing_extra
from toma.tools.eval.caches import CACHES, split_method
from toma.tools.eval.constants import DEFAULT_CLIP_MODEL, DEFAULT_DINO_MODEL, METHODS


def register(subparsers: Any) -> None:
    """Add the ``eval`` subcommand to the CLI."""
    from toma.tools.cli import HelpFormatter

    p = subparsers.add_parser(
        "eval",
        help="compare merging methods against unmerged generation (quality and speed)",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add_model_option(p)
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated, from {', '.join(METHODS)} (none is always run as the reference; "
        "default: all that apply to the model, tomesd only to UNets); on transformers a method "
        f"may add a step cache, METHOD+CACHE[:THRESHOLD] with CACHE one of {', '.join(CACHES)} "
        "(cache-dit's cachedit and dbprune need cache-dit installed), e.g. "
        "none+fbcache:0.05,toma+fbcache:0.05,toma+cachedit",
    )
    p.add_argument("--ratios", default="0.5", help="comma-separated merge ratios in [0, 1) (default 0.5)")
    p.add_argument("--num-images", type=int, default=100, help="images per method and ratio (default 100)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: 20 built-in, 30 pipelines)")
    p.add_argument("--seed", type=int, default=0, help="image i uses seed SEED+i")
    p.add_argument("--batch-size", type=int, default=50, help="built-in models: images per denoiser batch")
    p.add_argument("--out-dir", type=Path, default=Path("toma_eval"), help="output folder (default toma_eval)")
    add_toma_options(p)
    p.add_argument("--guidance-scale", type=float, default=None, help="classifier-free guidance (default: model's)")
    p.add_argument("--prompts", type=Path, default=None, help="pipelines: text file, one prompt per line")
    p.add_argument("--height", type=int, default=None, help="pipelines: image height")
    add_frames_option(p)
    p.add_argument("--width", type=int, default=None, help="pipelines: image width")
    p.add_argument("--clip", action="store_true", help="pipelines: report CLIP-T (needs local CLIP weights)")
    p.add_argument("--clip-model", default=DEFAULT_CLIP_MODEL, help="pipelines: CLIP model id or folder for --clip")
    p.add_argument("--dino", action="store_true", help="pipelines: report DINO similarity to the unmerged image")
    p.add_argument("--dino-model", default=DEFAULT_DINO_MODEL, help="pipelines: DINOv2 model id or folder for --dino")
    p.add_argument(
        "--fid-reference",
        type=Path,
        default=None,
        help="pipelines: folder of reference images; reports the Frechet distance on DINO features",
    )
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads per process (default: 1 for the built-in model; for pipelines CPU cores / processes)",
    )
    p.add_argument(
        "--builtin-path",
        type=Path,
        default=None,
        help="folder written by scripts/train_builtin.py, or by train_builtin_dit.py / train_builtin_video.py "
        "for builtin-dit / builtin-video "
        "(default: the copy in the package)",
    )
    p.set_defaults(func=run)


# ---------------------------------------------------------------------------- options


def parse_methods(text: str) -> list[str]:
    """Validated method list with ``none`` first; raises ``ValueError`` naming ``--methods``.

    A method may name a step cache after ``+`` (``toma+fbcache``, ``none+cachedit:0.12``):
    see :mod:`toma.tools.eval.caches`.
    """
    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if split_method(m)[0] not in METHODS]
    if bad or not methods:
        raise ValueError(
            f"--methods must be a comma-separated subset of {', '.join(METHODS)}, each optionally "
            f"+CACHE or +CACHE:THRESHOLD with CACHE one of {', '.join(CACHES)}; got {text!r}"
        )
    return ["none"] + [m for m in dict.fromkeys(methods) if m != "none"]


def parse_ratios(text: str) -> list[float]:
    """Validated ratio list; raises ``ValueError`` naming ``--ratios``."""
    try:
        ratios = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--ratios must be comma-separated numbers in [0, 1); got {text!r}") from None
    if not ratios or any(not 0.0 < r < 1.0 for r in ratios):
        raise ValueError(f"--ratios must be comma-separated numbers in (0, 1); got {text!r}")
    return list(dict.fromkeys(ratios))


# ---------------------------------------------------------------------------- entry point


def run(args: argparse.Namespace) -> int:
    """Entry point of ``toma eval``; returns the exit code."""
    import torch

    from toma.tools.builtin import BUILTIN_MODELS, builtin_name, check_blocks, check_methods
    from toma.tools.eval.builtin import eval_builtin, summarise_builtin
    from toma.tools.eval.harness import init_processes, tomesd_available, variants
    from toma.tools.eval.metrics import MissingWeightsError
    from toma.tools.eval.pipeline import eval_pipeline, summarise_pipeline
    from toma.tools.eval.report import machine_info, write_outputs

    # a built-in model is named by args.builtin; args.model stays for pipelines only
    args.builtin = builtin_name(args.model)
    if args.builtin is not None:
        args.model = None
    try:
        if args.methods is None:
            default = BUILTIN_MODELS[args.builtin].methods if args.builtin else METHODS
            args.methods = ",".join(default)
        methods = parse_methods(args.methods)
        if args.builtin is not None:
            check_methods(args.builtin, methods)
            check_blocks(args.builtin, args.blocks)
        ratios = parse_ratios(args.ratios)
        if args.num_images < 1:
            raise ValueError(f"--num-images must be >= 1; got {args.num_images}")
        if args.steps is not None and args.steps < 1:
            raise ValueError(f"--steps must be >= 1; got {args.steps}")
        default_threads(args)  # validates --threads
        if args.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1; got {args.batch_size}")
        validate_toma_options(args, ratios)
        if args.model is None and (args.clip or args.dino or args.fid_reference):
            raise ValueError(
                "--clip, --dino and --fid-reference apply to --model pipelines; "
                "the built-in model reports classifier accuracy and FD instead"
            )
        if args.model is not None:
            check_model_name(args.model, [n for n in BUILTIN_MODELS if n != "builtin"])
        if args.prompts is not None:
            # caught here, before the pipeline loads and the output folder is made
            if args.model is None:
                raise ValueError("--prompts applies to --model pipelines; the built-in models draw digits by class")
            if not args.prompts.is_file():
                raise ValueError(f"--prompts file {args.prompts} does not exist (a text file, one prompt per line)")
        check_output(args.out_dir, "--out-dir", folder=True)  # before the whole run
        missing = missing_extra("matplotlib", "eval", "toma eval's quality_vs_speedup.png")
        if missing:
            raise ValueError(missing)
    except (ValueError, TypeError, PipelineUnavailableError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if "tomesd" in methods and not tomesd_available():
        why = missing_extra("tomesd", "peers", "the tomesd method") or "tomesd cannot be imported"
        print(f"note: {why}; skipping the tomesd method", file=sys.stderr)
        methods.remove("tomesd")

    procs = init_processes(cpu=args.model is None or resolve_device_dtype(args.device, args.dtype)[0] == "cpu")
    threads = default_threads(args)
    if threads is None and procs.world > 1:
        threads = max(1, (os.cpu_count() or 1) // procs.world)
    if threads is not None:
        torch.set_num_threads(threads)
    runs = variants(methods, ratios)
    load_before = load_average()
    try:
        records = eval_pipeline(args, procs, runs) if args.model else eval_builtin(args, procs, runs)
    except (PipelineUnavailableError, MissingWeightsError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    gathered = procs.gather(records)
    if procs.is_main:
        try:
            rows = summarise_pipeline(gathered, runs, args) if args.model else summarise_builtin(gathered, runs)
        except (MissingWeightsError, FileNotFoundError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        meta = {
            "model": args.model or BUILTIN_MODELS[args.builtin].title,
            "methods": methods,
            "ratios": ratios,
            "num_images": args.num_images,
            "steps": args.steps or (30 if args.model else 20),
            "seed": args.seed,
            "toma_options": toma_options(args),
            "guidance_scale": gathered[0].get("_guidance_scale", args.guidance_scale),
            "arguments": {
                k: (v if isinstance(v, (int, float, bool, type(None))) else str(v))
                for k, v in vars(args).items()
                if k != "func"
            },
            "machine": {
                **machine_info(procs),
                "load_average_before": load_before,
                "load_average_after": load_average(),
            },
        }
        write_outputs(args, rows, meta, gathered, runs)
    procs.barrier()
    return 0
