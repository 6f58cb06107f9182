"""The options that several commands share: ToMA's settings, device, dtype and threads.

Everything here is torch-free at import: the commands build their parsers from it for
``--help`` without torch, which the functions that need it import when called.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch

# --dtype spellings -> torch dtype names
DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def parse_tile_size(text: str) -> int | str:
    """``--tile-size``: ``auto`` or a side in tokens, as given (:func:`check_tile_size`
    refuses the rest, so that the error is the commands' one line)."""
    try:
        return int(text)
    except ValueError:
        return text


def check_tile_size(value: int | str) -> None:
    """Raise ``ValueError`` naming ``--tile-size`` unless it is ``auto`` or a side >= 1."""
    if value != "auto" and not (isinstance(value, int) and value >= 1):
        raise ValueError(f"--tile-size must be 'auto' or a whole number of tokens >= 1; got {value!r}")


TILE_SIZE_HELP = (
    "ToMA tile side in tokens, or auto (the default): 4, or 2 where a frame has under half the "
    "tokens of its family's default resolution"
)


def add_model_option(p: argparse.ArgumentParser) -> None:
    """``--model``, shared by ``generate`` and ``eval``."""
    p.add_argument(
        "--model",
        default=None,
        help="diffusers pipeline id or local folder, or a built-in model: builtin (the digits UNet, "
        "the default), builtin-dit (the digits Flux transformer) or builtin-video (the moving-digits Wan "
        "transformer)",
    )


def add_frames_option(p: argparse.ArgumentParser) -> None:
    """``--frames``, shared by ``generate`` and ``eval``."""
    p.add_argument(
        "--frames",
        type=int,
        default=None,
        help="video pipelines (Wan, LTX, ...): frames per clip (default: the pipeline's); "
        "generate writes an animated GIF with --out *.gif, else a strip of frames",
    )


def add_toma_options(p: argparse.ArgumentParser) -> None:
    """The ToMA settings shared by ``generate`` and ``eval``."""
    p.add_argument(
        "--selection", default="facility", choices=["facility", "random", "grid"], help="ToMA destination selection"
    )
    p.add_argument("--tile-size", type=parse_tile_size, default="auto", help=TILE_SIZE_HELP)
    p.add_argument(
        "--levels", type=int, default=1, help="UNet attention levels to merge, from the highest resolution (default 1)"
    )
    p.add_argument("--temperature", type=float, default=None, help="ToMA assignment temperature (default: ToMA's)")
    p.add_argument(
        "--proportional-attention",
        dest="proportional_attention",
        action="store_true",
        default=None,
        help="log-mass bias in merged self-attention (default: on for UNets, and for transformers where "
        "it was measured to cost at most 3%% of a forward: on CPU)",
    )
    p.add_argument(
        "--no-proportional-attention",
        dest="proportional_attention",
        action="store_false",
        default=None,
        help="no log-mass bias (the paper's plain merged attention)",
    )
    p.add_argument(
        "--blocks",
        type=parse_blocks,
        default=None,
        metavar="STACK=I,J-K;...",
        help="transformers: blocks that merge, e.g. 'transformer_blocks=0-1;single_transformer_blocks=2,3' "
        "(stacks left out merge nothing; default: the family's rule)",
    )
    p.add_argument(
        "--merge-mlp", action="store_true", default=None, help="also merge the MLPs (feed-forward) of the merged blocks"
    )
    p.add_argument(
        "--mlp-ratio", type=float, default=None, help="ratio for the MLPs (default: the ratio; needs --merge-mlp)"
    )
    p.add_argument(
        "--mlp-levels",
        type=parse_levels,
        default=None,
        metavar="I,J",
        help="UNets: attention levels whose MLPs merge, e.g. 2 (default: every merged level; needs --merge-mlp)",
    )
    p.add_argument(
        "--merge-crossattn",
        action="store_true",
        default=None,
        help="also merge the queries of cross-attention to text (UNets, PixArt, Wan, LTX)",
    )
    p.add_argument(
        "--crossattn-ratio",
        type=float,
        default=None,
        help="ratio for cross-attention queries (default: the ratio; needs --merge-crossattn)",
    )
    p.add_argument(
        "--start-step",
        type=int,
        default=None,
        help="merge only from this denoising step on (0 = the first; earlier steps run unmerged)",
    )
    p.add_argument(
        "--stop-step", type=int, default=None, help="merge only before this denoising step (default: to the end)"
    )


def default_threads(args: argparse.Namespace) -> int | None:
    """Thread count to set: ``--threads``, else 1 for the built-in model, else None (torch's default).

    The built-in model is tiny; on a CPU shared with other jobs, several busy-waiting
    OpenMP threads per process made it several times slower than one thread.
    """
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1; got {args.threads}")
        return args.threads
    return 1 if args.model is None else None


def toma_options(args: argparse.Namespace) -> dict[str, Any]:
    """ToMA keyword options from parsed CLI arguments (only those the user set)."""
    opts: dict[str, Any] = {"tile_size": args.tile_size, "levels": args.levels}
    if args.temperature is not None:
        opts["temperature"] = args.temperature
    if getattr(args, "proportional_attention", None) is not None:
        opts["proportional_attention"] = args.proportional_attention
    for name in (
        "blocks",
        "merge_mlp",
        "mlp_ratio",
        "mlp_levels",
        "merge_crossattn",
        "crossattn_ratio",
        "start_step",
        "stop_step",
    ):
        if getattr(args, name, None) is not None:
            opts[name] = getattr(args, name)
    return opts


def parse_levels(text: str) -> tuple[int, ...]:
    """``"1,2"`` -> ``(1, 2)``; raises ``argparse.ArgumentTypeError`` on anything but comma-separated ints."""
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated level numbers such as 2 or 1,2; got {text!r}"
        ) from None


def parse_blocks(text: str) -> dict[str, tuple[int, ...]]:
    """``"transformer_blocks=0-1;single_transformer_blocks=2,3"`` -> ``{stack: indices}``.

    Indices are comma-separated ints or inclusive ranges ``a-b``; ``stack=`` (nothing after
    the ``=``) merges no block of that stack. Raises ``argparse.ArgumentTypeError`` (shown
    by argparse as an error naming ``--blocks``) on malformed text.
    """
    usage = "--blocks must look like 'transformer_blocks=0-1;single_transformer_blocks=2,3'"
    out: dict[str, tuple[int, ...]] = {}
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        stack, sep, indices = (x.strip() for x in part.partition("="))
        if not sep or not stack or stack in out:
            raise argparse.ArgumentTypeError(f"{usage}; got {text!r}")
        chosen: list[int] = []
        for item in (i.strip() for i in indices.split(",") if i.strip()):
            lo, dash, hi = item.partition("-")
            try:
                first, last = (int(lo), int(hi)) if dash else (int(item), int(item))
            except ValueError:
                raise argparse.ArgumentTypeError(f"{usage} (indices are ints or ranges a-b); got {item!r}") from None
            if first < 0 or last < first:
                raise argparse.ArgumentTypeError(f"{usage} (indices >= 0, ranges a-b with a <= b); got {item!r}")
            chosen.extend(range(first, last + 1))
        out[stack] = tuple(dict.fromkeys(chosen))
    if not out:
        raise argparse.ArgumentTypeError(f"{usage}; got {text!r}")
    return out


def validate_toma_options(args: argparse.Namespace, ratios: Sequence[float]) -> None:
    """Check the ToMA settings before any generation; raises ``ValueError``/``TypeError``."""
    from toma import ToMAConfig

    check_tile_size(args.tile_size)
    for ratio in ratios:
        ToMAConfig(ratio=ratio, selection=args.selection, **toma_options(args))


def resolve_device_dtype(device: str | None, dtype: str) -> tuple[str, torch.dtype]:
    """Default device (cuda if available) and dtype (float16 on cuda, float32 on cpu)."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "auto":
        return device, (torch.float16 if device.startswith("cuda") else torch.float32)
    return device, getattr(torch, dtype)
