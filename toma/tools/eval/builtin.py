"""``toma eval`` on the built-in digits models: generation, classifier accuracy and Frechet distances.

The model (``--model builtin``, the default UNet, ``builtin-dit`` or the video model
``builtin-video``) comes through :func:`toma.tools.builtin.load_sampler`, so this
code is the same for all of them; clips are scored frame by frame, plus a temporal
consistency figure.

Every process generates its share of the images with each variant from the same seeds
and classes; :func:`summarise_builtin` merges the shares into one row per variant.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from toma.tools.common.options import toma_options
from toma.tools.eval.caches import Skips, count_skips, skip_stats
from toma.tools.eval.harness import (
    Processes,
    add_speedup,
    apply_method,
    frechet_to,
    generate_interleaved,
    image_progress,
    key,
    mean_and_sem,
    timing,
)
from toma.tools.eval.metrics import feature_stats, psnr, ssim


def eval_builtin(args: argparse.Namespace, procs: Processes, runs: list[tuple[str, float]]) -> dict[str, Any]:
    """Generate with every variant on this process's share; returns per-variant records."""
    from toma.tools.builtin import load_sampler
    from toma.tools.builtin.unet import NUM_CLASSES, classify

    model = load_sampler(getattr(args, "builtin", "builtin"), args.builtin_path)
    steps = args.steps or 20
    items = procs.split([(i, i % NUM_CLASSES, args.seed + i) for i in range(args.num_images)])
    options = toma_options(args)
    for method, ratio in runs:
        # settings the model cannot take (e.g. --blocks naming a stack it lacks) fail now,
        # not after the unmerged reference has been generated
        apply_method(model.denoiser, method, ratio, options, steps)()
    records: dict[str, Any] = {}
    reference: torch.Tensor | None = None
    batches = [items[start : start + args.batch_size] for start in range(0, len(items), args.batch_size)]

    def generate(batch: list[tuple[int, int, int]]) -> tuple[torch.Tensor, Skips]:
        # the steps a cache skips, counted for every variant (two torch hooks: no cost to time)
        with count_skips(model.denoiser) as skips:
            images = model.draw([b[1] for b in batch], [b[2] for b in batch], steps, args.guidance_scale, False)
        return images, skips

    def warm_up() -> None:
        # the first calls pay one-off set-up; keep it out of the timing
        model.draw([0], [0], 1, args.guidance_scale, False)

    with image_progress(len(runs) * len(items), procs.is_main) as progress:
        generated = generate_interleaved(model.denoiser, runs, batches, options, generate, warm_up, progress, steps)
    for method, ratio in runs:
        drawn, seconds = generated[(method, ratio)]
        images = torch.cat([d[0] for d in drawn]) if drawn else torch.empty(0, 1, 32, 32)
        if reference is None:
            reference = images
        labels = [b[1] for b in items]
        if images.dim() == 5:  # clips (B, T, 1, H, W): scored frame by frame
            record = _clip_scores(model, images, reference, labels)
        else:
            preds, feats = classify(model.classifier, images)
            record = {
                "labels": labels,
                "psnr": psnr(images, reference).tolist(),
                "ssim": ssim(images, reference).tolist(),
                "preds": preds.tolist(),
                "features": feats.double().tolist(),
                "preview": images[:20].tolist(),
            }
        if not procs.is_main:
            record["preview"] = None
        records[key(method, ratio)] = {
            "indices": [b[0] for b in items],
            **record,
            "batch_seconds": seconds,
            "batch_sizes": [len(b) for b in batches],
            "skip_steps": [d[1].skipped for d in drawn],
            "batch_calls": [d[1].calls for d in drawn],
            "count": len(items),
        }
    if model.reference_mu is not None:
        records["_reference"] = {"mu": model.reference_mu.tolist(), "sigma": model.reference_sigma.tolist()}
    records["_guidance_scale"] = model.guidance_scale if args.guidance_scale is None else args.guidance_scale
    return records


def _clip_scores(model: Any, clips: torch.Tensor, reference: torch.Tensor, labels: list[int]) -> dict[str, Any]:
    """Scores of clips ``(B, T, 1, H, W)`` against the unmerged ``reference`` clips.

    PSNR is over every pixel of a clip; SSIM is the mean of its frames'; the classifier
    labels every frame (so accuracy is per frame, and the Frechet distance is over frame
    features); the temporal difference error says how much merging changed how each clip
    moves (:func:`toma.tools.eval.metrics.temporal_difference_error`).
    """
    from toma.tools.builtin.video import frames_for_classifier
    from toma.tools.eval.metrics import temporal_difference_error

    b, t = clips.shape[:2]
    preds, feats = model.classify(model.classifier, clips)
    return {
        "labels": [label for label in labels for _ in range(t)],
        "psnr": psnr(clips.flatten(1, 2), reference.flatten(1, 2)).tolist(),
        "ssim": ssim(clips.flatten(0, 1), reference.flatten(0, 1)).view(b, t).mean(dim=1).tolist(),
        "temporal_error": temporal_difference_error(clips, reference).tolist() if b and t > 1 else [],
        "preds": preds.flatten().tolist(),
        "features": feats.flatten(0, 1).double().tolist(),
        "preview": frames_for_classifier(clips[:2]).tolist(),  # the frames of two clips
    }


def summarise_builtin(gathered: list[dict[str, Any]], runs: list[tuple[str, float]]) -> list[dict[str, Any]]:
    """Merge every process's records into one row per variant."""
    ref = gathered[0].get("_reference")
    ref_mu, ref_sigma = (torch.tensor(ref["mu"]), torch.tensor(ref["sigma"])) if ref else (None, None)
    rows = []
    base_feats = None
    cached = any("+" in method for method, _ in runs)
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
            "fd_vs_none": frechet_to(feats, *feature_stats(base_feats)) if len(base_feats) > 1 else float("nan"),
            **timing(parts),
        }
        if ref_mu is not None:  # the video model has no statistics of real clips
            row["fd_real"] = frechet_to(feats, ref_mu, ref_sigma)
        if "temporal_error" in parts[0]:  # clips
            row.update(mean_and_sem("temporal_error", torch.tensor(sum((p["temporal_error"] for p in parts), []))))
        if cached:  # what each cache skipped, and whether merging moved it
            row.update(skip_stats(*_skips(parts), _cache_alone(gathered, runs, method)))
        rows.append(row)
    return add_speedup(rows)


def _skips(parts: list[dict[str, Any]]) -> tuple[list[list[int]], list[int]]:
    """Every process's skipped steps and step counts per batch, in rank order."""
    return sum((p["skip_steps"] for p in parts), []), sum((p["batch_calls"] for p in parts), [])


def _cache_alone(gathered: list[dict[str, Any]], runs: list[tuple[str, float]], method: str) -> list[list[int]] | None:
    """For a merged variant with a cache (``toma+fbcache:0.1``), the steps the same cache
    skipped on the unmerged model (``none+fbcache:0.1``) per batch, if that ran."""
    base, plus, cache = method.partition("+")
    alone = f"none+{cache}"
    if not plus or base == "none" or (alone, 0.0) not in runs:
        return None
    return _skips([g[key(alone, 0.0)] for g in gathered])[0]
