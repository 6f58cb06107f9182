"""``toma tune``: find the fastest ToMA setting for this machine, model, resolution and batch.

Times a short list of candidate settings (levels or blocks merged, attention only or with
the MLP, ratios, per-part MLP ratios) side by side with the unpatched denoiser, interleaved
round by round with ``toma bench``'s harness, checks each candidate's fidelity against the
unpatched model on the same inputs, prints a table, and writes the fastest setting within
the quality bound as a config file for ``apply_toma(pipe, config=toma.load_config(path))``.
Every measurement is also recorded (``$TOMA_CACHE_DIR/tune.json``, default
``~/.cache/toma/tune.json``) so that ``apply_toma`` can warn about a setting measured slower.

Quality check: on the built-in model (the default) the PSNR of a few images sampled with
its DDIM sampler (``--check-images``, ``--check-steps``) against the unpatched images from
the same seeds; on ``--arch``/``--model`` the PSNR of the denoiser's output on the timed
inputs (random latents and text, one forward per ``--steps`` timestep) against the
unpatched output, with the unpatched output's range as peak. With random weights
(``--arch`` without ``--model``) that PSNR says little about images.

Exit status: 0 when a config was written; 1 when no candidate within the bound was faster
than unpatched (no config is written, the table says why); 2 for bad arguments; 130 when
interrupted (a config is still written from what was measured, marked as interrupted).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from toma.tools.archs import ARCHS
from toma.tools.cli import HelpFormatter
from toma.tools.common.options import TILE_SIZE_HELP, parse_tile_size
from toma.tools.tune.constants import DEFAULT_MIN_PSNR

# the subcommand's arguments live here, apart from the measuring in toma.tools.tune.run, so
# that `toma --help` does not import torch


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``tune`` subcommand."""
    p = subparsers.add_parser(
        "tune",
        help="time candidate ToMA settings on this machine and write the fastest within a quality bound",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--arch",
        choices=sorted(ARCHS),
        default=None,
        help="full-size denoiser with random weights, as toma bench (default: the built-in digits UNet)",
    )
    p.add_argument(
        "--model", default=None, help="with --arch: local path or cached hub id with real weights (never downloaded)"
    )
    p.add_argument("--resolution", type=int, default=None, help="image side in pixels (default: the model's native)")
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="denoiser batch size (2 = one image with classifier-free guidance; default 2 built-in, else 1)",
    )
    p.add_argument("--depth", type=int, default=1, help="transformers: build DEPTH times fewer blocks (as toma bench)")
    p.add_argument("--frames", type=int, default=None, help="video archs: frames in pixels, 1 + 4k")
    p.add_argument(
        "--dtype", default="auto", help="float32, bfloat16 or float16 (auto: float32 on CPU, bfloat16 on CUDA)"
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (the built-in model runs on the CPU)")
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: 1 built-in, else torch's choice)"
    )
    p.add_argument("--ratios", default="0.25,0.5,0.75", help="comma-separated merge ratios to try")
    p.add_argument("--levels", default=None, help="UNets: comma-separated attention levels merged to try (default 1,2)")
    p.add_argument(
        "--blocks",
        default=None,
        help="transformers: comma-separated from default (the family's blocks) and all (every block); default both",
    )
    p.add_argument(
        "--parts",
        default=None,
        help="comma-separated merged parts to try, each attn, cross, mlp joined by '+' (default attn,attn+mlp; "
        "Flux: attn)",
    )
    p.add_argument(
        "--mlp-ratios",
        default="same,0.25",
        help="for candidates merging the MLP: its ratios to try, 'same' meaning the candidate's ratio",
    )
    p.add_argument("--tile-size", type=parse_tile_size, default="auto", help=TILE_SIZE_HELP)
    p.add_argument(
        "--min-psnr",
        type=float,
        default=None,
        help=f"quality bound: PSNR against unpatched at least this many dB (default {DEFAULT_MIN_PSNR:g} "
        "unless --max-psnr-drop is given)",
    )
    p.add_argument(
        "--max-psnr-drop",
        type=float,
        default=None,
        help="quality bound: PSNR at most this many dB below that of ToMA's default setting at ratio 0.5",
    )
    p.add_argument("--check-images", type=int, default=10, help="built-in model: images sampled for the quality check")
    p.add_argument("--check-steps", type=int, default=10, help="built-in model: DDIM steps of the quality check")
    p.add_argument("--steps", type=int, default=1, help="denoiser forwards (falling timesteps) per timed sample")
    p.add_argument("--repeats", type=int, default=3, help="timed samples per candidate, interleaved")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop the timing rounds when the next would end later than this many seconds after the model "
        "is built (checks included); at least one timed round runs",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time unpatched and the --compile-top fastest eager candidates within the bound under "
        "torch.compile, and choose among the compiled rows",
    )
    p.add_argument("--compile-top", type=int, default=2, help="with --compile: eager candidates compiled")
    p.add_argument(
        "--freezing",
        action="store_true",
        help="with --compile: compile with inductor's freezing (weights prepacked; PyTorch's advice for CPU inference)",
    )
    p.add_argument("--out", type=Path, default=Path("tuned.json"), help="config file written (JSON)")
    p.add_argument("--no-record", action="store_true", help="do not add the measurements to the tune records")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights, inputs and check samples")
    p.add_argument(
        "--builtin-path", type=Path, default=None, help="folder of the built-in model (default: the package's)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> Any:
    from toma.tools.tune.run import run

    return run(args)
