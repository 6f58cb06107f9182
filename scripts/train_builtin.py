"""Train toma's built-in model and its digit classifier from scratch, offline.

Data: scikit-learn's bundled handwritten digits (1797 grey images, 8 x 8), upsampled
bicubically to 32 x 32 and split 80/20 (stratified, fixed seed). Nothing is downloaded.

Outputs (default ``toma/builtin/``, see ``toma/builtin.py`` for the file list):
the class-conditional UNet (EMA weights, float32 safetensors), the class embeddings,
the DDIM scheduler config, the classifier, reference feature statistics and
``metadata.json`` with the settings and the measured metrics.

The run is seeded and deterministic on CPU. It runs with one thread by default
(``--threads 1``) so that a shared 2-core machine keeps a core free; the default settings
took 48 minutes that way (43 for the UNet) with other jobs on the second core.

    python scripts/train_builtin.py                 # full run, writes toma/builtin/
    python scripts/train_builtin.py --steps 5 --classifier-epochs 1 \
        --eval-samples 10 --eval-steps 2 --out /tmp/builtin-smoke   # smoke test
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toma.tools.builtin.unet import (  # noqa: E402
    COND_TOKENS,
    IMAGE_SIZE,
    NULL_CLASS,
    NUM_CLASSES,
    SCHEDULER_CONFIG,
    UNET_CONFIG,
    BuiltinModel,
    DigitClassifier,
    classify,
    sample,
)


def load_digits_32(seed: int) -> dict[str, torch.Tensor]:
    """Digits upsampled to ``(N, 1, 32, 32)`` in ``[0, 1]`` with a stratified 80/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bicubic", align_corners=False)
    images = images.clamp(0.0, 1.0)
    labels = torch.tensor(digits.target, dtype=torch.long)
    idx_train, idx_test = train_test_split(
        np.arange(len(labels)), test_size=0.2, stratify=digits.target, random_state=seed
    )
    return {
        "x_train": images[idx_train],
        "y_train": labels[idx_train],
        "x_test": images[idx_test],
        "y_test": labels[idx_test],
        "x_all": images,
    }


def random_shift(images: torch.Tensor, max_shift: int, gen: torch.Generator) -> torch.Tensor:
    """Shift each image by an integer offset in ``[-max_shift, max_shift]``, filling with 0."""
    if max_shift == 0:
        return images
    n, _, h, w = images.shape
    padded = F.pad(images, (max_shift,) * 4)
    offsets = torch.randint(0, 2 * max_shift + 1, (n, 2), generator=gen)
    return torch.stack([padded[i, :, dy : dy + h, dx : dx + w] for i, (dy, dx) in enumerate(offsets.tolist())])


def train_classifier(data: dict[str, torch.Tensor], args: argparse.Namespace) -> tuple[DigitClassifier, float]:
    """Train the CNN on the train split; returns it and its test accuracy."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    torch.manual_seed(args.seed + 1)
    model = DigitClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = data["x_train"], data["y_train"]
    for epoch in range(args.classifier_epochs):
        model.train()
        perm = torch.randperm(len(y), generator=gen)
        total = 0.0
        for start in range(0, len(y), 64):
            idx = perm[start : start + 64]
            xb = random_shift(x[idx], 2, gen)
            # noise makes it robust to the small artefacts of generated samples
            xb = (xb + 0.05 * torch.randn(xb.shape, generator=gen)).clamp(0, 1)
            loss = F.cross_entropy(model(xb), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        print(f"classifier epoch {epoch + 1}/{args.classifier_epochs} loss {total / len(y):.4f}", flush=True)
    model.eval()
    preds, _ = classify(model, data["x_test"])
    return model, (preds == data["y_test"]).float().mean().item()


def write_metadata(folder: Path, metadata: dict, show: bool = False) -> None:
    """Write ``folder/metadata.json``; with ``show``, also print it without its loss log."""
    with open(folder / "metadata.json", "w", encoding="utf-8") as fh:
        json.dump(metadata, fh, indent=2)
    if show:
        print(json.dumps({k: v for k, v in metadata.items() if k != "loss_log"}, indent=2))


def sample_accuracy(
    draw, score, count: int, scales, chunk: int, name: str, steps: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Accuracy of freshly drawn samples at each guidance scale, and seconds per sample.

    ``count`` samples with balanced classes (label ``i % 10``) and seeds ``10000 + i``, drawn
    ``chunk`` at a time by ``draw(labels, seeds, scale)``; ``score(samples, labels)`` gives
    the accuracy. Returns ``({scale: accuracy}, {scale: seconds per sample})`` keyed by
    ``str(scale)``, as the metadata stores them; ``name`` labels the printed lines.
    """
    labels = torch.arange(count) % NUM_CLASSES
    seeds = list(range(10_000, 10_000 + count))
    accuracy, seconds = {}, {}
    for scale in sorted(set(scales)):
        start = time.time()
        samples = torch.cat([draw(labels[i : i + chunk], seeds[i : i + chunk], scale) for i in range(0, count, chunk)])
        seconds[str(scale)] = round((time.time() - start) / count, 3)
        accuracy[str(scale)] = round(score(samples, labels), 4)
        print(
            f"{name} (guidance {scale}, {steps} Euler steps): {accuracy[str(scale)]:.4f} [{time.time() - start:.0f}s]",
            flush=True,
        )
    return accuracy, seconds


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to 5% of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def optimise(opt: torch.optim.Optimizer, params: list, loss: torch.Tensor, step: int, args: argparse.Namespace) -> None:
    """One optimiser step at the scheduled learning rate, gradients clipped to norm 1.

    A parameter group's optional ``lr_mult`` scales the schedule for that group.
    """
    for group in opt.param_groups:
        group["lr"] = lr_at(step, args) * group.get("lr_mult", 1.0)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def ema_update(pairs: list[tuple[torch.Tensor, torch.Tensor]], step: int, args: argparse.Namespace) -> None:
    """Move each ``(average, current)`` pair's average towards the current weights.

    EMA with warm-up: early steps track the fast-moving weights closely.
    """
    decay = min(args.ema, (1 + step) / (10 + step))
    with torch.no_grad():
        for average, current in pairs:
            average.lerp_(current, 1 - decay)


class LossLog:
    """Running mean of the loss, printed and recorded every ``args.log_every`` steps."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.entries: list[dict] = []
        self.t0 = time.time()
        self.running = 0.0
        self.first: int | None = None  # the first step counted (a resumed run starts late)

    def add(self, step: int, loss: float) -> None:
        """Count the loss of ``step``; log the mean at the end of each period."""
        args = self.args
        self.first = step if self.first is None else self.first
        self.running += loss
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            elapsed = time.time() - self.t0
            mean = self.running / ((step % args.log_every) + 1)
            self.running = 0.0
            self.entries.append({"step": step + 1, "loss": round(mean, 5), "elapsed_s": round(elapsed, 1)})
            eta = elapsed / (step + 1 - self.first) * (args.steps - step - 1)
            print(f"step {step + 1}/{args.steps} loss {mean:.4f} {elapsed:.0f}s elapsed, eta {eta:.0f}s", flush=True)

    @property
    def elapsed(self) -> float:
        """Seconds since the log was started."""
        return time.time() - self.t0


def training_batch(
    x: torch.Tensor, y: torch.Tensor, noise_sched, gen: torch.Generator, args: argparse.Namespace
) -> dict[str, torch.Tensor]:
    """One random training batch of the epsilon objective, drawn from ``gen``.

    Args:
        x: training images ``(N, 1, 32, 32)`` in ``[-1, 1]``; y: their labels ``(N,)``.
        noise_sched: the DDPM scheduler that noises the images.
        args: ``batch_size`` (B) and ``cond_dropout`` (share of labels replaced by the
            null class, for classifier-free guidance).

    Returns:
        ``noisy`` ``(B, 1, 32, 32)``, ``t`` ``(B,)``, ``labels`` ``(B,)`` and the target
        ``noise`` ``(B, 1, 32, 32)``.
    """
    idx = torch.randint(0, len(y), (args.batch_size,), generator=gen)
    clean = random_shift(x[idx] + 1.0, 1, gen) - 1.0  # shift in [0, 2] so padding is background
    labels = y[idx].clone()
    drop = torch.rand(args.batch_size, generator=gen) < args.cond_dropout
    labels[drop] = NULL_CLASS
    noise = torch.randn(clean.shape, generator=gen)
    t = torch.randint(0, noise_sched.config.num_train_timesteps, (args.batch_size,), generator=gen)
    return {"noisy": noise_sched.add_noise(clean, noise, t), "t": t, "labels": labels, "noise": noise}


def epsilon_loss(unet, embeddings: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean squared error of the UNet's noise prediction on a :func:`training_batch`.

    ``embeddings`` ``(11, 4, 64)`` are the class conditioning tokens (row 10: null class).
    """
    pred = unet(batch["noisy"], batch["t"], encoder_hidden_states=embeddings[batch["labels"]]).sample
    return F.mse_loss(pred, batch["noise"])


def train_unet(data: dict[str, torch.Tensor], args: argparse.Namespace):
    """Train the conditional UNet with the epsilon objective; returns EMA UNet, embeddings, log."""
    from diffusers import DDPMScheduler, UNet2DConditionModel

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    unet = UNet2DConditionModel(**UNET_CONFIG)
    embeddings = torch.nn.Parameter(
        torch.randn(NUM_CLASSES + 1, COND_TOKENS, UNET_CONFIG["cross_attention_dim"], generator=gen)
    )
    ema_unet = copy.deepcopy(unet).requires_grad_(False)
    ema_emb = embeddings.detach().clone()
    noise_sched = DDPMScheduler.from_config(SCHEDULER_CONFIG)
    params = list(unet.parameters()) + [embeddings]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    x, y = data["x_train"] * 2.0 - 1.0, data["y_train"]
    n_params = sum(p.numel() for p in unet.parameters())
    print(f"UNet parameters: {n_params / 1e6:.2f} M", flush=True)

    log = LossLog(args)
    for step in range(args.steps):
        unet.train()
        loss = epsilon_loss(unet, embeddings, training_batch(x, y, noise_sched, gen, args))
        optimise(opt, params, loss, step, args)
        ema_update([*zip(ema_unet.parameters(), unet.parameters()), (ema_emb, embeddings.detach())], step, args)
        log.add(step, loss.item())
    return ema_unet.eval(), ema_emb, log.entries, log.elapsed, n_params


def feature_stats(classifier: DigitClassifier, images: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean ``(64,)`` and covariance ``(64, 64)`` of classifier features, float64."""
    _, feats = classify(classifier, images)
    feats = feats.double()
    return {"mu": feats.mean(0), "sigma": torch.cov(feats.T)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "toma" / "tools" / "builtin")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1200, help="UNet optimisation steps")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--ema", type=float, default=0.995)
    parser.add_argument("--cond-dropout", type=float, default=0.1)
    parser.add_argument("--guidance-scale", type=float, default=2.0, help="recommended sampling guidance")
    parser.add_argument("--classifier-epochs", type=int, default=15)
    parser.add_argument("--eval-samples", type=int, default=100, help="generated images for the accuracy check")
    parser.add_argument("--eval-steps", type=int, default=50, help="DDIM steps for the accuracy check")
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args()

    from diffusers import DDIMScheduler
    from safetensors.torch import save_file

    torch.set_num_threads(args.threads)
    started = time.time()
    data = load_digits_32(args.seed)
    print(f"data: {len(data['y_train'])} train, {len(data['y_test'])} test images", flush=True)

    classifier, clf_acc = train_classifier(data, args)
    print(f"classifier test accuracy on real digits: {clf_acc:.4f}", flush=True)

    unet, embeddings, log, train_s, n_params = train_unet(data, args)

    args.out.mkdir(parents=True, exist_ok=True)
    unet.save_pretrained(args.out / "digits-unet", safe_serialization=True)
    DDIMScheduler.from_config(SCHEDULER_CONFIG).save_pretrained(args.out / "scheduler")
    save_file({"class_embeddings": embeddings.contiguous()}, str(args.out / "class_embeddings.safetensors"))
    save_file({k: v.contiguous() for k, v in classifier.state_dict().items()}, str(args.out / "classifier.safetensors"))
    stats = feature_stats(classifier, data["x_all"])
    save_file({k: v.contiguous() for k, v in stats.items()}, str(args.out / "reference_stats.safetensors"))

    # recognisability check: unmerged samples, balanced classes, fixed seeds
    model = BuiltinModel(
        unet=unet,
        scheduler_config=dict(DDIMScheduler.from_config(SCHEDULER_CONFIG).config),
        class_embeddings=embeddings,
        classifier=classifier,
        reference_mu=stats["mu"],
        reference_sigma=stats["sigma"],
        metadata={"guidance_scale": args.guidance_scale},
    )
    labels = torch.arange(args.eval_samples) % NUM_CLASSES
    seeds = list(range(10_000, 10_000 + args.eval_samples))
    sample_acc = {}
    for scale in sorted({1.0, args.guidance_scale}):
        t_s = time.time()
        images = torch.cat(
            [
                sample(
                    model,
                    labels[i : i + 50],
                    seeds[i : i + 50],
                    steps=args.eval_steps,
                    guidance_scale=scale,
                    progress=False,
                )
                for i in range(0, args.eval_samples, 50)
            ]
        )
        preds, _ = classify(classifier, images)
        sample_acc[str(scale)] = round((preds == labels).float().mean().item(), 4)
        print(
            f"sample accuracy (guidance {scale}, {args.eval_steps} DDIM steps): "
            f"{sample_acc[str(scale)]:.4f} [{time.time() - t_s:.0f}s]",
            flush=True,
        )

    metadata = {
        "description": "class-conditional pixel-space DDPM on sklearn digits upsampled to 32x32",
        "guidance_scale": args.guidance_scale,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
        "unet_parameters": n_params,
        "torch": torch.__version__,
        "train_seconds_unet": round(train_s, 1),
        "total_seconds": round(time.time() - started, 1),
        "classifier_test_accuracy_real": round(clf_acc, 4),
        "sample_accuracy": sample_acc,
        "sample_accuracy_protocol": f"{args.eval_samples} images, classes balanced, seeds 10000.., "
        f"{args.eval_steps} DDIM steps, unmerged",
        "loss_log": log,
    }
    write_metadata(args.out, metadata, show=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
