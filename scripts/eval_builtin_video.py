"""Measure the built-in video DiT unmerged and with ToMA: per-frame accuracy, fidelity, temporal consistency, time.

Samples the same classes (balanced, ``i % 10``) from the same per-clip seeds with the
unmerged Wan transformer and with ToMA at ``--ratio`` in four variants:

- ``toma``: facility-location destinations, spatio-temporal tiles (``tile_frames=2``:
  2 frames x 4 x 4 tokens);
- ``toma-2d``: the same with 2-D tiles (``tile_frames=1``: 1 frame x 4 x 4 tokens, the
  video default since 2-frame tiles measured no more faithful here);
- ``toma-random`` / ``toma-grid``: random / grid destinations, spatio-temporal tiles.

Scores (means over clips, with standard errors over clips, since a clip's frames are not
independent): per-frame accuracy of the model's frame classifier; PSNR (over the whole
clip) and SSIM (per frame, averaged) against the unmerged clip; temporal consistency
against the unmerged clip (:func:`toma.tools.eval.metrics.temporal_difference_error`, mean
absolute change of frame-to-frame differences, pixels in ``[0, 1]``); the Frechet distance
of the frame classifier's features to those of frames of real test-split clips; sampling
time. Times are interleaved: every batch of clips runs all variants in turn (ToMA applied
and removed around each), and the median seconds per clip over batches is reported, so
load that changes over the run hits all variants alike. The seeds (``--seed``, default
20000) differ from those of the training script's check.

    python scripts/eval_builtin_video.py                        # 100 clips, 10 steps, ratio 0.5
    python scripts/eval_builtin_video.py --num-clips 20 --strip video.png --json video.json
    python scripts/eval_builtin_video.py --variants none,toma-2d --set tile_size=2   # any ToMA option
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import toma  # noqa: E402
from toma.config import parse_option  # noqa: E402
from toma.tools.builtin.unet import NUM_CLASSES  # noqa: E402
from toma.tools.builtin.video import (  # noqa: E402
    VIDEO_DIR,
    classify_frames,
    load_video_dit,
    moving_digit_clips,
    sample_video,
    shrink_digits,
)
from toma.tools.eval.metrics import feature_stats, frechet_distance, psnr, ssim, temporal_difference_error  # noqa: E402

# name -> apply_toma options (None: unmerged)
VARIANTS: dict[str, dict | None] = {
    "none": None,
    "toma": {"selection": "facility", "tile_frames": 2},
    "toma-2d": {"selection": "facility", "tile_frames": 1},
    "toma-random": {"selection": "random", "tile_frames": 2},
    "toma-grid": {"selection": "grid", "tile_frames": 2},
}


def mean_se(values: torch.Tensor) -> tuple[float, float]:
    """Mean and standard error of the mean of per-clip values ``(N,)``."""
    values = values.double()
    se = values.std().item() / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return values.mean().item(), se


def real_frame_stats(classifier, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and covariance of frame-classifier features over frames of test-split clips."""
    from train_builtin import load_digits_32

    data = load_digits_32(seed)
    clips = moving_digit_clips(shrink_digits(data["x_test"]), torch.Generator().manual_seed(seed + 2))
    _, feats = classify_frames(classifier, clips)
    return feature_stats(feats.flatten(0, 1))


def save_strip(rows: list[torch.Tensor], path: Path) -> None:
    """One row per clip ``(T, 1, H, W)``: its frames side by side, 3x upscaled, as a PNG."""
    from PIL import Image

    pad = lambda clip: torch.nn.functional.pad(clip[:, 0], (0, 1, 0, 1), value=0.5)  # noqa: E731
    grid = torch.cat([torch.cat(list(pad(clip)), dim=1) for clip in rows], dim=0)
    pixels = (grid * 255).round().to(torch.uint8).numpy()
    Image.fromarray(pixels, mode="L").resize((pixels.shape[1] * 3, pixels.shape[0] * 3), Image.NEAREST).save(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, default=VIDEO_DIR)
    parser.add_argument("--num-clips", type=int, default=100)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    parser.add_argument("--seed", type=int, default=20_000, help="seed of clip 0; clip i uses seed + i")
    parser.add_argument("--guidance-scale", type=float, default=None, help="default: the model's recommendation")
    parser.add_argument(
        "--proportional-attention",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="log-mass bias in merged self-attention for every ToMA variant (default: Wan's, off)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="OPTION=VALUE",
        help="a ToMA option for every ToMA variant, e.g. --set tile_size=2 --set 'blocks={\"blocks\": (3,)}'",
    )
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--strip", type=Path, default=None, help="write frames of the first 3 clips of each variant here"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()

    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or "none" not in names:
        parser.error(f"--variants must include 'none' and name only {list(VARIANTS)}; got {names}")
    try:
        extra = dict(parse_option(text) for text in args.set)
    except ValueError as err:
        parser.error(f"--set: {err}")
    if args.num_clips < 2 or args.steps < 1 or args.batch_size < 1:
        parser.error("--num-clips must be >= 2, --steps and --batch-size >= 1")

    torch.set_num_threads(args.threads)
    model = load_video_dit(args.path)
    scale = model.guidance_scale if args.guidance_scale is None else args.guidance_scale
    labels = torch.arange(args.num_clips) % NUM_CLASSES
    seeds = [args.seed + i for i in range(args.num_clips)]

    def run(name: str, lab: torch.Tensor, sds: list[int], steps: int):
        options = VARIANTS[name]
        if options is not None:
            bias = (
                {} if args.proportional_attention is None else {"proportional_attention": args.proportional_attention}
            )
            options = {**options, **bias, **extra}
        patch = None if options is None else toma.apply_toma(model.transformer, ratio=args.ratio, **options)
        try:
            start = time.perf_counter()
            clips = sample_video(model, lab, sds, steps=steps, guidance_scale=scale, progress=False)
            return clips, time.perf_counter() - start, patch
        finally:
            if patch is not None:
                toma.remove_toma(model.transformer)

    for name in names:  # warm-up: one-off set-up stays out of the times
        run(name, labels[:1], seeds[:1], 1)
    clips: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    per_clip_s: dict[str, list[float]] = {n: [] for n in names}
    merged_blocks: dict[str, list[str]] = {}
    started = time.time()
    for i in range(0, args.num_clips, args.batch_size):
        lab, sds = labels[i : i + args.batch_size], seeds[i : i + args.batch_size]
        for name in names:
            out, seconds, patch = run(name, lab, sds, args.steps)
            clips[name].append(out)
            per_clip_s[name].append(seconds / len(sds))
            if patch is not None:
                merged_blocks[name] = [p.name for p in patch.patched]
        print(
            f"{min(i + args.batch_size, args.num_clips)}/{args.num_clips} clips [{time.time() - started:.0f}s]",
            file=sys.stderr,
            flush=True,
        )
    videos = {n: torch.cat(c) for n, c in clips.items()}

    real_mu, real_sigma = real_frame_stats(model.classifier, int(model.metadata.get("settings", {}).get("seed", 0)))
    base = videos["none"]
    base_pred, _ = classify_frames(model.classifier, base)
    results: dict = {
        "protocol": f"{args.num_clips} clips, classes i % 10, seeds {args.seed}.., {args.steps} Euler steps, "
        f"guidance {scale}, ratio {args.ratio}, proportional attention {args.proportional_attention}, "
        f"options {extra or 'none'}, "
        f"{args.threads} thread(s), batch {args.batch_size}; "
        "mean +- standard error over clips",
        "model_steps_trained": model.metadata.get("steps_done"),
        "merged_blocks": merged_blocks,
        "variants": {},
    }
    for name, video in videos.items():
        pred, feats = classify_frames(model.classifier, video)
        acc, acc_se = mean_se((pred == labels[:, None]).double().mean(dim=1))
        row = {
            "per_frame_accuracy": round(acc, 4),
            "per_frame_accuracy_se": round(acc_se, 4),
            "frechet_distance_to_real_frames": round(
                frechet_distance(*feature_stats(feats.flatten(0, 1)), real_mu, real_sigma), 3
            ),
            "median_seconds_per_clip": round(statistics.median(per_clip_s[name]), 3),
            "finite": bool(torch.isfinite(video).all()),
        }
        if name != "none":
            flat = lambda v: v.flatten(1, 2)  # noqa: E731  # (N, T, 1, H, W) -> (N, T, H, W): PSNR over the clip
            frames = lambda v: v.flatten(0, 1)  # noqa: E731  # (N * T, 1, H, W): SSIM per frame
            p_mean, p_se = mean_se(psnr(flat(video), flat(base)))
            s_mean, s_se = mean_se(ssim(frames(video), frames(base)).reshape(args.num_clips, -1).mean(dim=1))
            t_mean, t_se = mean_se(temporal_difference_error(video, base))
            row.update(
                {
                    "per_frame_agreement_with_unmerged": round((pred == base_pred).double().mean().item(), 4),
                    "psnr_vs_unmerged_db": round(p_mean, 2),
                    "psnr_se": round(p_se, 2),
                    "ssim_vs_unmerged": round(s_mean, 4),
                    "ssim_se": round(s_se, 4),
                    "temporal_difference_error": round(t_mean, 5),
                    "temporal_difference_error_se": round(t_se, 5),
                    "time_ratio_vs_unmerged": round(
                        statistics.median(per_clip_s[name]) / statistics.median(per_clip_s["none"]), 3
                    ),
                }
            )
        results["variants"][name] = row
    print(json.dumps(results, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    if args.strip is not None:
        save_strip([videos[n][k] for k in range(min(3, args.num_clips)) for n in names], args.strip)
    return 0


if __name__ == "__main__":
    sys.exit(main())
