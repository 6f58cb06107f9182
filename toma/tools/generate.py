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
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from toma.tools.report import IMAGE_SUFFIXES, check_output

if TYPE_CHECKING:
    import torch
# torch loads in the functions that use it: the CLI builds this parser for ``--help`` without it

BUILTIN_UPSCALE = 4  # 32x32 digits are shown at 128x128


class PipelineUnavailableError(RuntimeError):
    """A ``--model`` pipeline cannot be loaded offline."""


def register(subparsers: Any) -> None:
    """Add the ``generate`` subcommand to the CLI."""
    from toma.tools.cli import HelpFormatter

    p = subparsers.add_parser(
        "generate",
        help="generate images with and without ToMA (built-in model by default)",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", default=None,
                   help="diffusers pipeline id or local folder, or a built-in model: builtin (the digits UNet, "
                        "the default), builtin-dit (the digits Flux transformer) or builtin-video (the moving-digits Wan "
                        "transformer)")
    p.add_argument("--prompt", default="a photo of an astronaut riding a horse", help="prompt for --model pipelines")
    p.add_argument("--labels", default="0,1,2,3,4,5,6,7,8,9", help="built-in model: comma-separated digits to draw")
    p.add_argument("--ratio", type=float, default=0.5, help="ToMA merge ratio in [0, 1) (default 0.5)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: 20 built-in, 30 pipelines)")
    p.add_argument("--seed", type=int, default=0, help="seed of the starting noise")
    p.add_argument("--out", type=Path, default=Path("toma_generate.png"), help="output PNG (default toma_generate.png)")
    p.add_argument("--compare", action="store_true", help="write the baseline and ToMA images side by side with timings")
    add_toma_options(p)
    p.add_argument("--guidance-scale", type=float, default=None, help="classifier-free guidance (default: model's)")
    p.add_argument("--height", type=int, default=None, help="pipelines: image height")
    p.add_argument("--width", type=int, default=None, help="pipelines: image width")
    add_frames_option(p)
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="pipelines: weights dtype (auto: float16 on cuda, float32 on cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 for the built-in model, torch's choice for pipelines)")
    p.add_argument("--builtin-path", type=Path, default=None,
                   help="folder written by scripts/train_builtin.py, or by train_builtin_dit.py / train_builtin_video.py "
                        "for builtin-dit / builtin-video "
                        "(default: the copy in the package)")
    p.set_defaults(func=run)


def add_frames_option(p: argparse.ArgumentParser) -> None:
    """``--frames``, shared by ``generate`` and ``eval``."""
    p.add_argument("--frames", type=int, default=None,
                   help="video pipelines (Wan, LTX, ...): frames per clip (default: the pipeline's); "
                        "generate writes an animated GIF with --out *.gif, else a strip of frames")


def add_toma_options(p: argparse.ArgumentParser) -> None:
    """The ToMA settings shared by ``generate`` and ``eval``."""
    p.add_argument("--selection", default="facility", choices=["facility", "random", "grid"], help="ToMA destination selection")
    p.add_argument("--tile-size", type=int, default=4, help="ToMA tile side in tokens (default 4)")
    p.add_argument("--levels", type=int, default=1, help="UNet attention levels to merge, from the highest resolution (default 1)")
    p.add_argument("--temperature", type=float, default=None, help="ToMA assignment temperature (default: ToMA's)")
    p.add_argument("--proportional-attention", dest="proportional_attention", action="store_true", default=None,
                   help="log-mass bias in merged self-attention (default: on for UNets, off for Flux)")
    p.add_argument("--no-proportional-attention", dest="proportional_attention", action="store_false", default=None,
                   help="no log-mass bias (the paper's plain merged attention)")
    p.add_argument("--blocks", type=parse_blocks, default=None, metavar="STACK=I,J-K;...",
                   help="transformers: blocks that merge, e.g. 'transformer_blocks=0-1;single_transformer_blocks=2,3' "
                        "(stacks left out merge nothing; default: the family's rule)")
    p.add_argument("--merge-mlp", action="store_true", default=None,
                   help="also merge the MLPs (feed-forward) of the merged blocks")
    p.add_argument("--mlp-ratio", type=float, default=None, help="ratio for the MLPs (default: the ratio; needs --merge-mlp)")
    p.add_argument("--mlp-levels", type=parse_levels, default=None, metavar="I,J",
                   help="UNets: attention levels whose MLPs merge, e.g. 2 (default: every merged level; needs --merge-mlp)")
    p.add_argument("--merge-crossattn", action="store_true", default=None,
                   help="also merge the queries of cross-attention to text (UNets, PixArt, Wan, LTX)")
    p.add_argument("--crossattn-ratio", type=float, default=None,
                   help="ratio for cross-attention queries (default: the ratio; needs --merge-crossattn)")
    p.add_argument("--start-step", type=int, default=None,
                   help="merge only from this denoising step on (0 = the first; earlier steps run unmerged)")
    p.add_argument("--stop-step", type=int, default=None,
                   help="merge only before this denoising step (default: to the end)")


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
    for name in ("blocks", "merge_mlp", "mlp_ratio", "mlp_levels", "merge_crossattn", "crossattn_ratio", "start_step", "stop_step"):
        if getattr(args, name, None) is not None:
            opts[name] = getattr(args, name)
    return opts


def parse_levels(text: str) -> tuple[int, ...]:
    """``"1,2"`` -> ``(1, 2)``; raises ``argparse.ArgumentTypeError`` on anything but comma-separated ints."""
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated level numbers such as 2 or 1,2; got {text!r}") from None


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

    for ratio in ratios:
        ToMAConfig(ratio=ratio, selection=args.selection, **toma_options(args))


def parse_labels(text: str) -> list[int]:
    """``"0,1,7"`` -> ``[0, 1, 7]``; raises ``ValueError`` naming ``--labels`` on bad input."""
    try:
        labels = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--labels must be comma-separated digits 0-9; got {text!r}") from None
    if not labels or any(not 0 <= v <= 9 for v in labels):
        raise ValueError(f"--labels must be comma-separated digits 0-9; got {text!r}")
    return labels


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn`` and return its result and wall-clock seconds."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


# ---------------------------------------------------------------------------- images


LABEL_HEIGHT = 14  # pixels of the strip under each cell that holds its label


def make_grid(images: torch.Tensor, ncols: int | None = None, upscale: int = 1, pad: int = 2,
              labels: Sequence[str] | None = None) -> Any:
    """Tile images ``(B, C, H, W)`` in ``[0, 1]`` (C = 1 or 3) into one ``PIL.Image``.

    ``labels``: one text per image, written under it (the digit class, say).
    """
    import math

    import torch
    from PIL import Image, ImageDraw

    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"images must be (B, 1 or 3, H, W); got {tuple(images.shape)}")
    b, c, h, w = images.shape
    if labels is not None and len(labels) != b:
        raise ValueError(f"labels must give one text per image; got {len(labels)} for {b} images")
    if upscale > 1:
        images = torch.nn.functional.interpolate(images, scale_factor=upscale, mode="nearest")
        h, w = h * upscale, w * upscale
    ncols = ncols or min(b, 10)
    nrows = math.ceil(b / ncols)
    cell_h = h + pad + (LABEL_HEIGHT if labels is not None else 0)
    canvas = torch.ones(c, nrows * cell_h + pad, ncols * (w + pad) + pad)
    for i, img in enumerate(images):
        r, col = divmod(i, ncols)
        y, x = pad + r * cell_h, pad + col * (w + pad)
        canvas[:, y : y + h, x : x + w] = img
    arr = (canvas.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    grid = Image.fromarray(arr[..., 0] if c == 1 else arr).convert("RGB")
    if labels is not None:
        draw = ImageDraw.Draw(grid)
        for i, text in enumerate(labels):
            r, col = divmod(i, ncols)
            draw.text((pad + col * (w + pad) + w / 2, pad + r * cell_h + h + 1), text, fill="black", anchor="ma")
    return grid


def side_by_side(panels: Sequence[tuple[str, Any]]) -> Any:
    """Place labelled ``PIL`` images left to right, each with its caption above it."""
    import math

    from PIL import Image, ImageDraw

    caption_h = 18
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    # a panel is as wide as its image or its caption, whichever is wider
    widths = [max(img.width, math.ceil(measure.textlength(caption))) for caption, img in panels]
    width = sum(widths) + 10 * (len(panels) + 1)
    height = max(img.height for _, img in panels) + caption_h + 20
    out = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(out)
    x = 10
    for (caption, img), w in zip(panels, widths):
        draw.text((x, 6), caption, fill="black")
        out.paste(img, (x, caption_h + 10))
        x += w + 10
    return out


# ---------------------------------------------------------------------------- built-in


def run_builtin(args: argparse.Namespace) -> int:
    """Generate digits with a built-in model (``args.builtin``), unmerged and with ToMA."""
    from toma import apply_toma, remove_toma
    from toma.tools.builtin.samplers import BUILTIN_MODELS, load_sampler

    labels = parse_labels(args.labels)
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
        report_and_save(args, baseline, merged, t_base, t_toma, len(labels), upscale=BUILTIN_UPSCALE,
                        cell_labels=[str(v) for v in labels], setting=f"{steps} steps, seed {args.seed}")
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
    print(f"time per image: unmerged {per_base:.3f} s, ToMA (ratio {args.ratio}) {per_toma:.3f} s, "
          f"speedup {per_base / per_toma:.2f}x")
    ncols = min(n, 5 if args.compare else 10)
    grid = make_grid(merged, ncols=ncols, upscale=upscale, labels=cell_labels)
    toma_caption = f"ToMA ratio {args.ratio:g}, {args.selection}: {per_toma:.3f} s/image ({per_base / per_toma:.2f}x)"
    if args.compare:
        grid = side_by_side([
            (f"unmerged: {per_base:.3f} s/image" + (f"; {setting}" if setting else ""), make_grid(baseline, ncols=ncols, upscale=upscale, labels=cell_labels)),
            (toma_caption, grid),
        ])
    else:
        grid = side_by_side([(toma_caption + (f"; {setting}" if setting else ""), grid)])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    grid.save(args.out)
    print(f"wrote {args.out}")


# ---------------------------------------------------------------------------- pipelines


def resolve_device_dtype(device: str | None, dtype: str) -> tuple[str, torch.dtype]:
    """Default device (cuda if available) and dtype (float16 on cuda, float32 on cpu)."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "auto":
        return device, (torch.float16 if device.startswith("cuda") else torch.float32)
    return device, getattr(torch, dtype)


def dtype_kwargs(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype keyword ``from_pretrained`` expects: recent diffusers renamed ``torch_dtype`` to ``dtype``."""
    try:
        from diffusers.utils.deprecation_utils import _resolve_dtype  # noqa: F401  (present since the rename)
    except ImportError:
        return {"torch_dtype": dtype}
    return {"dtype": dtype}


def first_sentence(err: BaseException, limit: int = 200) -> str:
    """The first sentence of an error message, for one-line reports."""
    text = " ".join(str(err).split())
    cut = text.find(". ")
    text = text[: cut + 1] if cut >= 0 else text
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_pipeline(model_id: str, device: str, dtype: torch.dtype) -> Any:
    """Load a diffusers pipeline from the local cache or a folder, never downloading.

    Raises:
        PipelineUnavailableError: the weights are not available offline, with how to get them.
    """
    from diffusers import DiffusionPipeline

    try:
        pipe = DiffusionPipeline.from_pretrained(model_id, local_files_only=True, **dtype_kwargs(dtype))
    except (OSError, ValueError) as err:  # hub "not cached" errors subclass these
        reason = f"{type(err).__name__}: {first_sentence(err)}"
        if Path(model_id).exists():
            raise PipelineUnavailableError(
                f"{model_id!r} is not a loadable diffusers pipeline folder ({reason}). "
                "Pass a folder written by `pipe.save_pretrained(...)` (it contains model_index.json) "
                "or a Hugging Face model id that is in the local cache."
            ) from err
        raise PipelineUnavailableError(
            f"the weights of {model_id!r} are not in the local Hugging Face cache ({reason}).\n"
            "toma never downloads weights. Fetch them once with network access:\n"
            f"    hf download {model_id}        (older huggingface_hub: huggingface-cli download {model_id})\n"
            "Gated models (e.g. black-forest-labs/FLUX.1-dev) need `hf auth login` and accepting the "
            "licence on the model page first. Or pass --model /path/to/a/save_pretrained/folder."
        ) from err
    return pipe.to(device)


def pipeline_call(pipe: Any, prompts: Sequence[str], seeds: Sequence[int], steps: int, args: argparse.Namespace,
                  device: str, progress: bool | str = True) -> torch.Tensor:
    """Run a pipeline once per prompt/seed pair; returns images ``(B, 3, H, W)`` in ``[0, 1]``,
    or clips ``(B, T, 3, H, W)`` from a video pipeline.

    ``progress``: show the pipeline's progress bar; a string labels it (which run it is).
    """
    import torch

    # the config persists on the pipeline: reset the label when none is given
    pipe.set_progress_bar_config(disable=not progress, leave=False, desc=progress if isinstance(progress, str) else None)
    kwargs: dict[str, Any] = {"num_inference_steps": steps, "output_type": "pt"}
    if getattr(args, "frames", None) is not None:
        kwargs["num_frames"] = args.frames
    if args.guidance_scale is not None:
        kwargs["guidance_scale"] = args.guidance_scale
    if args.height is not None:
        kwargs["height"] = args.height
    if args.width is not None:
        kwargs["width"] = args.width
    gen_device = device if device.startswith("cuda") else "cpu"
    images = []
    for prompt, seed in zip(prompts, seeds):
        gen = torch.Generator(gen_device).manual_seed(int(seed))
        result = pipe(prompt=prompt, generator=gen, **kwargs)
        out = result.frames if is_video_pipeline(pipe) else result.images
        images.append(torch.as_tensor(out).float().cpu())
    return torch.cat(images)


def is_video_pipeline(pipe: Any) -> bool:
    """Whether ``pipe`` draws videos: its call takes ``num_frames`` (Wan, LTX, CogVideoX, HunyuanVideo)."""
    import inspect

    return "num_frames" in inspect.signature(pipe.__call__).parameters


def check_frames(pipe: Any, frames: int | None) -> None:
    """``--frames`` is for video pipelines and must be positive."""
    if frames is None:
        return
    if not is_video_pipeline(pipe):
        raise ValueError(f"--frames applies to video pipelines; {type(pipe).__name__} draws images")
    if frames < 1:
        raise ValueError(f"--frames must be >= 1; got {frames}")


def save_video(args: argparse.Namespace, baseline: torch.Tensor, merged: torch.Tensor, t_base: float,
               t_toma: float, upscale: int = 1) -> None:
    """Write clips ``(B, T, C, H, W)`` (C = 1 or 3): an animated GIF (``--out *.gif``), each of
    its frames the clips' frames side by side, else a strip with one row of frames per clip;
    with ``--compare`` the unmerged clips beside (GIF) or above (strip) ToMA's.
    ``t_base`` / ``t_toma``: seconds per clip."""
    print(f"time per clip: unmerged {t_base:.3f} s, ToMA (ratio {args.ratio}) {t_toma:.3f} s, "
          f"speedup {t_base / t_toma:.2f}x")
    captions = (f"unmerged: {t_base:.3f} s/clip", f"ToMA ratio {args.ratio}: {t_toma:.3f} s/clip ({t_base / t_toma:.2f}x)")
    runs = [baseline, merged] if args.compare else [merged]
    names = captions if args.compare else captions[1:]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.suffix.lower() == ".gif":
        frames = [side_by_side([(name, make_grid(clips[:, t], upscale=upscale)) for name, clips in zip(names, runs)])
                  for t in range(runs[0].shape[1])]
        frames[0].save(args.out, save_all=True, append_images=frames[1:], duration=125, loop=0)
    else:
        rows = [side_by_side([(name, make_grid(clips.flatten(0, 1), ncols=clips.shape[1], upscale=upscale))])
                for name, clips in zip(names, runs)]
        from PIL import Image

        strip = Image.new("RGB", (max(r.width for r in rows), sum(r.height for r in rows)), "white")
        y = 0
        for row in rows:
            strip.paste(row, (0, y))
            y += row.height
        strip.save(args.out)
    print(f"wrote {args.out}")


def sync(device: str) -> None:
    """Wait for queued GPU work so timings are honest."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def run_pipeline(args: argparse.Namespace) -> int:
    """Generate one image from a diffusers pipeline, unmerged and with ToMA."""
    from toma import apply_toma, remove_toma

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    pipe = load_pipeline(args.model, device, dtype)
    check_frames(pipe, args.frames)
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

    from toma.tools.builtin.samplers import builtin_name, check_blocks

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
        if args.builtin is not None:
            check_blocks(args.builtin, args.blocks)
        check_output(args.out, "--out", folder=False, suffixes=IMAGE_SUFFIXES)  # before generating
        return run_pipeline(args) if args.model else run_builtin(args)
    except PipelineUnavailableError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, FileNotFoundError) as err:
        # bad settings (ToMAConfig names the parameter) or missing built-in files
        print(f"error: {err}", file=sys.stderr)
        return 2
