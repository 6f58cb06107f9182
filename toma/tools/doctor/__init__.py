"""``toma doctor``: does toma's merge path work on this machine, and how fast is it here?

Prints the versions that matter (toma, Python, torch with its CUDA or ROCm, triton,
diffusers), the device with its compute capability (or AMD ISA) and the row of toma's GPU
target table it matches, and which merge path runs there (Triton kernels or torch) and why.
Then it checks, one line per check:

* the torch path: plans on tokens built so that the right destinations are known, and
  merges and unmerges (with and without the block's residual) against a float64
  reference that does its own tile indexing, in fp16, bf16 and fp32;
* the Triton kernels, where they run (a GPU, or ``--kernels triton`` under
  ``TRITON_INTERPRET=1`` on the CPU): the plan kernel's similarities, greedy and weights,
  its destinations against the torch greedy's, and the merge and unmerge kernels against
  the torch path on the same plan; a kernel that falls back to the torch path is reported;
* a merged attention against the unmerged one (timings, speed-up, output difference),
  with and without proportional attention's log-mass key bias;
* every attention backend diffusers' ``set_attention_backend`` offers here, on merged
  tokens, with and without that bias, against torch's SDPA.

Ends with one verdict line; the exit status is 1 when a check failed, 2 for bad arguments.
Every tolerance is derived from the dtype's rounding (see toma/tools/doctor/numerics.py).
On the CPU the default sizes are smaller where a check would be slow; the output says what ran.
"""

from __future__ import annotations

import argparse
from typing import Any

# nothing here imports torch: ``toma doctor --help`` answers without it

DTYPE_NAMES = {
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}
KERNEL_CHOICES = ("auto", "torch", "triton")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``doctor`` subcommand."""
    from toma.tools.cli import HelpFormatter

    p = subparsers.add_parser(
        "doctor",
        help="check that toma's GPU path (kernels, merges, attention backends) works on this machine",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (a GPU if torch sees one)")
    p.add_argument(
        "--kernels",
        choices=KERNEL_CHOICES,
        default=None,
        help="TOMA_KERNELS for this run (default: the environment's, else auto); triton on the CPU "
        "runs the kernels in Triton's interpreter, slowly: keep --grid and --channels small",
    )
    p.add_argument(
        "--grid",
        type=grid_size,
        default=None,
        help="token grid of the merge checks, N or HxW (default 64; 8 in Triton's interpreter)",
    )
    p.add_argument(
        "--channels",
        type=positive_int,
        default=None,
        help="channels of the merge checks (default 3072, Flux's width; 320 on the CPU, 32 in Triton's interpreter)",
    )
    p.add_argument("--batch", type=positive_int, default=2, help="batch of the merge checks")
    p.add_argument("--tile", type=positive_int, default=4, help="tile side in tokens")
    p.add_argument("--ratio", type=merge_ratio, default=0.5, help="merge ratio, in [0, 1)")
    p.add_argument(
        "--dtypes",
        type=dtype_list,
        default="fp16,bf16,fp32",
        help="comma-separated dtypes of the merge and kernel checks, from fp16, bf16, fp32",
    )
    p.add_argument(
        "--attn-grid",
        type=grid_size,
        default=None,
        help="token grid of the attention checks (default 64, Flux at 1024px: 4096 tokens; 32 on the CPU, "
        "8 in Triton's interpreter)",
    )
    p.add_argument(
        "--heads",
        type=positive_int,
        default=None,
        help="attention heads (default 24, Flux's; 2 in Triton's interpreter)",
    )
    p.add_argument(
        "--head-dim",
        type=positive_int,
        default=None,
        help="channels per head (default 128, Flux's; 16 in Triton's interpreter)",
    )
    p.add_argument("--attn-batch", type=positive_int, default=1, help="batch of the attention checks")
    p.add_argument(
        "--attn-dtype",
        type=single_dtype,
        default=None,
        help="dtype of the attention checks (default bf16 on a GPU, fp32 on the CPU)",
    )
    p.add_argument(
        "--backends", default="all", help="comma-separated diffusers attention backends to try, or all, or none"
    )
    p.add_argument(
        "--hub-backends",
        action="store_true",
        help="also try the backends whose kernels diffusers downloads from the Hugging Face Hub "
        "(not tried otherwise: the doctor downloads nothing)",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="timed runs per measurement, the median reported (default 5 on a GPU, 3 on the CPU)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument(
        "--json", dest="json_path", default=None, metavar="PATH", help="write the full report as JSON to PATH"
    )
    p.add_argument(
        "--models",
        action="store_true",
        help="print the model families toma merges and what each supports (toma.supported()), then exit "
        "without running the checks",
    )
    p.set_defaults(func=_run)


def positive_int(text: str) -> int:
    """A whole number of at least 1 (argparse puts the option's name before the message)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def grid_size(text: str) -> tuple[int, int]:
    """``N`` (a square grid) or ``HxW`` as ``(H, W)``, both sides at least 1."""
    parts = text.lower().replace("*", "x").split("x")
    try:
        sides = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or HxW (e.g. 64 or 48x80), got {text!r}") from None
    if len(sides) == 1:
        sides = sides * 2
    if len(sides) != 2 or min(sides) < 1:
        raise argparse.ArgumentTypeError(f"expected N or HxW with sides of at least 1, got {text!r}")
    return sides[0], sides[1]


def merge_ratio(text: str) -> float:
    """A merge ratio in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value:g}")
    return value


def single_dtype(text: str) -> str:
    """One dtype name (fp16, bf16, fp32 or their torch spellings) as torch's name."""
    name = DTYPE_NAMES.get(text.strip().lower())
    if name is None:
        raise argparse.ArgumentTypeError(f"expected one of fp16, bf16, fp32, got {text!r}")
    return name


def dtype_list(text: str) -> tuple[str, ...]:
    """Comma-separated dtype names as torch's names, in order, without repeats."""
    names = [single_dtype(part) for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected at least one of fp16, bf16, fp32")
    return tuple(dict.fromkeys(names))


def _run(args: argparse.Namespace) -> Any:
    if args.models:
        from toma.support import format_table, supported

        families = supported()
        print(f"toma merges {len(families)} model families (docs/models.md):")
        print(format_table(families))
        return 0
    from toma.tools.doctor.checks import run

    return run(args)
