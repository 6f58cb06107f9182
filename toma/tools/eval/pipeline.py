"""``toma eval`` on diffusers pipelines: generation from prompts, CLIP-T, DINO and Frechet distance.

The metric models load only when asked for, and before any generation, so that missing
weights fail in seconds rather than after minutes of sampling.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from toma.tools.common.options import resolve_device_dtype, toma_options
from toma.tools.common.pipelines import check_frames, load_pipeline, pipeline_call, sync
from toma.tools.eval.harness import (
    Processes,
    add_speedup,
    frechet_to,
    generate_interleaved,
    image_progress,
    key,
    mean_and_sem,
    timing,
)
from toma.tools.eval.metrics import (
    ClipScorer,
    DinoFeatures,
    cosine_similarity,
    feature_stats,
    load_image_folder,
    psnr,
    ssim,
)

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
    check_frames(pipe, getattr(args, "frames", None))
    steps = args.steps or 30
    prompts = read_prompts(args.prompts)
    items = procs.split([(i, prompts[i % len(prompts)], args.seed + i) for i in range(args.num_images)])
    options = toma_options(args)
    records: dict[str, Any] = {}
    reference: torch.Tensor | None = None
    ref_dino: torch.Tensor | None = None

    def generate(batch: list[tuple[int, str, int]]) -> torch.Tensor:
        ((_, prompt, seed),) = batch
        out = pipeline_call(pipe, [prompt], [seed], steps, args, device, progress=False)
        sync(device)
        return out

    def warm_up() -> None:
        pipeline_call(pipe, [prompts[0]], [0], 1, args, device, progress=False)

    # one image per pipeline call, so a batch is one image
    with image_progress(len(runs) * len(items), procs.is_main) as progress:
        generated = generate_interleaved(pipe, runs, [[item] for item in items], options, generate, warm_up, progress)
    for method, ratio in runs:
        chunks, seconds = generated[(method, ratio)]
        images = torch.cat(chunks) if chunks else torch.empty(0, 3, 64, 64)  # a process may get no prompts
        texts = [b[1] for b in items]
        if images.dim() == 5:  # video clips (B, T, 3, H, W): every metric is per frame
            texts = [t for t in texts for _ in range(images.shape[1])]
            images = images.flatten(0, 1)
        if reference is None:
            reference = images
        rec: dict[str, Any] = {
            "indices": [b[0] for b in items],
            "psnr": psnr(images, reference).tolist(),
            "ssim": ssim(images, reference).tolist(),
            "batch_seconds": seconds,
            "batch_sizes": [1] * len(items),
            "count": len(items),
            "preview": make_preview(images) if procs.is_main else None,
        }
        if clip is not None and len(items):
            rec["clip_t"] = clip(images, texts).tolist()
        if dino is not None and len(items):
            feats = dino(images)
            if ref_dino is None:
                ref_dino = feats
            rec["dino"] = cosine_similarity(feats, ref_dino).tolist()
            rec["dino_features"] = feats.tolist()
        records[key(method, ratio)] = rec
    return records


def make_preview(images: torch.Tensor, count: int = 4, size: int = 256) -> list[Any]:
    """A few images shrunk to ``size`` pixels for the samples sheet."""
    small = torch.nn.functional.interpolate(images[:count], size=(size, size), mode="bilinear", antialias=True)
    return small.tolist()


def summarise_pipeline(
    gathered: list[dict[str, Any]], runs: list[tuple[str, float]], args: argparse.Namespace
) -> list[dict[str, Any]]:
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
            **timing(parts),
        }
        if any("clip_t" in p for p in parts):
            row["clip_t"] = float(cat("clip_t").mean())
        if any("dino" in p for p in parts):
            row["dino_similarity"] = float(cat("dino").mean())
            row["dino_delta"] = 1.0 - row["dino_similarity"]
        if ref_stats is not None:
            row["fd_dino_reference"] = frechet_to(cat("dino_features"), *ref_stats)
        rows.append(row)
    return add_speedup(rows)
