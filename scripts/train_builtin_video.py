"""Train toma's built-in video DiT (a tiny class-conditional Wan transformer) and its frame classifier, offline.

Data: the built-in UNet's digits (``scripts/train_builtin.py``: scikit-learn's bundled
digits upsampled to 32 x 32, its 80/20 split with the same seed), shrunk to 10 x 10 and
moved along random bouncing trajectories over 8 frames of 16 x 16
(:func:`toma.tools.builtin.video.moving_digit_clips`). Training uses the train split
only; fresh trajectories are drawn every step.

1. Frame classifier: the UNet classifier's architecture, trained from scratch on single
   frames of train-split clips (upsampled to 32 x 32), scored on frames of test-split
   clips ("real clips") and saved.
2. Video DiT: see ``toma/tools/builtin/video.py``. Rectified flow, logit-normal times,
   learned class tokens with 10% of labels dropped to the null class for guidance;
   "adaLN-zero" start (the gates and the output projection start at zero; the
   cross-attention, the class's only path, keeps its default initialisation: see
   :func:`adaln_zero_`); bfloat16 autocast for forward and backward, as the image DiT.
   The shared helpers of ``train_builtin.py`` (``optimise``, ``ema_update``, ``LossLog``,
   ``lr_at``) drive the loop. Every checkpoint records the "class gap" (:func:`class_gap`):
   how much worse the EMA model predicts held-out clips given wrong labels, which stays
   near 0 while the model ignores its class.

Clip-length curriculum (``--stages``): training runs through stages of
``FRAMESxBATCH:STEPS`` (:func:`clip_schedule`, a pure function of the step). Wan takes any
frame count (3-D rotary positions, a per-token stem), so the default recipe spends most
of its steps on 2-frame clips (512 tokens: attention ~16x and the rest ~4x cheaper than
8 frames) at batch 32, which shows the class path ~7x more digits per second (measured
at 1 thread: 1.37 s per 2x32 step against 2.6 s per 8x8 step), then finishes on 8-frame
clips at batch 8 (2,048 tokens, the shipped model's use) for temporal consistency. The
learning-rate schedule (warm-up, cosine) and the EMA run over the total step count; the
class-gap probe and the closing check always use 8-frame clips. Defaults:
``--stages 2x32:2400 8x8:700`` (about 55 + 31 minutes at 1 thread on an idle machine,
about 78 + 43 when three jobs share the two cores: 2.0 s per 2x32 step measured, 3.7 s per
8x8 step estimated). ``--max-minutes`` cuts the last stage if the machine is slower.

Checkpoints of the EMA weights (float16, in the shipped layout, with metadata marking them
partial) are written every ``--checkpoint-every`` steps, so a usable model exists if the run
is stopped. ``--max-minutes`` ends training early (and says so in the metadata) if the
machine is slower than planned. At the end, a short accuracy check samples the saved
weights.

The run is seeded and deterministic on a given CPU (unless ``--max-minutes`` cuts it).

    python scripts/train_builtin_video.py                 # full run, writes toma/tools/builtin/digits-video/
    python scripts/train_builtin_video.py --stages 2x4:2 8x2:1 --classifier-epochs 1 --eval-samples 2 \
        --eval-steps 1 --out /tmp/video-smoke             # smoke test
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from train_builtin import LossLog, ema_update, load_digits_32, optimise, sample_accuracy, write_metadata  # noqa: E402

from toma.tools.builtin.unet import NULL_CLASS, NUM_CLASSES, DigitClassifier  # noqa: E402
from toma.tools.builtin.video import (  # noqa: E402
    COND_DIM,
    COND_TOKENS,
    VIDEO_DIR,
    classify_frames,
    frames_for_classifier,
    load_video_dit,
    moving_digit_clips,
    sample_video,
    shift_times,
    shrink_digits,
    transformer_config,
    velocity,
)


class Stage(NamedTuple):
    """One stage of the clip-length curriculum: ``steps`` steps of ``batch`` clips of ``frames`` frames."""

    frames: int
    batch: int
    steps: int


MAX_FRAMES = 64  # the transformer's rope_max_seq_len bounds the frame positions


def parse_stage(text: str) -> Stage:
    """``"FRAMESxBATCH:STEPS"`` (e.g. ``"2x32:2400"``) as a :class:`Stage`; ``ValueError`` if malformed."""
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*:\s*(\d+)\s*", text)
    if match is None:
        raise ValueError(f"--stages entries must look like FRAMESxBATCH:STEPS (e.g. 2x32:2400); got {text!r}")
    stage = Stage(*(int(g) for g in match.groups()))
    if not 1 <= stage.frames <= MAX_FRAMES:
        raise ValueError(f"--stages frames must be in [1, {MAX_FRAMES}]; got {stage.frames} in {text!r}")
    if stage.batch < 1 or stage.steps < 1:
        raise ValueError(f"--stages batch and steps must be >= 1; got {text!r}")
    return stage


def clip_schedule(step: int, stages: list[Stage]) -> tuple[int, int]:
    """``(frames, batch)`` of the clips at 0-based ``step`` of the curriculum ``stages`` (run in order).

    Raises ``ValueError`` for a step outside ``[0, sum of the stages' steps)`` or no stages.
    """
    if not stages:
        raise ValueError("stages must hold at least one stage")
    if step < 0:
        raise ValueError(f"step must be >= 0; got {step}")
    end = 0
    for stage in stages:
        end += stage.steps
        if step < end:
            return stage.frames, stage.batch
    raise ValueError(f"step must be < {end} (the stages' total steps); got {step}")


def train_frame_classifier(digits: torch.Tensor, labels: torch.Tensor, args: argparse.Namespace) -> DigitClassifier:
    """Train the classifier on ``--classifier-frames`` random frames of a fresh clip per digit per epoch."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    torch.manual_seed(args.seed + 1)
    model = DigitClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(args.classifier_epochs):
        model.train()
        clips = moving_digit_clips(digits, gen)  # (N, T, 1, S, S)
        pick = torch.randint(0, clips.shape[1], (len(labels), args.classifier_frames), generator=gen)
        frames = clips[torch.arange(len(labels))[:, None], pick]  # (N, k, 1, S, S)
        y = labels[:, None].expand(-1, args.classifier_frames).reshape(-1)
        # noise makes it robust to the small artefacts of generated frames
        x = (frames + 0.05 * torch.randn(frames.shape, generator=gen)).clamp(0, 1)
        x = frames_for_classifier(x.reshape(len(labels), args.classifier_frames, *frames.shape[2:]))
        perm = torch.randperm(len(y), generator=gen)
        total = 0.0
        for start in range(0, len(y), 64):
            idx = perm[start : start + 64]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        print(f"frame classifier epoch {epoch + 1}/{args.classifier_epochs} loss {total / len(y):.4f}", flush=True)
    return model.eval().requires_grad_(False)


def adaln_zero_(transformer: torch.nn.Module) -> None:
    """Zero the gated residuals and the output projection (DiT's adaLN-zero).

    Wan's modulation is ``scale_shift_table + time_proj(temb)``: zeroing both zeroes the
    gates, so self-attention and feed-forward start as the identity and the network at
    output zero. The cross-attention keeps its default initialisation: it is the class's
    only way in (Wan has no pooled vector), and with its output projection at zero the
    class tokens, text embedder and key/value projections get no gradient until that
    projection has grown; a run started that way still ignored the class after 900 steps
    (right- and wrong-label losses within 0.5%, samples at chance).
    """
    tensors = [
        transformer.condition_embedder.time_proj.weight,
        transformer.condition_embedder.time_proj.bias,
        transformer.proj_out.weight,
        transformer.proj_out.bias,
        transformer.scale_shift_table,
    ]
    for block in transformer.blocks:
        tensors.append(block.scale_shift_table)
    with torch.no_grad():
        for tensor in tensors:
            tensor.zero_()


def is_class_path(name: str) -> bool:
    """Whether a Wan parameter carries the class: the text embedder and each block's cross-attention."""
    return name.startswith("condition_embedder.text_embedder.") or ".attn2." in name or ".norm2." in name


def param_groups(transformer: torch.nn.Module, tokens: torch.Tensor, cond_lr_mult: float) -> list[dict]:
    """AdamW groups: the class path (tokens and :func:`is_class_path`) at ``cond_lr_mult`` times the rate.

    The class's only way in is the cross-attention, and at one learning rate the model took
    1,800 steps to make half its frames the right class.
    """
    cond = [p for n, p in transformer.named_parameters() if is_class_path(n)]
    rest = [p for n, p in transformer.named_parameters() if not is_class_path(n)]
    return [{"params": rest, "lr_mult": 1.0}, {"params": cond + [tokens], "lr_mult": cond_lr_mult}]


def make_probe(digits: torch.Tensor, labels: torch.Tensor, seed: int, count: int = 16) -> dict[str, torch.Tensor]:
    """Fixed noisy clips of ``count`` held-out digits at ``t = 0.8``, for :func:`class_gap`."""
    gen = torch.Generator().manual_seed(seed)
    clean = moving_digit_clips(digits[:count], gen) * 2.0 - 1.0
    noise = torch.randn(clean.shape, generator=gen)
    t = torch.full((count,), 0.8)
    return {"noisy": 0.2 * clean + 0.8 * noise, "target": noise - clean, "t": t, "labels": labels[:count]}


@torch.no_grad()
def class_gap(transformer, tokens: torch.Tensor, probe: dict[str, torch.Tensor]) -> float:
    """Relative loss increase when every probe clip gets a wrong label (label + 3 mod 10).

    About 0 for a model that ignores its class tokens, large when the class decides the
    digit: at ``t = 0.8`` the digit's shape is still open, so the label matters.
    """
    right = F.mse_loss(velocity(transformer, probe["noisy"], probe["t"], tokens[probe["labels"]]), probe["target"])
    wrong_labels = (probe["labels"] + 3) % NUM_CLASSES
    wrong = F.mse_loss(velocity(transformer, probe["noisy"], probe["t"], tokens[wrong_labels]), probe["target"])
    return (wrong / right - 1.0).item()


def save(out: Path, transformer, tokens: torch.Tensor, classifier: DigitClassifier, metadata: dict) -> None:
    """Write the shipped layout: float16 transformer, class tokens, frame classifier, metadata."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(transformer).to(torch.float16).save_pretrained(out / "transformer", safe_serialization=True)
    save_file({"tokens": tokens.contiguous()}, str(out / "class_embeddings.safetensors"))
    save_file(
        {k: v.contiguous() for k, v in classifier.state_dict().items()}, str(out / "frame_classifier.safetensors")
    )
    write_metadata(out, metadata)


def train(
    digits: torch.Tensor,
    labels: torch.Tensor,
    classifier: DigitClassifier,
    metadata: dict,
    probe: dict[str, torch.Tensor],
    args: argparse.Namespace,
):
    """Rectified-flow training; returns EMA transformer, EMA tokens, log, seconds, params, steps done.

    ``probe`` (:func:`make_probe`) measures at every checkpoint how much the EMA model uses
    the class (:func:`class_gap`), recorded in the metadata's ``class_gap_log``.
    """
    from diffusers import WanTransformer3DModel

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    transformer = WanTransformer3DModel(**transformer_config(args.stem_frames))
    adaln_zero_(transformer)
    tokens = torch.nn.Parameter(torch.randn(NUM_CLASSES + 1, COND_TOKENS, COND_DIM, generator=gen))
    first = 0
    if args.resume is not None:
        # a checkpoint holds the EMA weights only: training and EMA both restart from them, with
        # fresh optimiser moments, at the checkpoint's step of the schedule, on a data stream
        # seeded by that step (so a resumed run is seeded too, but not the uninterrupted one)
        saved = load_video_dit(args.resume)
        transformer.load_state_dict(saved.transformer.state_dict())
        tokens = torch.nn.Parameter(saved.class_tokens.clone())
        first = int(saved.metadata.get("steps_done", 0))
        gen = torch.Generator().manual_seed(args.seed + first)
        print(f"resumed from {args.resume} at step {first}", flush=True)
    ema = copy.deepcopy(transformer).requires_grad_(False)
    ema_tokens = tokens.detach().clone()
    params = list(transformer.parameters()) + [tokens]
    opt = torch.optim.AdamW(
        param_groups(transformer, tokens, args.cond_lr_mult), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0
    )
    n_params = sum(p.numel() for p in transformer.parameters())
    print(f"transformer parameters: {n_params / 1e6:.3f} M", flush=True)

    log = LossLog(args)
    gaps: list[dict] = []
    done = 0
    current = None
    for step in range(first, args.steps):
        transformer.train()
        frames, batch = clip_schedule(step, args.stages)
        if (frames, batch) != current:
            current = (frames, batch)
            print(f"step {step}: {batch} clips of {frames} frames per step", flush=True)
        idx = torch.randint(0, len(labels), (batch,), generator=gen)
        clean = moving_digit_clips(digits[idx], gen, frames=frames) * 2.0 - 1.0
        y = labels[idx].clone()
        y[torch.rand(batch, generator=gen) < args.cond_dropout] = NULL_CLASS
        noise = torch.randn(clean.shape, generator=gen)
        # logit-normal times, shifted towards noise: without the shift (the middle of the
        # path, where x_t already shows the digit) 400 steps left the class unused
        t = shift_times(torch.sigmoid(torch.randn(batch, generator=gen)), args.time_shift)
        tb = t.view(-1, 1, 1, 1, 1)
        noisy = (1.0 - tb) * clean + tb * noise
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            pred = velocity(transformer, noisy, t, tokens[y])
        loss = F.mse_loss(pred.float(), noise - clean)
        optimise(opt, params, loss, step, args)
        ema_update([*zip(ema.parameters(), transformer.parameters()), (ema_tokens, tokens.detach())], step, args)
        log.add(step, loss.item())
        done = step + 1
        if done % args.checkpoint_every == 0 and done < args.steps:
            gaps.append({"step": done, "class_gap": round(class_gap(ema.eval(), ema_tokens, probe), 4)})
            save(
                args.out,
                ema,
                ema_tokens,
                classifier,
                {
                    **metadata,
                    "partial": True,
                    "steps_done": done,
                    "loss_log": log.entries,
                    "class_gap_log": gaps,
                    "train_seconds": round(log.elapsed, 1),
                },
            )
            print(f"checkpoint at step {done}, class gap {gaps[-1]['class_gap']:.4f}", flush=True)
        if args.max_minutes and log.elapsed > 60 * args.max_minutes:
            print(f"stopping at step {done}: --max-minutes {args.max_minutes} reached", flush=True)
            break
    gaps.append({"step": done, "class_gap": round(class_gap(ema.eval(), ema_tokens, probe), 4)})
    print(f"class gap at step {done}: {gaps[-1]['class_gap']:.4f}", flush=True)
    return ema.eval(), ema_tokens, log.entries, gaps, log.elapsed, n_params, done


def build_parser() -> argparse.ArgumentParser:
    """The command line; its defaults are the shipped recipe."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=VIDEO_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--stages",
        nargs="+",
        default=["2x32:2400", "8x8:700"],
        metavar="FRAMESxBATCH:STEPS",
        help="clip-length curriculum, run in order: STEPS steps of BATCH clips of FRAMES frames "
        "each; the total is the schedule's step count (see the module docstring)",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--cond-lr-mult",
        type=float,
        default=3.0,
        help="learning-rate multiplier of the class path (class tokens, text embedder, cross-attention)",
    )
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--ema", type=float, default=0.995)
    parser.add_argument("--cond-dropout", type=float, default=0.1)
    parser.add_argument(
        "--stem-frames",
        type=int,
        default=3,
        choices=(1, 3),
        help="frames in each token's input neighbourhood (own frame only, or also its neighbours)",
    )
    parser.add_argument(
        "--bf16", action=argparse.BooleanOptionalAction, default=True, help="bfloat16 autocast for forward and backward"
    )
    parser.add_argument(
        "--guidance-scales",
        type=float,
        nargs="+",
        default=[1.0, 2.0, 4.0, 7.0],
        help="guidance scales of the closing accuracy check; the most accurate is recorded as the "
        "model's recommended scale",
    )
    parser.add_argument(
        "--time-shift",
        type=float,
        default=3.0,
        help="flow shift of the training times and of the sampler's grid (1: none)",
    )
    parser.add_argument("--classifier-epochs", type=int, default=24)
    parser.add_argument("--classifier-frames", type=int, default=4, help="frames per digit per classifier epoch")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--max-minutes", type=float, default=110.0, help="stop training after this long (0: never)")
    parser.add_argument("--eval-samples", type=int, default=20, help="generated clips for the accuracy check")
    parser.add_argument("--eval-steps", type=int, default=10, help="Euler steps for the accuracy check")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="continue from a checkpoint folder this script wrote (its EMA weights, class tokens "
        "and frame classifier, at its steps_done)",
    )
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    try:
        args.stages = [parse_stage(text) for text in args.stages]
    except ValueError as err:
        parser.error(str(err))
    args.steps = sum(stage.steps for stage in args.stages)  # lr_at and LossLog read the total

    # rms_norm warns on every bf16 call that its weight stays float32, which is intended
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    torch.set_num_threads(args.threads)
    started = time.time()
    data = load_digits_32(args.seed)
    digits, labels = shrink_digits(data["x_train"]), data["y_train"]
    print(f"data: {len(labels)} train digits", flush=True)

    if args.resume is not None:  # the checkpoint's classifier: the same seeded training gives it
        classifier = load_video_dit(args.resume).classifier
    else:
        classifier = train_frame_classifier(digits, labels, args)
    test_clips = moving_digit_clips(shrink_digits(data["x_test"]), torch.Generator().manual_seed(args.seed + 2))
    preds, _ = classify_frames(classifier, test_clips)
    clf_acc = (preds == data["y_test"][:, None]).float().mean().item()
    print(
        f"frame classifier accuracy on frames of test-split clips: {clf_acc:.4f} "
        f"({len(data['y_test'])} clips) [{time.time() - started:.0f}s]",
        flush=True,
    )

    metadata = {
        "description": "class-conditional pixel-space rectified-flow Wan transformer on moving digits: "
        "8 frames of 16x16, a 10x10 digit bouncing at 1 px/frame (2048 video tokens, patch (1,1,1), "
        f"3x3 neighbourhood in {args.stem_frames} frame(s) per token)",
        "time_shift": args.time_shift,
        "sampler": f"Euler on the rectified flow, uniform times 1 -> 0 shifted by {args.time_shift} "
        "(s t / (1 + (s - 1) t))",
        "settings": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("out", "stages")
        },
        "clip_schedule": [stage._asdict() for stage in args.stages],
        "clip_schedule_protocol": "stages run in order: 'steps' optimisation steps of 'batch' clips of 'frames' "
        "frames each; learning-rate schedule and EMA over the total",
        "torch": torch.__version__,
        "frame_classifier_accuracy_real_clips": round(clf_acc, 4),
        "frame_classifier_protocol": f"every frame of {len(data['y_test'])} clips of the test-split digits "
        f"(trajectory seed {args.seed + 2}); trained on train-split clips only",
    }
    probe = make_probe(shrink_digits(data["x_test"]), data["y_test"], args.seed + 3)
    transformer, tokens, log, gaps, train_s, n_params, done = train(digits, labels, classifier, metadata, probe, args)
    metadata.update(
        {
            "transformer_parameters": n_params,
            "steps_done": done,
            "stopped_early": done < args.steps,
            "train_seconds": round(train_s, 1),
            "class_gap_log": gaps,
            "class_gap_protocol": "relative velocity-loss increase with wrong labels (label + 3 mod 10), "
            f"16 test-split clips at t = 0.8 (seed {args.seed + 3}), EMA weights",
        }
    )
    save(args.out, transformer, tokens, classifier, {**metadata, "loss_log": log})

    # per-frame accuracy of the saved (float16-rounded) weights: unmerged, balanced classes
    model = load_video_dit(args.out)
    sample_acc, seconds_per_clip = sample_accuracy(
        lambda labels, seeds, scale: sample_video(
            model, labels, seeds, steps=args.eval_steps, guidance_scale=scale, progress=False
        ),
        lambda clips, labels: (classify_frames(model.classifier, clips)[0] == labels[:, None]).float().mean().item(),
        args.eval_samples,
        args.guidance_scales,
        10,
        "per-frame sample accuracy",
        args.eval_steps,
    )

    metadata.update(
        {
            "guidance_scale": float(max(sample_acc, key=lambda scale: (sample_acc[scale], -float(scale)))),
            "total_seconds": round(time.time() - started, 1),
            "sample_accuracy_per_frame": sample_acc,
            "sample_seconds_per_clip": seconds_per_clip,
            "sample_accuracy_protocol": f"{args.eval_samples} clips, classes balanced, seeds 10000.., "
            f"{args.eval_steps} Euler steps, unmerged, float32 inference, {args.threads} thread(s)",
            "loss_log": log,
        }
    )
    write_metadata(args.out, metadata, show=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
