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
from transformers import CLIPTextConfig, CLIPTokenizer, Qwen3VLProcessor

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


def tiny_hunyuan_video_vae():
    """A 4-channel HunyuanVideo VAE (4x space, 4x time), as HunyuanVideo and Kandinsky 5 take."""
    from diffusers import AutoencoderKLHunyuanVideo

    return AutoencoderKLHunyuanVideo(
        latent_channels=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3,
        block_out_channels=(8, 8, 8),
        layers_per_block=1,
        norm_num_groups=4,
        spatial_compression_ratio=4,
        temporal_compression_ratio=4,
    )


def tiny_qwen25_vl(vocab_size: int, hidden: int, positions: int = 256):
    """A Qwen2.5-VL model of one text layer (``hidden`` wide, M-RoPE) and a one-layer vision
    tower, which the text-only pipelines that take it (Qwen-Image, Kandinsky 5) never run."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]},
        max_position_embeddings=positions,
        bos_token_id=None,
        eos_token_id=None,
    )
    vision = dict(
        depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden, fullatt_block_indexes=[0]
    )
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision)).eval()


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


def tiny_flux2_vae():
    """FLUX.2's VAE (also FLUX.3's and ERNIE-Image's) from config: two levels of 8 and 16
    channels, 4 latent channels."""
    from diffusers import AutoencoderKLFlux2

    return AutoencoderKLFlux2(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=8,
        layers_per_block=1,
    )


def tiny_qwen3_vl(folder):
    """A Qwen3-VL encoder and its processor from config: a byte-level tokenizer with the
    vision tokens, one text layer ``TEXT_DIM`` wide and one vision layer whose 16-pixel
    patches merge 2x2 (one encoder slot per 32x32 pixels, which Qwen-Image 2.1's latents
    cover with 2x2 tokens). The processor is text and image only
    (:class:`Qwen3VLProcessorNoVideo`). Returns ``(processor, text_encoder)``."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from tests.adapters.test_dit_mmdit import tiny_qwen2_tokenizer
    from tests.tiny_models import TEXT_DIM

    tokenizer = tiny_qwen2_tokenizer(folder)
    vision_tokens = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": vision_tokens})
    # turns whose content is a string (FLUX.3's) or a list of text parts (Qwen-Image 2.1's
    # count of its system turn's tokens)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    # a condition image is resized to output_resolution^2 pixels for both the VAE and the
    # encoder: 64 px (the tests' output_resolution) is 4 slots
    pixels = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128}
    )
    processor = Qwen3VLProcessorNoVideo(tokenizer, pixels)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_DIM,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e4,
            "mrope_section": [2, 2, 4],
            "mrope_interleaved": True,
        },
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=16,
        num_heads=2,
        out_hidden_size=TEXT_DIM,
        deepstack_visual_indexes=[],
        num_position_embeddings=16,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
    )
    torch.manual_seed(0)
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=processor.image_token_id,
        video_token_id=processor.video_token_id,
    )
    return processor, Qwen3VLForConditionalGeneration(config).eval()


def tiny_qwenimage21_pipeline(folder, transformer):
    """Qwen-Image 2.1's pipeline from config: :func:`tiny_qwen3_vl` and a one-level VAE of
    16 latent channels."""
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

    processor, text_encoder = tiny_qwen3_vl(folder)
    vae = AutoencoderKLQwenImage21(
        base_dim=4,
        decoder_base_dim=4,
        z_dim=16,
        dim_mult=[1] * 5,
        num_res_blocks=1,
        temperal_downsample=[False, True, True, True],
        latents_mean=[0.0] * 16,
        latents_std=[1.0] * 16,
    )
    return QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        processor=processor,
        transformer=transformer,
    )


class Qwen3VLProcessorNoVideo(Qwen3VLProcessor):
    """Qwen3-VL's processor without its video processor, which needs torchvision (no CPU
    build in the registry); Qwen-Image 2.1's pipeline never passes videos."""

    def __init__(self, tokenizer, image_processor) -> None:  # the parent checks every part's class
        self.tokenizer, self.image_processor, self.video_processor = tokenizer, image_processor, None
        self.chat_template = tokenizer.chat_template
        for kind in ("image", "video"):
            setattr(self, f"{kind}_token", f"<|{kind}_pad|>")
            setattr(self, f"{kind}_token_id", tokenizer.convert_tokens_to_ids(f"<|{kind}_pad|>"))
        for end in ("start", "end"):
            setattr(self, f"vision_{end}_token", f"<|vision_{end}|>")
            setattr(self, f"vision_{end}_token_id", tokenizer.convert_tokens_to_ids(f"<|vision_{end}|>"))


def tiny_flux3_modular_pipeline(folder, transformer):
    """FLUX.3's modular pipeline (``Flux3AutoBlocks`` without its prompt upsampler, a Qwen3.5
    fine-tune that rewrites the prompt) around ``transformer``, with a tiny Qwen3-VL encoder
    (its tokenizer files in ``folder``), FLUX.2's tiny VAE and true CFG at scale 2."""
    import warnings

    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.guiders import ClassifierFreeGuidance
    from diffusers.modular_pipelines import Flux3AutoBlocks
    from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor

    processor, text_encoder = tiny_qwen3_vl(folder)
    blocks = Flux3AutoBlocks()
    blocks.sub_blocks.pop("prompt_upsampler")
    pipe = blocks.init_pipeline()
    torch.manual_seed(0)
    vae = tiny_flux2_vae()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # guiders are experimental; components not from specs
        pipe.update_components(
            text_encoder=text_encoder,
            tokenizer=processor,
            vae=vae,
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(),
            guider=ClassifierFreeGuidance(guidance_scale=2.0),
            image_processor=Flux3ImageProcessor(vae_scale_factor=4),
        )
    return pipe
