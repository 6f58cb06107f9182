"""Pipeline parts several test modules build: a tokenizer, text encoder configs and a VAE
from config (no download), and the round trip a whole pipeline is checked with."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL
from transformers import CLIPTextConfig, CLIPTokenizer

import toma


def tiny_clip_tokenizer(folder) -> CLIPTokenizer:
    """A CLIP tokenizer with a one-letter-per-token vocabulary (no download needed)."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz":
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=16)


def clip_config(**overrides) -> CLIPTextConfig:
    settings = dict(
        vocab_size=60,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return CLIPTextConfig(**{**settings, **overrides})


def tiny_vae() -> AutoencoderKL:
    torch.manual_seed(0)
    return AutoencoderKL(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
        shift_factor=0.0,
    )


def merged_round_trip(pipe, generate, expected_calls, **options) -> None:
    """Generate unmerged, with ToMA (checking the (batch, tokens) the first merged module
    sees at each call), and after removal (bitwise the unmerged output)."""
    ref = generate()
    patch = toma.apply_toma(pipe, ratio=0.5, **options)
    calls = []
    handle = patch.patched[0].module.to_q.register_forward_hook(lambda m, a, o: calls.append(tuple(a[0].shape[:2])))
    merged = generate()
    handle.remove()
    assert calls == expected_calls
    assert merged.shape == ref.shape and np.isfinite(merged).all() and not np.array_equal(merged, ref)
    toma.remove_toma(pipe)
    assert np.array_equal(generate(), ref)


def tiny_sd_pipeline(folder, pipeline: type | None = None, scheduler=None):
    """A tiny random-weight SD 1.x-style pipeline (``pipeline``: ``StableDiffusionPipeline``,
    or a sibling class taking the same components), its tokenizer's files in ``folder``."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline
    from transformers import CLIPTextModel

    from tests.tiny_models import CROSS_DIM, make_sd15_unet

    return (pipeline or StableDiffusionPipeline)(
        vae=tiny_vae(),
        text_encoder=CLIPTextModel(clip_config(hidden_size=CROSS_DIM)),
        tokenizer=tiny_clip_tokenizer(folder),
        unet=make_sd15_unet(),
        scheduler=scheduler or DDIMScheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def read_results(out: Path) -> dict:
    """The results of a ``toma eval`` run in ``out``, after checking it wrote every file."""
    for name in ("results.json", "results.md", "quality_vs_speedup.png", "samples.png"):
        assert (out / name).is_file(), name
    return json.loads((out / "results.json").read_text())


def eval_on_two_processes(args: list[str], out: Path, timeout: float) -> subprocess.CompletedProcess:
    """``toma ARGS --out-dir OUT`` data-parallel on two CPU processes, one thread each.

    accelerate's ``--cpu`` launcher starts a single process (multi-CPU needs mpirun); its
    torchrun launcher (``--multi_gpu``) starts 2 processes, and toma joins them with gloo.
    """
    # fmt: off
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "toma", *args, "--out-dir", str(out)]
    # fmt: on
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=Path(__file__).parents[1])
