"""LoRA fine-tune of the built-in digits UNet with ToMA and gradient checkpointing on or off.

A peft LoRA on the UNet's attention projections (``unet.add_adapter``) is trained on the
bundled digits with the built-in model's own objective and optimiser step
(``scripts/train_builtin.py``: ``training_batch``, ``epsilon_loss``, ``optimise``), in
several configurations from one starting LoRA and the same batches:

- ``plain``; ``toma`` (``apply_toma(unet, ratio=0.5)``, the default placement);
  ``toma+mlp`` (also ``merge_mlp=True``); ``checkpointing``
  (``unet.enable_gradient_checkpointing()``); ``toma+checkpointing``.

Measured:

- step time (forward, backward, optimiser step): the configurations take turns, one step
  each per round, in one process, so machine load hits them alike; medians over the rounds
  after the warm-up;
- peak memory of a training step: each configuration in its own subprocess, the growth of
  the process's peak resident set (``ru_maxrss``) over the loaded model (see
  :func:`memory_child` for why this measure);
- quality of each trained LoRA, sampled unmerged (ToMA removed) with the same seeds and
  classes as ``toma eval`` and scored with its functions: classifier accuracy, Frechet
  distance on the classifier's features (to the real digits and to the base model's
  samples), PSNR / SSIM against the base model's samples and against the plain LoRA's;
  plus a held-out epsilon loss on the test split (same noise for every configuration).

    python benchmarks/lora_train.py --threads 1          # 20-30 minutes on a loaded 2-core CPU
    python benchmarks/lora_train.py --steps 3 --warmup-rounds 1 --num-images 10 \
        --sample-steps 2 --heldout 16 --out /tmp/lora-smoke    # smoke run

Writes ``lora_train.json`` and ``lora_train.md`` to ``--out`` (default
``benchmarks/results/cpu/``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import toma  # noqa: E402
from toma.tools.builtin.unet import SCHEDULER_CONFIG  # noqa: E402
from scripts.train_builtin import LossLog, epsilon_loss, load_digits_32, optimise, training_batch  # noqa: E402

# name: (ToMA options or None, gradient checkpointing)
CONFIGS: dict[str, tuple[dict[str, Any] | None, bool]] = {
    "plain": (None, False),
    "toma": ({"ratio": 0.5}, False),
    "toma+mlp": ({"ratio": 0.5, "merge_mlp": True}, False),
    "checkpointing": (None, True),
    "toma+checkpointing": ({"ratio": 0.5}, True),
}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


# ---------------------------------------------------------------------------- the training step


def add_lora(unet: Any, rank: int, seed: int, init: bool | str = True) -> None:
    """Add a peft LoRA of ``rank`` on every attention projection, seeded.

    ``init=True`` is peft's default (zero up-projection: the LoRA starts as the identity);
    ``False`` draws both factors at random (tests use it so that every factor gets a
    gradient from the first step). Only the LoRA factors are left trainable.
    """
    from peft import LoraConfig

    if rank < 1:
        raise ValueError(f"rank must be >= 1; got {rank}")
    unet.requires_grad_(False)  # a LoRA fine-tune: the base weights stay as they are
    torch.manual_seed(seed)
    unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=LORA_TARGETS, init_lora_weights=init))


def lora_parameters(unet: Any) -> list[torch.nn.Parameter]:
    """The trainable parameters of ``unet``: its LoRA factors once :func:`add_lora` ran."""
    return [p for p in unet.parameters() if p.requires_grad]


def prepare(unet: Any, config: str) -> Any:
    """Put ``unet`` in training mode with the configuration named ``config`` (see CONFIGS).

    Returns the unet. Raises ``ValueError`` for an unknown name.
    """
    if config not in CONFIGS:
        raise ValueError(f"config must be one of {sorted(CONFIGS)}; got {config!r}")
    options, checkpointing = CONFIGS[config]
    if options is not None:
        toma.apply_toma(unet, **options)
    if checkpointing:
        unet.enable_gradient_checkpointing()
    return unet.train()


def unprepare(unet: Any) -> Any:
    """Undo :func:`prepare` for unmerged inference: ToMA removed, checkpointing off, eval mode."""
    toma.remove_toma(unet)
    unet.disable_gradient_checkpointing()
    return unet.eval()


def train_step(
    unet: Any,
    embeddings: torch.Tensor,
    batch: dict[str, torch.Tensor],
    opt: torch.optim.Optimizer,
    step: int,
    args: argparse.Namespace,
) -> float:
    """One LoRA optimisation step of the built-in objective; returns the loss.

    ``batch`` is a :func:`training_batch` (``noisy`` ``(B, C, H, W)``, ``t`` ``(B,)``,
    ``labels`` ``(B,)``, ``noise``); ``embeddings`` ``(classes + 1, tokens, D)`` are frozen.
    The LoRA gradients, clipped to norm 1, stay in ``.grad`` after the step.
    """
    loss = epsilon_loss(unet, embeddings, batch)
    optimise(opt, lora_parameters(unet), loss, step, args)
    return loss.item()


# ---------------------------------------------------------------------------- memory


def memory_child(args: argparse.Namespace) -> dict[str, Any]:
    """Peak resident-set growth of ``args.memory_child``'s training steps, in this process.

    On a CPU torch keeps no peak-allocation counter, and the profiler's memory view counts
    tensors but not the allocator's cached blocks. ``ru_maxrss`` is the most memory the
    process ever held, as the OS saw it: read after the model, its LoRA and the batch are
    loaded and before the first step, then after the steps, the difference is what the
    steps added at their peak. Each configuration runs in a fresh process so that one
    configuration's freed-but-kept memory cannot hide another's.
    """
    from toma.tools.builtin.unet import load_builtin

    torch.set_num_threads(args.threads)
    model = load_builtin()
    unet = model.unet
    add_lora(unet, args.rank, args.seed)
    prepare(unet, args.memory_child)
    opt = torch.optim.AdamW(lora_parameters(unet), lr=args.lr, weight_decay=0.0)
    batches = training_batches(args, args.memory_steps)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    for step, batch in enumerate(batches):
        train_step(unet, model.class_embeddings, batch, opt, step, args)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"config": args.memory_child, "rss_before_mib": before / 1024, "peak_growth_mib": (after - before) / 1024}


def measure_memory(args: argparse.Namespace, configs: list[str]) -> dict[str, dict[str, Any]]:
    """Run :func:`memory_child` for each configuration, one subprocess after the other."""
    results = {}
    for config in configs:
        cmd = [
            sys.executable,
            __file__,
            "--memory-child",
            config,
            "--threads",
            str(args.threads),
            "--rank",
            str(args.rank),
            "--seed",
            str(args.seed),
            "--batch-size",
            str(args.batch_size),
            "--memory-steps",
            str(args.memory_steps),
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[config] = json.loads(out.strip().splitlines()[-1])
        print(f"memory {config}: +{results[config]['peak_growth_mib']:.0f} MiB peak", flush=True)
    return results


# ---------------------------------------------------------------------------- training and timing


def training_batches(args: argparse.Namespace, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` training batches drawn from one seeded generator (the same for every run)."""
    from diffusers import DDPMScheduler

    data = load_digits_32(args.seed)
    noise_sched = DDPMScheduler.from_config(SCHEDULER_CONFIG)
    gen = torch.Generator().manual_seed(args.seed)
    x, y = data["x_train"] * 2.0 - 1.0, data["y_train"]
    return [training_batch(x, y, noise_sched, gen, args) for _ in range(count)]


def train_interleaved(args: argparse.Namespace, model: Any, configs: list[str]) -> dict[str, dict[str, Any]]:
    """Train one LoRA per configuration from the same start on the same batches, in turns.

    Returns per configuration: the trained unet (unprepared), its step times and loss log.
    """
    base = copy.deepcopy(model.unet)
    add_lora(base, args.rank, args.seed)
    runs = {}
    for config in configs:
        unet = prepare(copy.deepcopy(base), config)
        opt = torch.optim.AdamW(lora_parameters(unet), lr=args.lr, weight_decay=0.0)
        runs[config] = {"unet": unet, "opt": opt, "times": [], "log": LossLog(args)}
    print(f"LoRA: {sum(p.numel() for p in lora_parameters(base))} trainable parameters", flush=True)
    batches = training_batches(args, args.steps)
    logged = 0
    for step, batch in enumerate(batches):
        # rotate who goes first so no configuration always follows the same neighbour
        order = configs[step % len(configs) :] + configs[: step % len(configs)]
        for config in order:
            run = runs[config]
            t0 = time.perf_counter()
            loss = train_step(run["unet"], model.class_embeddings, batch, run["opt"], step, args)
            run["times"].append(time.perf_counter() - t0)
            run["log"].add(step, loss)
        if len(runs[configs[0]]["log"].entries) > logged:  # the loss lines above come in turn order
            logged += 1
            print("  " + ", ".join(f"{c} {runs[c]['log'].entries[-1]['loss']:.4f}" for c in configs), flush=True)
    for run in runs.values():
        unprepare(run["unet"])
    return runs


def timing_summary(runs: dict[str, dict[str, Any]], warmup: int) -> dict[str, dict[str, float]]:
    """Median / min / max step seconds after ``warmup`` rounds, and the speed-up over plain.

    ``speedup`` is the ratio of medians; ``paired_speedup`` the median over rounds of each
    round's ratio (plain's step over this configuration's step in the same round), which
    cancels load that changes between rounds.
    """
    plain = runs["plain"]["times"][warmup:]
    out = {}
    for config, run in runs.items():
        times = run["times"][warmup:]
        out[config] = {
            "median_s": statistics.median(times),
            "min_s": min(times),
            "max_s": max(times),
            "rounds": len(times),
            "speedup": statistics.median(plain) / statistics.median(times),
            "paired_speedup": statistics.median(p / t for p, t in zip(plain, times)),
        }
    return out


# ---------------------------------------------------------------------------- quality


@torch.no_grad()
def heldout_loss(args: argparse.Namespace, model: Any, unet: Any) -> float:
    """Epsilon loss of ``unet`` on ``args.heldout`` noised test-split digits, unmerged.

    The draws come from a fixed generator, so every configuration sees the same images,
    timesteps and noise and the losses compare pairwise.
    """
    from diffusers import DDPMScheduler

    data = load_digits_32(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 7)
    draw = argparse.Namespace(batch_size=args.heldout, cond_dropout=0.0)
    batch = training_batch(
        data["x_test"] * 2.0 - 1.0, data["y_test"], DDPMScheduler.from_config(SCHEDULER_CONFIG), gen, draw
    )
    total = 0.0
    for start in range(0, args.heldout, 64):
        part = {k: v[start : start + 64] for k, v in batch.items()}
        total += epsilon_loss(unet, model.class_embeddings, part).item() * len(part["t"])
    return total / args.heldout


@torch.no_grad()  # the LoRA factors require grad: no graph may be built while sampling
def sample_images(args: argparse.Namespace, model: Any, unet: Any) -> torch.Tensor:
    """``args.num_images`` unmerged samples ``(N, 1, 32, 32)``: ``toma eval``'s seeds and classes."""
    from toma.tools.builtin.unet import NUM_CLASSES, sample

    chunks = []
    for start in range(0, args.num_images, 50):
        idx = range(start, min(start + 50, args.num_images))
        chunks.append(
            sample(
                model,
                [i % NUM_CLASSES for i in idx],
                [args.sample_seed + i for i in idx],
                steps=args.sample_steps,
                progress=False,
                unet=unet,
            )
        )
    return torch.cat(chunks)


def quality_row(model: Any, images: torch.Tensor, base: torch.Tensor, plain: torch.Tensor | None) -> dict[str, float]:
    """Scores of ``images`` with ``toma eval``'s functions (against base and plain-LoRA samples)."""
    from toma.tools.builtin.unet import NUM_CLASSES, classify
    from toma.tools.eval.harness import frechet_to, mean_and_sem
    from toma.tools.eval.metrics import accuracy, feature_stats, psnr, ssim

    labels = torch.arange(len(images)) % NUM_CLASSES
    preds, feats = classify(model.classifier, images)
    _, base_feats = classify(model.classifier, base)
    row = {
        "accuracy": accuracy(preds, labels),
        "fd_real": frechet_to(feats, model.reference_mu, model.reference_sigma),
        "fd_vs_base": frechet_to(feats, *feature_stats(base_feats)) if len(base) > 1 else float("nan"),
        **mean_and_sem("psnr_vs_base", psnr(images, base)),
        **mean_and_sem("ssim_vs_base", ssim(images, base)),
    }
    if plain is not None:
        row.update(mean_and_sem("psnr_vs_plain", psnr(images, plain)))
    return row


def same_lora(a: Any, b: Any) -> bool:
    """Whether two unets' LoRA factors are bitwise equal."""
    return all(torch.equal(p, q) for p, q in zip(lora_parameters(a), lora_parameters(b)))


def lora_distance(a: Any, b: Any) -> float:
    """Relative distance ``|A - B| / |B|`` of two unets' LoRA factors, all flattened together."""
    pa = torch.cat([p.detach().flatten() for p in lora_parameters(a)])
    pb = torch.cat([p.detach().flatten() for p in lora_parameters(b)])
    return float((pa - pb).norm() / pb.norm())


# ---------------------------------------------------------------------------- report


def load_average() -> str:
    """The 1/5/15-minute load averages, as ``uptime`` shows them."""
    with open("/proc/loadavg", encoding="utf-8") as fh:
        return " ".join(fh.read().split()[:3])


def fmt(value: float, digits: int = 2) -> str:
    """A table cell: ``-`` for NaN, ``inf`` for infinity."""
    if math.isnan(value):
        return "-"
    return "inf" if value == float("inf") else f"{value:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    """The results as markdown tables."""
    s = result["settings"]
    lines = [
        "# LoRA fine-tune of the built-in digits UNet, with ToMA and gradient checkpointing",
        "",
        f"`{result['command']}`; {result['date']}, commit {result['commit']}; torch {result['torch']}, "
        f"diffusers {result['diffusers']}, peft {result['peft']}; {s['threads']} thread(s); load average "
        f"{result['load_before']} before, {result['load_after']} after (other jobs on the machine).",
        "",
        f"LoRA rank {s['rank']} on {', '.join(LORA_TARGETS)} ({result['lora_parameters']} parameters); "
        f"{s['steps']} steps of batch {s['batch_size']}, lr {s['lr']}, same batches for every configuration.",
        "",
        f"Step time: median over {s['steps'] - s['warmup_rounds']} interleaved rounds (first "
        f"{s['warmup_rounds']} dropped). Memory: peak RSS growth of {s['memory_steps']} steps in a fresh "
        "process per configuration. Held-out loss: epsilon MSE on "
        f"{s['heldout']} noised test digits, unmerged (base model: {fmt(result['heldout_base'], 4)}).",
        "",
        "| configuration | step median s | min-max s | speed-up (paired) | peak memory growth MiB | final train "
        "loss | held-out loss | LoRA distance to plain |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for config, row in result["configs"].items():
        t, mem = row["timing"], row.get("memory", {})
        lines.append(
            f"| {config} | {t['median_s']:.3f} | {t['min_s']:.3f}-{t['max_s']:.3f} | "
            f"{t['speedup']:.3f}x ({t['paired_speedup']:.3f}x) | {fmt(mem.get('peak_growth_mib', float('nan')), 0)} | "
            f"{row['final_loss']:.4f} | {row['heldout_loss']:.4f} | {row['lora_distance_to_plain']:.2e} |"
        )
    lines += [
        "",
        f"Samples: {s['num_images']} images, {s['sample_steps']} DDIM steps, guidance "
        f"{result['guidance_scale']}, seeds {s['sample_seed']}.., classes i % 10, unmerged; "
        "`toma eval`'s functions. PSNR ± standard error over images.",
        "",
        "| samples | accuracy | FD to real | FD to base | PSNR vs base dB | SSIM vs base | PSNR vs plain LoRA dB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, q in result["quality"].items():
        lines.append(
            f"| {name} | {q['accuracy']:.3f} | {fmt(q['fd_real'])} | {fmt(q['fd_vs_base'])} | "
            f"{fmt(q['psnr_vs_base'])} ± {fmt(q['psnr_vs_base_sem'])} | {fmt(q['ssim_vs_base'], 4)} | "
            f"{fmt(q.get('psnr_vs_plain', float('nan')))} ± {fmt(q.get('psnr_vs_plain_sem', float('nan')))} |"
        )
    return "\n".join(lines) + "\n"


def git_commit() -> str:
    """The checkout's short commit, or ``unknown``."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; checked, with errors naming the option."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="LoRA initialisation and training batches")
    p.add_argument("--steps", type=int, default=50, help="training steps per configuration")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10, help="learning-rate warm-up steps")
    p.add_argument("--rank", type=int, default=4, help="LoRA rank")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {list(CONFIGS)}")
    p.add_argument(
        "--sample-configs",
        default=None,
        help="configurations whose LoRA is sampled and scored ('all' for every one; default: those "
        "of plain, toma, checkpointing, toma+checkpointing that are trained); a LoRA bitwise equal "
        "to one sampled already reuses its samples",
    )
    p.add_argument("--warmup-rounds", type=int, default=3, help="timing rounds left out of the medians")
    p.add_argument("--memory-steps", type=int, default=2)
    p.add_argument("--num-images", type=int, default=100)
    p.add_argument("--sample-steps", type=int, default=20)
    p.add_argument("--sample-seed", type=int, default=0, help="image i uses seed SAMPLE_SEED+i, as toma eval")
    p.add_argument("--heldout", type=int, default=256, help="noised test digits for the held-out loss")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu")
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.cond_dropout = 0.1  # as the built-in model was trained, so guidance keeps working
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or "plain" not in configs:
        p.error(f"--configs must include 'plain' and name only {list(CONFIGS)}; got {args.configs!r}")
    args.configs = configs
    if args.sample_configs is None:
        sampled = [c for c in ("plain", "toma", "checkpointing", "toma+checkpointing") if c in configs]
    elif args.sample_configs == "all":
        sampled = configs
    else:
        sampled = [c for c in args.sample_configs.split(",") if c]
    if any(c not in configs for c in sampled) or "plain" not in sampled:
        p.error(
            "--sample-configs must include 'plain' and name only configurations in --configs; got "
            f"{args.sample_configs!r}"
        )
    args.sample_configs = sampled
    for name in (
        "threads",
        "steps",
        "batch_size",
        "memory_steps",
        "num_images",
        "sample_steps",
        "heldout",
        "log_every",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if not 0 <= args.warmup_rounds < args.steps:
        p.error(f"--warmup-rounds must be in [0, --steps); got {args.warmup_rounds}")
    if args.num_images < 2:
        p.error(f"--num-images must be >= 2 (a Frechet distance needs two samples); got {args.num_images}")
    if args.lr <= 0:
        p.error(f"--lr must be > 0; got {args.lr}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_child is not None:
        print(json.dumps(memory_child(args)))
        return 0

    import diffusers
    import peft

    from toma.tools.builtin.unet import load_builtin

    torch.set_num_threads(args.threads)
    started = time.time()
    commit = git_commit()  # the code that runs, even if the checkout moves on meanwhile
    load_before = load_average()
    print(f"load average {load_before}; configurations {args.configs}", flush=True)
    memory = measure_memory(args, args.configs)

    model = load_builtin()
    runs = train_interleaved(args, model, args.configs)
    timing = timing_summary(runs, args.warmup_rounds)
    print(f"trained in {time.time() - started:.0f}s", flush=True)

    heldout_base = heldout_loss(args, model, model.unet)
    configs: dict[str, Any] = {}
    for config, run in runs.items():
        configs[config] = {
            "timing": timing[config],
            "memory": memory[config],
            "final_loss": run["log"].entries[-1]["loss"],
            "loss_log": run["log"].entries,
            "heldout_loss": heldout_loss(args, model, run["unet"]),
            "lora_distance_to_plain": lora_distance(run["unet"], runs["plain"]["unet"]),
        }
        print(
            f"{config}: step {timing[config]['median_s']:.3f}s ({timing[config]['speedup']:.3f}x), "
            f"held-out loss {configs[config]['heldout_loss']:.4f}",
            flush=True,
        )

    base_images = sample_images(args, model, model.unet)
    samples: dict[str, torch.Tensor] = {}
    for config in args.sample_configs:
        twin = next((c for c in samples if same_lora(runs[c]["unet"], runs[config]["unet"])), None)
        # a bitwise-equal LoRA samples bitwise-equal images: reuse them and say so
        samples[config] = samples[twin] if twin else sample_images(args, model, runs[config]["unet"])
        configs[config]["samples_from"] = twin or config
    quality = {"base (no LoRA)": quality_row(model, base_images, base_images, samples["plain"])}
    for config, images in samples.items():
        name = f"LoRA: {config}" + (
            f" (= {configs[config]['samples_from']}, bitwise)" if configs[config]["samples_from"] != config else ""
        )
        quality[name] = quality_row(model, images, base_images, None if config == "plain" else samples["plain"])
        print(f"{name}: {quality[name]}", flush=True)

    result = {
        "command": "python benchmarks/lora_train.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "peft": peft.__version__,
        "cpu": platform.processor() or platform.machine(),
        "load_before": load_before,
        "load_after": load_average(),
        "total_s": round(time.time() - started, 1),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "memory_child"},
        "lora_parameters": sum(p.numel() for p in lora_parameters(runs["plain"]["unet"])),
        "guidance_scale": model.guidance_scale,
        "heldout_base": heldout_base,
        "configs": configs,
        "quality": quality,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "lora_train.json", "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    (args.out / "lora_train.md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))
    print(f"wrote {args.out / 'lora_train.json'} and .md in {result['total_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
