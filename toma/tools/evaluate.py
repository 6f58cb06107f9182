"""``toma eval``: quality and speed of token merging against unmerged generation.

Every method generates from the same seeds and classes (built-in model) or prompts
(``--model`` pipelines). Per method and ratio it reports PSNR and SSIM of the merged images
against the unmerged ones and the latency per image; on the built-in model also the digit
classifier's accuracy and a Frechet distance on its features; on pipelines, when asked,
CLIP-T, DINO similarity to the unmerged image and a Frechet distance to reference images.

Methods: ``none`` (unmerged reference), ``toma`` (facility-location selection),
``toma-random`` and ``toma-grid`` (ToMA's merge with random / grid destinations) and
``tomesd`` (ToMeSD, if installed).

Outputs in ``--out-dir``: ``results.json``, ``results.md``, ``quality_vs_speedup.png`` and
``samples.png``. Under ``accelerate launch`` the images are split across processes (data
parallel) and the results merged on the main process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from toma.tools.generate import (
    BUILTIN_UPSCALE,
    validate_toma_options,
    PipelineUnavailableError,
    add_toma_options,
    load_pipeline,
    make_grid,
    pipeline_call,
    resolve_device_dtype,
    sync,
    timed,
    default_threads,
    toma_options,
)
from toma.tools.metrics import (
    DEFAULT_CLIP_MODEL,
    DEFAULT_DINO_MODEL,
    ClipScorer,
    DinoFeatures,
    MissingWeightsError,
    cosine_similarity,
    feature_stats,
    frechet_distance,
    load_image_folder,
    mean_finite,
    psnr,
    ssim,
)

METHODS = ("none", "toma", "toma-random", "toma-grid", "tomesd")
TOMA_SELECTION = {"toma": "facility", "toma-random": "random", "toma-grid": "grid"}
DEFAULT_PROMPTS = (
    "a photo of a golden retriever on the grass",
    "a red sports car parked in a city street at night",
    "a bowl of ramen with an egg, studio lighting",
    "a lighthouse on a cliff during a storm, oil painting",
    "a tabby cat sleeping on a stack of books",
    "a snowy mountain village at sunrise",
    "an astronaut riding a horse on the moon",
    "a close-up of a hummingbird drinking from a flower",
)


def register(subparsers: Any) -> None:
    """Add the ``eval`` subcommand to the CLI."""
    p = subparsers.add_parser(
        "eval",
        help="compare merging methods against unmerged generation (quality and speed)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="diffusers pipeline id or local folder (default: the built-in digits model)")
    p.add_argument("--methods", default="none,toma,toma-random,toma-grid,tomesd",
                   help=f"comma-separated, from {', '.join(METHODS)} (none is always run as the reference)")
    p.add_argument("--ratios", default="0.5", help="comma-separated merge ratios in [0, 1) (default 0.5)")
    p.add_argument("--num-images", type=int, default=100, help="images per method and ratio (default 100)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: 20 built-in, 30 pipelines)")
    p.add_argument("--seed", type=int, default=0, help="image i uses seed SEED+i")
    p.add_argument("--batch-size", type=int, default=50, help="built-in model: images per UNet batch")
    p.add_argument("--out-dir", type=Path, default=Path("toma_eval"), help="output folder (default toma_eval)")
    add_toma_options(p)
    p.add_argument("--guidance-scale", type=float, default=None, help="classifier-free guidance (default: model's)")
    p.add_argument("--prompts", type=Path, default=None, help="pipelines: text file, one prompt per line")
    p.add_argument("--height", type=int, default=None, help="pipelines: image height")
    p.add_argument("--width", type=int, default=None, help="pipelines: image width")
    p.add_argument("--clip", action="store_true", help="pipelines: report CLIP-T (needs local CLIP weights)")
    p.add_argument("--clip-model", default=DEFAULT_CLIP_MODEL)
    p.add_argument("--dino", action="store_true", help="pipelines: report DINO similarity to the unmerged image")
    p.add_argument("--dino-model", default=DEFAULT_DINO_MODEL)
    p.add_argument("--fid-reference", type=Path, default=None,
                   help="pipelines: folder of reference images; reports the Frechet distance on DINO features")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads per process (default: 1 for the built-in model; "
                        "for pipelines CPU cores / processes)")
    p.add_argument("--builtin-path", type=Path, default=None,
                   help="folder written by scripts/train_builtin.py (default: the copy in the package)")
    p.set_defaults(func=run)


# ---------------------------------------------------------------------------- options


def parse_methods(text: str) -> list[str]:
    """Validated method list with ``none`` first; raises ``ValueError`` naming ``--methods``."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"--methods must be a comma-separated subset of {', '.join(METHODS)}; got {text!r}")
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


def first_attention_downsample(unet: Any) -> int:
    """Downsampling factor of the UNet's highest-resolution level that has attention."""
    for i, block in enumerate(getattr(unet, "down_blocks", [])):
        if getattr(block, "attentions", None):
            return 2**i
    return 1


def apply_method(denoiser: Any, method: str, ratio: float, options: dict[str, Any]) -> Callable[[], None]:
    """Patch ``denoiser`` with a merging method; returns the function that removes it.

    ``options`` are ToMA settings; ``levels`` is translated to tomesd's ``max_downsample``
    so both merge the same UNet levels.

    Raises:
        ValueError: unknown method, or tomesd on a model without a UNet.
        ImportError: tomesd requested but not installed.
    """
    if method == "none":
        return lambda: None
    if method in TOMA_SELECTION:
        from toma import apply_toma, remove_toma

        apply_toma(denoiser, ratio=ratio, selection=TOMA_SELECTION[method], **options)
        return lambda: remove_toma(denoiser)
    if method == "tomesd":
        import tomesd

        unet = getattr(denoiser, "unet", denoiser)
        if not hasattr(unet, "down_blocks"):
            raise ValueError("tomesd only supports UNet models (SD 1.x/2.x, SDXL, the built-in model)")
        max_downsample = first_attention_downsample(unet) * 2 ** (options.get("levels", 1) - 1)
        tomesd.apply_patch(unet, ratio=ratio, max_downsample=max_downsample)
        return lambda: tomesd.remove_patch(unet)
    raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")


def variants(methods: Sequence[str], ratios: Sequence[float]) -> list[tuple[str, float]]:
    """(method, ratio) pairs to run; the reference ``none`` once, with ratio 0."""
    return [("none", 0.0)] + [(m, r) for m in methods if m != "none" for r in ratios]


def tomesd_available() -> bool:
    """Whether ToMeSD can be imported."""
    try:
        import tomesd  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------- processes


@dataclass
class Processes:
    """Data-parallel context: this process's rank and how to gather Python objects."""

    rank: int
    world: int
    state: Any = None

    @property
    def is_main(self) -> bool:
        """Whether this is the process that summarises and writes the outputs."""
        return self.rank == 0

    def split(self, items: list[Any]) -> list[Any]:
        """This process's contiguous share of ``items``."""
        if self.state is None:
            return items
        with self.state.split_between_processes(items) as mine:
            return list(mine)

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` from every process, in rank order (only meaningful on the main process)."""
        if self.world == 1:
            return [obj]
        from accelerate.utils import gather_object

        return gather_object([obj])

    def barrier(self) -> None:
        """Wait until every process gets here."""
        if self.state is not None and self.world > 1:
            self.state.wait_for_everyone()


def init_processes(cpu: bool) -> Processes:
    """Join the process group when started by ``accelerate launch``/``torchrun``, else run alone.

    ``cpu`` selects the gloo backend; accelerate only picks it for multi-process runs
    when told explicitly.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        try:
            from accelerate import PartialState
        except ImportError as err:
            raise RuntimeError("multi-process eval needs accelerate: pip install accelerate") from err
        state = PartialState(cpu=cpu)
        if state.num_processes != world:
            raise RuntimeError(
                f"launched with WORLD_SIZE={world} but accelerate set up {state.num_processes} process(es); "
                "launch with `accelerate launch --multi_gpu --num_processes N` or `torchrun --nproc_per_node N`"
            )
        return Processes(state.process_index, state.num_processes, state)
    return Processes(0, 1, None)


# ---------------------------------------------------------------------------- built-in


def eval_builtin(args: argparse.Namespace, procs: Processes, runs: list[tuple[str, float]]) -> dict[str, Any]:
    """Generate with every variant on this process's share; returns per-variant records."""
    from tqdm.auto import tqdm

    from toma.tools.builtin import NUM_CLASSES, classify, load_builtin, sample

    model = load_builtin() if args.builtin_path is None else load_builtin(args.builtin_path)
    steps = args.steps or 20
    items = procs.split([(i, i % NUM_CLASSES, args.seed + i) for i in range(args.num_images)])
    options = toma_options(args)
    records: dict[str, Any] = {}
    reference: torch.Tensor | None = None
    bar = tqdm(total=len(runs) * len(items), desc="eval images", disable=not procs.is_main)
    for method, ratio in runs:
        remove = apply_method(model.unet, method, ratio, options)
        try:
            # the first calls pay one-off set-up; keep it out of the timing
            sample(model, [0], [0], steps=1, guidance_scale=args.guidance_scale, progress=False)
            chunks, seconds = [], 0.0
            for start in range(0, len(items), args.batch_size):
                batch = items[start : start + args.batch_size]
                images, dt = timed(lambda: sample(
                    model, [b[1] for b in batch], [b[2] for b in batch], steps=steps,
                    guidance_scale=args.guidance_scale, progress=False))
                chunks.append(images)
                seconds += dt
                bar.update(len(batch))
        finally:
            remove()
        images = torch.cat(chunks) if chunks else torch.empty(0, 1, 32, 32)
        if reference is None:
            reference = images
        preds, feats = classify(model.classifier, images)
        records[key(method, ratio)] = {
            "indices": [b[0] for b in items],
            "labels": [b[1] for b in items],
            "psnr": psnr(images, reference).tolist(),
            "ssim": ssim(images, reference).tolist(),
            "preds": preds.tolist(),
            "features": feats.double().tolist(),
            "seconds": seconds,
            "count": len(items),
            "preview": images[:20].tolist() if procs.is_main else None,
        }
    bar.close()
    records["_reference"] = {"mu": model.reference_mu.tolist(), "sigma": model.reference_sigma.tolist()}
    records["_guidance_scale"] = model.guidance_scale if args.guidance_scale is None else args.guidance_scale
    return records


def summarise_builtin(gathered: list[dict[str, Any]], runs: list[tuple[str, float]]) -> list[dict[str, Any]]:
    """Merge every process's records into one row per variant."""
    ref = gathered[0]["_reference"]
    ref_mu, ref_sigma = torch.tensor(ref["mu"]), torch.tensor(ref["sigma"])
    rows = []
    base_feats = None
    for method, ratio in runs:
        parts = [g[key(method, ratio)] for g in gathered]
        labels = torch.tensor(sum((p["labels"] for p in parts), []))
        preds = torch.tensor(sum((p["preds"] for p in parts), []))
        feats = torch.tensor(sum((p["features"] for p in parts), []), dtype=torch.float64)
        if base_feats is None:
            base_feats = feats
        count = sum(p["count"] for p in parts)
        row = {
            "method": method,
            "ratio": ratio,
            "n_images": count,
            **mean_and_sem("psnr", torch.tensor(sum((p["psnr"] for p in parts), []))),
            **mean_and_sem("ssim", torch.tensor(sum((p["ssim"] for p in parts), []))),
            "accuracy": float((preds == labels).double().mean()),
            "fd_real": _fd(feats, ref_mu, ref_sigma),
            "fd_vs_none": _fd(feats, *feature_stats(base_feats)) if len(base_feats) > 1 else float("nan"),
            "latency_s": sum(p["seconds"] for p in parts) / max(count, 1),
        }
        rows.append(row)
    return add_speedup(rows)


def mean_and_sem(name: str, values: torch.Tensor) -> dict[str, float]:
    """``{name: mean, name_sem: standard error}`` over the finite per-image values.

    The standard error says whether two methods' means differ by more than seed noise.
    """
    finite = values.double()[torch.isfinite(values.double())]
    sem = float(finite.std() / math.sqrt(finite.numel())) if finite.numel() > 1 else float("nan")
    return {name: mean_finite(values), f"{name}_sem": sem}


def _fd(feats: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> float:
    if len(feats) < 2:
        return float("nan")
    return frechet_distance(*feature_stats(feats), mu, sigma)


def add_speedup(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add ``speedup`` = unmerged latency / latency to every row."""
    base = rows[0]["latency_s"]
    for row in rows:
        row["speedup"] = base / row["latency_s"] if row["latency_s"] > 0 else float("nan")
    return rows


def key(method: str, ratio: float) -> str:
    return f"{method}@{ratio:g}"


# ---------------------------------------------------------------------------- pipelines


def read_prompts(path: Path | None) -> list[str]:
    """Prompts from a text file (one per line, blanks skipped) or the default list."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts file {path} has no prompts")
    return prompts


def eval_pipeline(args: argparse.Namespace, procs: Processes, runs: list[tuple[str, float]]) -> dict[str, Any]:
    """Generate with every variant from a diffusers pipeline; returns per-variant records."""
    from tqdm.auto import tqdm

    # metric weights first: a missing model should fail before minutes of generation
    clip = ClipScorer(args.clip_model) if args.clip else None
    dino = DinoFeatures(args.dino_model) if (args.dino or args.fid_reference) else None
    for scorer in (clip, dino):
        if scorer is not None:
            scorer.load()
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    if procs.state is not None and device.startswith("cuda"):
        device = str(procs.state.device)  # one GPU per process
    pipe = load_pipeline(args.model, device, dtype)
    steps = args.steps or 30
    prompts = read_prompts(args.prompts)
    items = procs.split([(i, prompts[i % len(prompts)], args.seed + i) for i in range(args.num_images)])
    options = toma_options(args)
    records: dict[str, Any] = {}
    reference: torch.Tensor | None = None
    ref_dino: torch.Tensor | None = None
    bar = tqdm(total=len(runs) * len(items), desc="eval images", disable=not procs.is_main)
    for method, ratio in runs:
        remove = apply_method(pipe, method, ratio, options)
        try:
            pipeline_call(pipe, [prompts[0]], [0], 1, args, device, progress=False)  # warm-up
            chunks, seconds = [], 0.0
            for idx, prompt, seed in items:
                def one() -> torch.Tensor:
                    out = pipeline_call(pipe, [prompt], [seed], steps, args, device, progress=False)
                    sync(device)
                    return out
                image, dt = timed(one)
                chunks.append(image)
                seconds += dt
                bar.update(1)
        finally:
            remove()
        images = torch.cat(chunks) if chunks else torch.empty(0, 3, 64, 64)  # a process may get no prompts
        if reference is None:
            reference = images
        rec: dict[str, Any] = {
            "indices": [b[0] for b in items],
            "psnr": psnr(images, reference).tolist(),
            "ssim": ssim(images, reference).tolist(),
            "seconds": seconds,
            "count": len(items),
            "preview": make_preview(images) if procs.is_main else None,
        }
        if clip is not None and len(items):
            rec["clip_t"] = clip(images, [b[1] for b in items]).tolist()
        if dino is not None and len(items):
            feats = dino(images)
            if ref_dino is None:
                ref_dino = feats
            rec["dino"] = cosine_similarity(feats, ref_dino).tolist()
            rec["dino_features"] = feats.tolist()
        records[key(method, ratio)] = rec
    bar.close()
    return records


def make_preview(images: torch.Tensor, count: int = 4, size: int = 256) -> list[Any]:
    """A few images shrunk to ``size`` pixels for the samples sheet."""
    small = torch.nn.functional.interpolate(images[:count], size=(size, size), mode="bilinear", antialias=True)
    return small.tolist()


def summarise_pipeline(gathered: list[dict[str, Any]], runs: list[tuple[str, float]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Merge every process's records into one row per variant."""
    ref_stats = None
    if args.fid_reference is not None:
        reference_images = load_image_folder(str(args.fid_reference), size=224)
        ref_stats = feature_stats(DinoFeatures(args.dino_model)(reference_images))
    rows = []
    for method, ratio in runs:
        parts = [g[key(method, ratio)] for g in gathered]

        def cat(name: str) -> torch.Tensor:
            return torch.tensor(sum((p.get(name, []) for p in parts), []), dtype=torch.float64)

        count = sum(p["count"] for p in parts)
        row: dict[str, Any] = {
            "method": method,
            "ratio": ratio,
            "n_images": count,
            **mean_and_sem("psnr", cat("psnr")),
            **mean_and_sem("ssim", cat("ssim")),
            "latency_s": sum(p["seconds"] for p in parts) / max(count, 1),
        }
        if any("clip_t" in p for p in parts):
            row["clip_t"] = float(cat("clip_t").mean())
        if any("dino" in p for p in parts):
            row["dino_similarity"] = float(cat("dino").mean())
            row["dino_delta"] = 1.0 - row["dino_similarity"]
        if ref_stats is not None:
            row["fd_dino_reference"] = _fd(cat("dino_features"), *ref_stats)
        rows.append(row)
    return add_speedup(rows)


# ---------------------------------------------------------------------------- outputs


COLUMNS = [
    ("method", "method", "{}"),
    ("ratio", "ratio", "{:g}"),
    ("n_images", "images", "{}"),
    ("psnr", "PSNR vs unmerged (dB)", "{:.2f}"),
    ("psnr_sem", "± s.e.", "{:.2f}"),
    ("ssim", "SSIM vs unmerged", "{:.4f}"),
    ("ssim_sem", "± s.e.", "{:.4f}"),
    ("accuracy", "classifier acc.", "{:.3f}"),
    ("fd_real", "FD to real digits", "{:.2f}"),
    ("fd_vs_none", "FD to unmerged", "{:.2f}"),
    ("clip_t", "CLIP-T", "{:.4f}"),
    ("dino_delta", "DINO delta", "{:.4f}"),
    ("fd_dino_reference", "FD (DINOv2) to reference", "{:.2f}"),
    ("latency_s", "latency (s/image)", "{:.3f}"),
    ("speedup", "speedup", "{:.2f}x"),
]


def json_safe(obj: Any) -> Any:
    """``obj`` with non-finite floats replaced by ``None``."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _cell(fmt: str, value: Any) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    return fmt.format(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Rows as a markdown table with the columns present in the first row."""
    cols = [c for c in COLUMNS if c[0] in rows[0]]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(c[2], row[c[0]]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Quality (PSNR, SSIM, and accuracy when present) against speedup, one series per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("psnr", "PSNR vs unmerged (dB)"), ("ssim", "SSIM vs unmerged")]
    if "accuracy" in rows[0]:
        panels.append(("accuracy", "classifier accuracy"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    colours = plt.get_cmap("tab10")
    for ax, (metric, label) in zip(axes[0], panels):
        for method in methods:
            pts = sorted((r["speedup"], r[metric], r["ratio"]) for r in rows if r["method"] == method)
            finite = [(x, y, rt) for x, y, rt in pts if math.isfinite(y)]
            if not finite:
                continue  # the unmerged reference has infinite PSNR
            # fixed colour per method so the panels agree
            style = ({"color": "black", "marker": "*", "markersize": 10} if method == "none"
                     else {"color": colours(METHODS.index(method)), "marker": "o"})
            ax.plot([p[0] for p in finite], [p[1] for p in finite], label=method, **style)
            for x, y, rt in finite:
                if method != "none":
                    ax.annotate(f"{rt:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel("speedup over unmerged (x)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_samples(gathered: list[dict[str, Any]], runs: list[tuple[str, float]], path: Path, upscale: int) -> None:
    """One row of preview images per variant (from the main process's share)."""
    from toma.tools.generate import side_by_side

    panels = []
    for method, ratio in runs:
        preview = gathered[0][key(method, ratio)]["preview"]
        if preview:
            images = torch.tensor(preview)
            panels.append((f"{method} {ratio:g}", make_grid(images, ncols=min(len(images), 10), upscale=upscale)))
    if not panels:
        return
    from PIL import Image

    width = max(img.width for _, img in panels) + 20
    rows = [side_by_side([p]) for p in panels]
    sheet = Image.new("RGB", (width, sum(r.height for r in rows)), "white")
    y = 0
    for r in rows:
        sheet.paste(r, (0, y))
        y += r.height
    sheet.save(path)


def machine_info(procs: Processes) -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "processes": procs.world,
    }


def write_outputs(args: argparse.Namespace, rows: list[dict[str, Any]], meta: dict[str, Any],
                  gathered: list[dict[str, Any]], runs: list[tuple[str, float]]) -> None:
    """Write results.json, results.md, the plot and the samples sheet."""
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.json", "w", encoding="utf-8") as fh:
        # JSON has no inf/nan: the unmerged reference's PSNR (inf) becomes null
        json.dump(json_safe({**meta, "results": rows}), fh, indent=2)
    table = markdown_table(rows)
    header = (f"# toma eval: {meta['model']}\n\n{meta['num_images']} images per variant, {meta['steps']} steps, "
              f"seeds {meta['seed']}..{meta['seed'] + meta['num_images'] - 1}; {meta['machine']['processes']} process(es), "
              f"torch {meta['machine']['torch']}, {meta['machine']['torch_threads']} thread(s) each.\n\n")
    (out / "results.md").write_text(header + table, encoding="utf-8")
    plot(rows, out / "quality_vs_speedup.png", f"{meta['model']}: quality vs speedup")
    write_samples(gathered, runs, out / "samples.png", BUILTIN_UPSCALE if args.model is None else 1)
    print(table)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'quality_vs_speedup.png'}, {out / 'samples.png'}")


# ---------------------------------------------------------------------------- entry point


def run(args: argparse.Namespace) -> int:
    """Entry point of ``toma eval``; returns the exit code."""
    try:
        methods = parse_methods(args.methods)
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
            raise ValueError("--clip, --dino and --fid-reference apply to --model pipelines; "
                             "the built-in model reports classifier accuracy and FD instead")
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if "tomesd" in methods and not tomesd_available():
        print("note: tomesd is not installed (pip install tomesd); skipping the tomesd method", file=sys.stderr)
        methods.remove("tomesd")

    procs = init_processes(cpu=args.model is None or resolve_device_dtype(args.device, args.dtype)[0] == "cpu")
    threads = default_threads(args)
    if threads is None and procs.world > 1:
        threads = max(1, (os.cpu_count() or 1) // procs.world)
    if threads is not None:
        torch.set_num_threads(threads)
    runs = variants(methods, ratios)
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
            "model": args.model or "built-in digits",
            "methods": methods,
            "ratios": ratios,
            "num_images": args.num_images,
            "steps": args.steps or (30 if args.model else 20),
            "seed": args.seed,
            "toma_options": toma_options(args),
            "guidance_scale": gathered[0].get("_guidance_scale", args.guidance_scale),
            "arguments": {k: (v if isinstance(v, (int, float, bool, type(None))) else str(v))
                          for k, v in vars(args).items() if k != "func"},
            "machine": machine_info(procs),
        }
        write_outputs(args, rows, meta, gathered, runs)
    procs.barrier()
    return 0
