"""Measure the built-in DiT unmerged and with ToMA: classifier accuracy, PSNR/SSIM, time.

Samples the same classes (balanced, ``i % 10``) from the same per-image seeds with the
unmerged transformer and with ``toma.apply_toma(transformer, ratio=...)``, scores both
with the built-in digit classifier, compares the ToMA images with the unmerged ones and
times the sampling (after a one-step warm-up per variant, so one-off set-up is excluded).
The seeds (``--seed``, default 20000) differ from those of the training script's check,
which chose the recommended guidance scale.

    python scripts/eval_builtin_dit.py                       # 100 images, 20 steps, ratio 0.5
    python scripts/eval_builtin_dit.py --num-images 200 --grid dit.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import toma  # noqa: E402
from toma.tools.builtin.unet import NUM_CLASSES, classify  # noqa: E402
from toma.tools.builtin.dit import DIT_DIR, BuiltinDiT, load_dit, sample  # noqa: E402
from toma.tools.eval.metrics import psnr, ssim  # noqa: E402


def generate(
    model: BuiltinDiT, labels: torch.Tensor, seeds: list[int], args: argparse.Namespace
) -> tuple[torch.Tensor, float]:
    """Images ``(N, 1, 32, 32)`` for ``labels`` ``(N,)`` and the sampling seconds per image."""
    sample(model, labels[:1], seeds[:1], steps=1, guidance_scale=args.guidance_scale, progress=False)
    start = time.perf_counter()
    images = torch.cat(
        [
            sample(
                model,
                labels[i : i + args.batch_size],
                seeds[i : i + args.batch_size],
                steps=args.steps,
                guidance_scale=args.guidance_scale,
                progress=False,
            )
            for i in range(0, len(seeds), args.batch_size)
        ]
    )
    return images, (time.perf_counter() - start) / len(seeds)


def save_grid(rows: list[torch.Tensor], path: Path) -> None:
    """One row of images per tensor ``(N, 1, 32, 32)`` in ``[0, 1]``, 2x upscaled, as a PNG."""
    from PIL import Image

    grid = torch.cat([torch.cat(list(r[:, 0]), dim=1) for r in rows], dim=0)
    pixels = (grid * 255).round().to(torch.uint8).numpy()
    Image.fromarray(pixels, mode="L").resize((pixels.shape[1] * 2, pixels.shape[0] * 2), Image.NEAREST).save(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, default=DIT_DIR)
    parser.add_argument("--num-images", type=int, default=100)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=20_000, help="seed of image 0; image i uses seed + i")
    parser.add_argument("--guidance-scale", type=float, default=None, help="default: the model's recommendation")
    parser.add_argument("--batch-size", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--grid", type=Path, default=None, help="write the first 20 images of each variant here")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model = load_dit(args.path)
    labels = torch.arange(args.num_images) % NUM_CLASSES
    seeds = [args.seed + i for i in range(args.num_images)]

    base, base_s = generate(model, labels, seeds, args)
    patch = toma.apply_toma(model.transformer, ratio=args.ratio)
    try:
        merged, merged_s = generate(model, labels, seeds, args)
    finally:
        toma.remove_toma(model.transformer)

    base_pred, _ = classify(model.classifier, base)
    merged_pred, _ = classify(model.classifier, merged)
    results = {
        "protocol": f"{args.num_images} images, classes i % 10, seeds {args.seed}.., {args.steps} Euler steps, "
        f"guidance {model.guidance_scale if args.guidance_scale is None else args.guidance_scale}, "
        f"{args.threads} thread(s), batch {args.batch_size}",
        "merged_blocks": [p.name for p in patch.patched],
        "accuracy_unmerged": round((base_pred == labels).float().mean().item(), 4),
        f"accuracy_toma_{args.ratio}": round((merged_pred == labels).float().mean().item(), 4),
        "agreement_toma_vs_unmerged": round((merged_pred == base_pred).float().mean().item(), 4),
        "psnr_toma_vs_unmerged_db": round(psnr(merged, base).mean().item(), 2),
        "ssim_toma_vs_unmerged": round(ssim(merged, base).mean().item(), 4),
        "seconds_per_image_unmerged": round(base_s, 3),
        f"seconds_per_image_toma_{args.ratio}": round(merged_s, 3),
        "finite": bool(torch.isfinite(merged).all()),
    }
    print(json.dumps(results, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    if args.grid is not None:
        save_grid([base[:20], merged[:20]], args.grid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
