"""``toma generate``: generate images with and without ToMA and compare their speed.

Without ``--model`` it uses the built-in digits UNet shipped in the package, so it runs
offline right after install; ``--model builtin-dit`` uses the built-in digits Flux
transformer. With ``--model ID_OR_PATH`` it loads a diffusers pipeline
(SD 1.x/2.x, SDXL, Flux, ...) from the local Hugging Face cache or a local folder; it
never downloads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from toma.tools.common.images import BUILTIN_UPSCALE, make_grid, side_by_side
from toma.tools.common.options import (
    add_model_option,
    add_frames_option,
    add_toma_options,
    default_threads,
    resolve_device_dtype,
    toma_options,
    validate_toma_options,
)
from toma.tools.common.pipelines import (
    PipelineUnavailableError,
    call_inputs,
    check_frames,
    check_model_name,
    load_pipeline,
    pipeline_call,
    sync,
    timed,
)
from toma.tools.common.report import IMAGE_SUFFIXES, check_output, load_note

if TYPE_CHECKING:
    import torch

DEFAULT_PROMPT = "a photo of an astronaut riding a horse"
ALL_DIGITS = "0,1,2,3,4,5,6,7,8,9"
# torch loads in the functions that use it: the CLI builds this parser for ``--help`` without it


def register(subparsers: Any) -> None:
    """Add the ``generate`` subcommand to the CLI."""
    from toma.tools.cli import HelpFormatter

    p = subparsers.add_parser(
        "generate",
        help="generate images with and without ToMA (built-in model by default)",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add_model_option(p)
    p.add_argument("--prompt", default=None, help=f"prompt for --model pipelines (default {DEFAULT_PROMPT!r})")
    p.add_argument(
        "--labels", default=None, help=f"built-in models: comma-separated digits to draw (default {ALL_DIGITS})"
    )
    p.add_argument("--ratio", type=float, default=0.5, help="ToMA merge ratio in [0, 1) (default 0.5)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: 20 built-in, 30 pipelines)")
    p.add_argument("--seed", type=int, default=0, help="seed of the starting noise")
    p.add_argument("--out", type=Path, default=Path("toma_generate.png"), help="output PNG (default toma_generate.png)")
    p.add_argument(
        "--compare", action="store_true", help="write the baseline and ToMA images side by side with timings"
    )
    add_toma_options(p)
    p.add_argument("--guidance-scale", type=float, default=None, help="classifier-free guidance (default: model's)")
    p.add_argument("--height", type=int, default=None, help="pipelines: image height")
    p.add_argument("--width", type=int, default=None, help="pipelines: image width")
    add_frames_option(p)
    p.add_argument(
        "--video",
        type=Path,
        default=None,
        help="pipelines whose call takes a `video` (Wan VACE: the control video): an animated GIF passed "
        "as that video, one clip of its frames (--frames defaults to its frame count)",
    )
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="pipelines: weights dtype (auto: float16 on cuda, float32 on cpu)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: 1 for the built-in model, torch's choice for pipelines)",
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


def parse_labels(text: str) -> list[int]:
    """``"0,1,7"`` -> ``[0, 1, 7]``; raises ``ValueError`` naming ``--labels`` on bad input."""
    try:
        labels = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--labels must be comma-separated digits 0-9; got {text!r}") from None
    if not labels or any(not 0 <= v <= 9 for v in labels):
        raise ValueError(f"--labels must be comma-separated digits 0-9; got {text!r}")
    return labels


# ---------------------------------------------------------------------------- built-in


def run_builtin(args: argparse.Namespace) -> int:
    """Generate digits with a built-in model (``args.builtin``), unmerged and with ToMA."""
    from toma import apply_toma, remove_toma
    from toma.tools.builtin import BUILTIN_MODELS, load_sampler

    labels = parse_labels(args.labels or ALL_DIGITS)
    steps = args.steps or 20
    name = getattr(args, "builtin", "builtin")
    model = load_sampler(name, args.builtin_path)
    opts = dict(toma_options(args), selection=args.selection)
    # settings the model cannot take (e.g. --blocks naming a stack it lacks) fail before sampling
    apply_toma(model.denoiser, ratio=args.ratio, **opts)
    remove_toma(model.denoiser)

    def generate(progress: str) -> torch.Tensor:
        # progress: the bar's label, naming the run
        return model.draw(labels, [args.seed + i for i in range(len(labels))], steps, args.guidance_scale, progress)

    def warm_up() -> None:
        # the first calls pay one-off kernel set-up; keep that out of both timings
        model.draw(labels[:1], [args.seed], 1, args.guidance_scale, False)

    warm_up()
    print(f"{BUILTIN_MODELS[name].title}: {len(labels)} images, {steps} steps, seed {args.seed}")
    baseline, t_base = timed(lambda: generate("unmerged"))
    apply_toma(model.denoiser, ratio=args.ratio, **opts)
    try:
        warm_up()
        merged, t_toma = timed(lambda: generate(f"ToMA {args.ratio:g}"))
    finally:
        remove_toma(model.denoiser)
    if merged.dim() == 5:  # clips of the video model
        save_video(args, baseline, merged, t_base / len(labels), t_toma / len(labels), upscale=2 * BUILTIN_UPSCALE)
    else:
        report_and_save(
            args,
            baseline,
            merged,
            t_base,
            t_toma,
            len(labels),
            upscale=BUILTIN_UPSCALE,
            cell_labels=[str(v) for v in labels],
            setting=f"{steps} steps, seed {args.seed}",
        )
    return 0


def report_and_save(
    args: argparse.Namespace,
    baseline: torch.Tensor,
    merged: torch.Tensor,
    t_base: float,
    t_toma: float,
    n: int,
    upscale: int = 1,
    cell_labels: Sequence[str] | None = None,
    setting: str = "",
) -> None:
    """Print per-image timings and write the PNG (ToMA grid, or both with ``--compare``), each
    grid captioned with its settings and timing, each image with its ``cell_labels`` entry."""
    per_base, per_toma = t_base / n, t_toma / n
    print(
        f"time per image: unmerged {per_base:.3f} s, ToMA (ratio {args.ratio}) {per_toma:.3f} s, "
        f"speedup {per_base / per_toma:.2f}x"
    )
    print(load_note())
    ncols = min(n, 5 if args.compare else 10)
    grid = make_grid(merged, ncols=ncols, upscale=upscale, labels=cell_labels)
    toma_caption = f"ToMA ratio {args.ratio:g}, {args.selection}: {per_toma:.3f} s/image ({per_base / per_toma:.2f}x)"
    if args.compare:
        grid = side_by_side(
            [
                (
                    f"unmerged: {per_base:.3f} s/image" + (f"; {setting}" if setting else ""),
                    make_grid(baseline, ncols=ncols, upscale=upscale, labels=cell_labels),
                ),
                (toma_caption, grid),
            ]
        )
    else:
        grid = side_by_side([(toma_caption + (f"; {setting}" if setting else ""), grid)])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    grid.save(args.out)
    print(f"wrote {args.out}")


# ---------------------------------------------------------------------------- pipelines


def save_video(
    args: argparse.Namespace,
    baseline: torch.Tensor,
    merged: torch.Tensor,
    t_base: float,
    t_toma: float,
    upscale: int = 1,
) -> None:
    """Write clips ``(B, T, C, H, W)`` (C = 1 or 3): an animated GIF (``--out *.gif``), each of
    its frames the clips' frames side by side, else a strip with one row of frames per clip;
    with ``--compare`` the unmerged clips beside (GIF) or above (strip) ToMA's.
    ``t_base`` / ``t_toma``: seconds per clip."""
    print(
        f"time per clip: unmerged {t_base:.3f} s, ToMA (ratio {args.ratio}) {t_toma:.3f} s, "
        f"speedup {t_base / t_toma:.2f}x"
    )
    print(load_note())
    captions = (
        f"unmerged: {t_base:.3f} s/clip",
        f"ToMA ratio {args.ratio}: {t_toma:.3f} s/clip ({t_base / t_toma:.2f}x)",
    )
    runs = [baseline, merged] if args.compare else [merged]
    names = captions if args.compare else captions[1:]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.suffix.lower() == ".gif":
        frames = [
            side_by_side([(name, make_grid(clips[:, t], upscale=upscale)) for name, clips in zip(names, runs)])
            for t in range(runs[0].shape[1])
        ]
        frames[0].save(args.out, save_all=True, append_images=frames[1:], duration=125, loop=0)
    else:
        rows = [
            side_by_side([(name, make_grid(clips.flatten(0, 1), ncols=clips.shape[1], upscale=upscale))])
            for name, clips in zip(names, runs)
        ]
        from PIL import Image

        strip = Image.new("RGB", (max(r.width for r in rows), sum(r.height for r in rows)), "white")
        y = 0
        for row in rows:
            strip.paste(row, (0, y))
            y += row.height
        strip.save(args.out)
    print(f"wrote {args.out}")


def read_video(pipe: Any, path: Path | None, frames: int | None) -> list | None:
    """The frames of ``--video`` (RGB PIL images) for a pipeline whose call takes ``video``;
    ``None`` without ``--video``. Raises ``ValueError`` naming ``--video`` when the pipeline
    takes no video, the file is no readable GIF, or ``--frames`` asks for another length."""
    from PIL import Image, ImageSequence, UnidentifiedImageError

    if path is None:
        return None
    if "video" not in call_inputs(pipe):
        raise ValueError(f"--video applies to pipelines whose call takes a video; {type(pipe).__name__} takes none")
    try:
        with Image.open(path) as im:
            clip = [frame.convert("RGB") for frame in ImageSequence.Iterator(im)]
    except (OSError, UnidentifiedImageError) as err:
        raise ValueError(f"--video must be a readable animated GIF; {path}: {err}") from None
    if frames is not None and frames != len(clip):
        raise ValueError(f"--frames must match --video's {len(clip)} frames; got {frames}")
    return clip


def run_pipeline(args: argparse.Namespace) -> int:
    """Generate one image from a diffusers pipeline, unmerged and with ToMA."""
    from toma import apply_toma, remove_toma

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    pipe = load_pipeline(args.model, device, dtype)
    check_frames(pipe, args.frames)
    args.video_frames = read_video(pipe, args.video, args.frames)
    if args.video_frames is not None:
        args.frames = len(args.video_frames)
    steps = args.steps or 30

    def generate(label: str) -> torch.Tensor:
        images = pipeline_call(pipe, [args.prompt], [args.seed], steps, args, device, progress=label)
        sync(device)
        return images

    def warm_up() -> None:
        # one short call pays the one-off kernel set-up outside the timings
        pipeline_call(pipe, [args.prompt], [args.seed], 1, args, device, progress=False)

    warm_up()
    baseline, t_base = timed(lambda: generate("unmerged"))
    apply_toma(pipe, ratio=args.ratio, selection=args.selection, **toma_options(args))
    try:
        warm_up()
        merged, t_toma = timed(lambda: generate(f"ToMA {args.ratio:g}"))
    finally:
        remove_toma(pipe)
    if merged.dim() == 5:
        save_video(args, baseline, merged, t_base, t_toma)
    else:
        report_and_save(args, baseline, merged, t_base, t_toma, 1, setting=f"{steps} steps, seed {args.seed}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Entry point of ``toma generate``; returns the exit code."""
    import torch

    from toma.tools.builtin import BUILTIN_MODELS, builtin_name, check_blocks

    # a built-in model is named by args.builtin; args.model stays for pipelines only
    args.builtin = builtin_name(args.model)
    if args.builtin is not None:
        args.model = None
    try:
        threads = default_threads(args)
        if threads is not None:
            torch.set_num_threads(threads)
        if args.steps is not None and args.steps < 1:
            raise ValueError(f"--steps must be >= 1; got {args.steps}")
        validate_toma_options(args, [args.ratio])
        if args.builtin is not None and args.video is not None:
            raise ValueError("--video applies to --model pipelines whose call takes a video, not the built-in models")
        if args.builtin is not None:
            check_blocks(args.builtin, args.blocks)
        # an option the model would ignore is refused: an accepted setting must do something
        if args.builtin is not None and args.prompt is not None:
            raise ValueError("--prompt applies to --model pipelines; the built-in models draw digits: use --labels")
        if args.builtin is None and args.labels is not None:
            raise ValueError("--labels applies to the built-in models; a --model pipeline draws from --prompt")
        if args.builtin is None:
            check_model_name(args.model, [n for n in BUILTIN_MODELS if n != "builtin"])
            args.prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
        check_output(args.out, "--out", folder=False, suffixes=IMAGE_SUFFIXES)  # before generating
        return run_pipeline(args) if args.model else run_builtin(args)
    except PipelineUnavailableError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, FileNotFoundError) as err:
        # bad settings (ToMAConfig names the parameter) or missing built-in files
        print(f"error: {err}", file=sys.stderr)
        return 2
