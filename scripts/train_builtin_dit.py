"""Train toma's built-in image DiT (a tiny class-conditional Flux transformer), offline.

Data: the built-in UNet's (``scripts/train_builtin.py``): scikit-learn's bundled digits
upsampled to 32 x 32, its 80/20 split with the same seed; only the train split is used.
The digit classifier that scores the samples is the UNet's, already shipped; this script
does not retrain it.

Model and objective: see ``toma/tools/builtin/dit.py``. Rectified flow (Flux's
objective): velocity target ``eps - x_0``, times drawn logit-normal (SD3), learned class
tokens and pooled vectors with 10% of labels dropped to the null class for guidance.
DiT-style "adaLN-zero" initialisation (modulation and output projections start at zero,
so every block starts as the identity) speeds up early training. Forward and backward
run under bfloat16 autocast (float32 weights and optimiser): on this CPU's AVX-512 BF16
units it roughly halves the step time, and the model is small and well conditioned.
EMA weights are saved in float16 (loaded as float32), and the accuracy check at the end
samples from the saved file, so the recorded numbers are those of the shipped weights.

The run is seeded and deterministic on a given CPU. One thread by default
(``--threads 1``), so that a shared 2-core machine keeps a core free.

    python scripts/train_builtin_dit.py                # full run, writes toma/tools/builtin/digits-dit/
    python scripts/train_builtin_dit.py --steps 3 --eval-samples 4 --eval-steps 2 \
        --out /tmp/dit-smoke                           # smoke test
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from train_builtin import LossLog, ema_update, load_digits_32, optimise, sample_accuracy, write_metadata  # noqa: E402

from toma.tools.builtin.unet import NULL_CLASS, NUM_CLASSES, classify  # noqa: E402
from toma.tools.builtin.dit import (  # noqa: E402
    COND_DIM,
    COND_TOKENS,
    DIT_DIR,
    TRANSFORMER_CONFIG,
    load_dit,
    sample,
    velocity,
)


def adaln_zero_(transformer: torch.nn.Module) -> None:
    """Zero the modulation linears and the output projection (DiT's adaLN-zero).

    Every gate starts at zero, so each block starts as the identity and the untrained
    network outputs zero; the diffusers default init instead adds random residuals.
    """
    modules = [transformer.norm_out.linear, transformer.proj_out]
    for block in transformer.transformer_blocks:
        modules += [block.norm1.linear, block.norm1_context.linear]
    for block in transformer.single_transformer_blocks:
        modules.append(block.norm.linear)
    for module in modules:
        torch.nn.init.zeros_(module.weight)
        torch.nn.init.zeros_(module.bias)


def train(data: dict[str, torch.Tensor], args: argparse.Namespace):
    """Train with the rectified-flow objective; returns EMA transformer, EMA embeddings, log, seconds, params."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    transformer = FluxTransformer2DModel(**TRANSFORMER_CONFIG)
    adaln_zero_(transformer)
    tokens = torch.nn.Parameter(torch.randn(NUM_CLASSES + 1, COND_TOKENS, COND_DIM, generator=gen))
    pooled = torch.nn.Parameter(torch.randn(NUM_CLASSES + 1, COND_DIM, generator=gen))
    ema = copy.deepcopy(transformer).requires_grad_(False)
    ema_tokens, ema_pooled = tokens.detach().clone(), pooled.detach().clone()
    params = list(transformer.parameters()) + [tokens, pooled]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    x, y = data["x_train"] * 2.0 - 1.0, data["y_train"]
    n_params = sum(p.numel() for p in transformer.parameters())
    print(f"transformer parameters: {n_params / 1e6:.3f} M", flush=True)

    log = LossLog(args)
    for step in range(args.steps):
        transformer.train()
        idx = torch.randint(0, len(y), (args.batch_size,), generator=gen)
        clean = x[idx]
        labels = y[idx].clone()
        labels[torch.rand(args.batch_size, generator=gen) < args.cond_dropout] = NULL_CLASS
        noise = torch.randn(clean.shape, generator=gen)
        # logit-normal times concentrate training on the middle of the path, where the
        # digit's shape is decided
        t = torch.sigmoid(torch.randn(args.batch_size, generator=gen))
        tb = t.view(-1, 1, 1, 1)
        noisy = (1.0 - tb) * clean + tb * noise
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            pred = velocity(transformer, noisy, t, tokens[labels], pooled[labels])
        loss = F.mse_loss(pred.float(), noise - clean)
        optimise(opt, params, loss, step, args)
        pairs = [
            *zip(ema.parameters(), transformer.parameters()),
            (ema_tokens, tokens.detach()),
            (ema_pooled, pooled.detach()),
        ]
        ema_update(pairs, step, args)
        log.add(step, loss.item())
    return ema.eval(), ema_tokens, ema_pooled, log.entries, log.elapsed, n_params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DIT_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1800, help="optimisation steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--ema", type=float, default=0.995)
    parser.add_argument("--cond-dropout", type=float, default=0.1)
    parser.add_argument(
        "--bf16", action=argparse.BooleanOptionalAction, default=True, help="bfloat16 autocast for forward and backward"
    )
    parser.add_argument("--guidance-scale", type=float, default=2.0, help="recommended sampling guidance")
    parser.add_argument("--eval-samples", type=int, default=100, help="generated images for the accuracy check")
    parser.add_argument("--eval-steps", type=int, default=20, help="Euler steps for the accuracy check")
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args()

    from safetensors.torch import save_file

    # rms_norm warns on every bf16 call that its weight stays float32, which is intended
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    torch.set_num_threads(args.threads)
    started = time.time()
    data = load_digits_32(args.seed)
    print(f"data: {len(data['y_train'])} train images", flush=True)

    transformer, tokens, pooled, log, train_s, n_params = train(data, args)

    args.out.mkdir(parents=True, exist_ok=True)
    transformer.to(torch.float16).save_pretrained(args.out / "transformer", safe_serialization=True)
    save_file(
        {"tokens": tokens.contiguous(), "pooled": pooled.contiguous()}, str(args.out / "class_embeddings.safetensors")
    )
    metadata = {
        "description": "class-conditional pixel-space rectified-flow Flux transformer on sklearn digits "
        "upsampled to 32x32 (1024 image tokens, patch size 1, 3x3 neighbourhood per token)",
        "guidance_scale": args.guidance_scale,
        "sampler": "Euler on the rectified flow, uniform times 1 -> 0",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
        "transformer_parameters": n_params,
        "torch": torch.__version__,
        "train_seconds": round(train_s, 1),
    }
    write_metadata(args.out, metadata)

    # recognisability check on the saved (float16-rounded) weights: unmerged, balanced
    # classes, the UNet's evaluation seeds
    model = load_dit(args.out)
    sample_acc, seconds_per_image = sample_accuracy(
        lambda labels, seeds, scale: sample(
            model, labels, seeds, steps=args.eval_steps, guidance_scale=scale, progress=False
        ),
        lambda images, labels: (classify(model.classifier, images)[0] == labels).float().mean().item(),
        args.eval_samples,
        (1.0, args.guidance_scale),
        25,
        "sample accuracy",
        args.eval_steps,
    )

    metadata.update(
        {
            "total_seconds": round(time.time() - started, 1),
            "sample_accuracy": sample_acc,
            "sample_seconds_per_image": seconds_per_image,
            "sample_accuracy_protocol": f"{args.eval_samples} images, classes balanced, seeds 10000.., "
            f"{args.eval_steps} Euler steps, unmerged, float32 inference, {args.threads} thread(s)",
            "loss_log": log,
        }
    )
    write_metadata(args.out, metadata, show=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
