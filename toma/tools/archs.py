"""Denoiser architectures for benchmarking, built from config with random weights.

Speed does not depend on the weights, so a full-size SDXL, SD 1.5 or Flux.1-dev denoiser
built from its published config times like the real one, and nothing is downloaded. The
``tiny-*`` architectures exist for tests. :func:`make_inputs` builds one denoiser call's
keyword arguments at a given image resolution.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
# torch loads inside the functions that build models and inputs: ``toma bench --help``
# reads ARCHS without paying for it

# Published configs of the denoisers (only the fields that differ from diffusers' defaults
# or that define the architecture).
SDXL_UNET: dict[str, Any] = {
    "sample_size": 128,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    "block_out_channels": (320, 640, 1280),
    "layers_per_block": 2,
    "transformer_layers_per_block": (1, 2, 10),
    "attention_head_dim": (5, 10, 20),
    "cross_attention_dim": 2048,
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,
    "norm_num_groups": 32,
}

SD15_UNET: dict[str, Any] = {
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    "block_out_channels": (320, 640, 1280, 1280),
    "layers_per_block": 2,
    "attention_head_dim": 8,
    "cross_attention_dim": 768,
    "norm_num_groups": 32,
}

FLUX_DEV: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}

SD35_MEDIUM: dict[str, Any] = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 384,
    "qk_norm": "rms_norm",
    "dual_attention_layers": tuple(range(13)),
}

WAN21_1_3B: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 30,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}

PIXART_SIGMA: dict[str, Any] = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 4,
    "out_channels": 8,
    "num_layers": 28,
    "attention_head_dim": 72,
    "num_attention_heads": 16,
    "cross_attention_dim": 1152,
    "caption_channels": 4096,
    "attention_bias": True,
    "activation_fn": "gelu-approximate",
    "num_embeds_ada_norm": 1000,
    "norm_type": "ada_norm_single",
    "norm_elementwise_affine": False,
    "norm_eps": 1e-6,
    "interpolation_scale": 2,
    "use_additional_conditions": False,
}

LTX_VIDEO: dict[str, Any] = {
    "in_channels": 128,
    "out_channels": 128,
    "patch_size": 1,
    "patch_size_t": 1,
    "num_attention_heads": 32,
    "attention_head_dim": 64,
    "cross_attention_dim": 2048,
    "num_layers": 28,
    "caption_channels": 4096,
    "qk_norm": "rms_norm_across_heads",
}

# LTX-2 (19B, Lightricks/LTX-2): diffusers 0.42.1's LTX2VideoTransformer3DModel defaults are
# the published model (18.9B parameters built from them; its pipelines' docs load
# Lightricks/LTX-2 into it): video 32 heads of 128, audio 32 heads of 64, 48 blocks, prompt
# embeddings of Gemma 3 12B's width (3840). The audio fields set the audio token count
# (make_inputs: 25 latents a second at 16 kHz, hop 160, 4x)
LTX2_VIDEO: dict[str, Any] = {
    "in_channels": 128,
    "out_channels": 128,
    "patch_size": 1,
    "patch_size_t": 1,
    "num_attention_heads": 32,
    "attention_head_dim": 128,
    "cross_attention_dim": 4096,
    "audio_in_channels": 128,
    "audio_out_channels": 128,
    "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64,
    "audio_cross_attention_dim": 2048,
    "audio_scale_factor": 4,
    "audio_sampling_rate": 16000,
    "audio_hop_length": 160,
    "num_layers": 48,
    "caption_channels": 3840,
    "rope_type": "interleaved",
}

# HunyuanVideo (13B): diffusers' class defaults are the published model (its conversion
# script, scripts/convert_hunyuan_video_to_diffusers.py, builds HunyuanVideoTransformer3DModel())
HUNYUAN_VIDEO: dict[str, Any] = {
    "in_channels": 16,
    "out_channels": 16,
    "num_attention_heads": 24,
    "attention_head_dim": 128,
    "num_layers": 20,
    "num_single_layers": 40,
    "num_refiner_layers": 2,
    "mlp_ratio": 4.0,
    "patch_size": 2,
    "patch_size_t": 1,
    "qk_norm": "rms_norm",
    "guidance_embeds": True,
    "text_embed_dim": 4096,
    "pooled_projection_dim": 768,
    "rope_theta": 256.0,
    "rope_axes_dim": (16, 56, 56),
}

# CogVideoX-5B: the class defaults with 42 layers, 48 heads and rotary positions
# (diffusers' scripts/convert_cogvideox_to_diffusers.py: "For 5B, it is 42 / 48 / True")
COGVIDEOX_5B: dict[str, Any] = {
    "num_attention_heads": 48,
    "attention_head_dim": 64,
    "in_channels": 16,
    "out_channels": 16,
    "time_embed_dim": 512,
    "text_embed_dim": 4096,
    "num_layers": 42,
    "sample_width": 90,
    "sample_height": 60,
    "sample_frames": 49,
    "patch_size": 2,
    "temporal_compression_ratio": 4,
    "max_text_seq_length": 226,
    "use_rotary_positional_embeddings": True,
}

# Qwen-Image (20B): Qwen/Qwen-Image transformer/config.json, which matches diffusers'
# QwenImageTransformer2DModel defaults (60 blocks of width 24 x 128; text width 3584, the
# Qwen2.5-VL-7B encoder's hidden size)
QWEN_IMAGE: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 60,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "guidance_embeds": False,
    "axes_dims_rope": (16, 56, 56),
}

# FLUX.2-dev (32B): black-forest-labs/FLUX.2-dev transformer/config.json, which matches
# diffusers' Flux2Transformer2DModel defaults (8 double and 48 single blocks of width
# 48 x 128; text width 15360, three stacked Mistral-Small-3.1 hidden states of 5120)
FLUX2_DEV: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 128,
    "num_layers": 8,
    "num_single_layers": 48,
    "attention_head_dim": 128,
    "num_attention_heads": 48,
    "joint_attention_dim": 15360,
    "timestep_guidance_channels": 256,
    "mlp_ratio": 3.0,
    "axes_dims_rope": (32, 32, 32, 32),
    "rope_theta": 2000,
    "guidance_embeds": True,
}

# Small stand-ins with the same structure, for tests.
TINY_UNET: dict[str, Any] = {
    "sample_size": 16,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
    "block_out_channels": (32, 64),
    "layers_per_block": 1,
    "attention_head_dim": 8,
    "cross_attention_dim": 32,
    "norm_num_groups": 8,
}

TINY_FLUX: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 16,
    "guidance_embeds": True,
    "axes_dims_rope": (4, 6, 6),
}


TINY_SD3: dict[str, Any] = {
    "sample_size": 16,
    "patch_size": 2,
    "in_channels": 4,
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "caption_projection_dim": 16,
    "pooled_projection_dim": 16,
    "pos_embed_max_size": 32,
    "dual_attention_layers": (0,),
}

TINY_WAN: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 32,
    "freq_dim": 16,
    "ffn_dim": 32,
    "num_layers": 2,
    "rope_max_seq_len": 32,
}

TINY_HUNYUAN_VIDEO: dict[str, Any] = {
    "in_channels": 4,
    "out_channels": 4,
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "num_layers": 2,
    "num_single_layers": 2,
    "num_refiner_layers": 1,
    "text_embed_dim": 32,
    "pooled_projection_dim": 16,
    "rope_axes_dim": (2, 2, 4),
}

TINY_COGVIDEOX: dict[str, Any] = {
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "in_channels": 4,
    "out_channels": 4,
    "time_embed_dim": 8,
    "text_embed_dim": 32,
    "num_layers": 2,
    "sample_width": 8,
    "sample_height": 8,
    "sample_frames": 5,
    "patch_size": 2,
    "max_text_seq_length": 8,
    "use_rotary_positional_embeddings": True,
}

TINY_QWEN_IMAGE: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "axes_dims_rope": (4, 6, 6),
}

TINY_FLUX2: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "timestep_guidance_channels": 16,
    "axes_dims_rope": (4, 4, 4, 4),
}

# Krea 2 (Raw / Turbo): diffusers' class defaults, which are the released 12.9B model's
# (12.82B parameters built)
KREA2: dict[str, Any] = {
    "in_channels": 64,
    "num_layers": 28,
    "attention_head_dim": 128,
    "num_attention_heads": 48,
    "num_key_value_heads": 12,
    "intermediate_size": 16384,
    "text_hidden_dim": 2560,
    "num_text_layers": 12,
    "text_num_attention_heads": 20,
    "text_num_key_value_heads": 20,
    "text_intermediate_size": 6912,
    "axes_dims_rope": (32, 48, 48),
    "rope_theta": 1000.0,
}

# Bria FIBO: 8 double-stream and 38 single-stream blocks at Flux's width (8.29B parameters
# built; diffusers' docs give 8B, its class defaults of 19 double blocks 12.1B), text from
# two SmolLM3-3B layers (2 x 2048) and one more per block
BRIA_FIBO: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 8,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "axes_dims_rope": (16, 56, 56),
    "text_encoder_dim": 2048,
}

# Z-Image-Turbo: the published transformer/config.json (Tongyi-MAI/Z-Image-Turbo); 6B.
# The 2 noise- and 2 context-refiner blocks are not divided by --depth (never merged)
ZIMAGE: dict[str, Any] = {
    "all_patch_size": (2,),
    "all_f_patch_size": (1,),
    "in_channels": 16,
    "dim": 3840,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "n_heads": 30,
    "n_kv_heads": 30,
    "norm_eps": 1e-05,
    "qk_norm": True,
    "cap_feat_dim": 2560,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
    "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
}

# Lumina-Image 2.0 (2.6B), Alpha-VLLM/Lumina-Image-2.0's published transformer config: Gemma-2-2B
# captions (2304 wide), 16-channel latents (Flux's VAE), 24 query heads sharing 8 key heads
LUMINA2: dict[str, Any] = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "hidden_size": 2304,
    "num_layers": 26,
    "num_refiner_layers": 2,
    "num_attention_heads": 24,
    "num_kv_heads": 8,
    "multiple_of": 256,
    "norm_eps": 1e-05,
    "axes_dim_rope": (32, 32, 32),
    "axes_lens": (300, 512, 512),
    "cap_feat_dim": 2304,
}

# HiDream-I1-Full (17B): the class defaults, with the published config's 16-channel latents
# (Flux's VAE) and text widths: T5-XXL and Llama-3.1-8B (4096 each; a Llama layer's hidden
# states per block, its 32 layers, then the last one again) and pooled CLIP-L + CLIP-G (2048)
HIDREAM: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 16,
    "num_single_layers": 32,
    "attention_head_dim": 128,
    "num_attention_heads": 20,
    "caption_channels": [4096, 4096],
    "text_emb_dim": 2048,
    "num_routed_experts": 4,
    "num_activated_experts": 2,
    "axes_dims_rope": (64, 32, 32),
    "max_resolution": (128, 128),
    "llama_layers": list(range(32)) + [31] * 16,
}

# Chroma1-HD (8.9B): the class defaults, Flux.1's blocks at Flux's width with the pooled
# modulation replaced by one approximator
CHROMA: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "axes_dims_rope": (16, 56, 56),
    "approximator_num_channels": 64,
    "approximator_hidden_dim": 5120,
    "approximator_layers": 5,
}

# Wan 2.1 VACE 14B: the class defaults (Wan 14B's blocks, control blocks joining every 5th)
WAN_VACE_14B: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
    "vace_layers": [0, 5, 10, 15, 20, 25, 30, 35],
    "vace_in_channels": 96,
}

# HunyuanVideo 1.5 (8.3B, 480p): the class defaults; 32-channel latents of a 16x VAE (4x in
# time) with the image-to-video condition and mask channels (65 in)
HUNYUAN_VIDEO15: dict[str, Any] = {
    "in_channels": 65,
    "out_channels": 32,
    "num_attention_heads": 16,
    "attention_head_dim": 128,
    "num_layers": 54,
    "num_refiner_layers": 2,
    "mlp_ratio": 4.0,
    "patch_size": 1,
    "patch_size_t": 1,
    "text_embed_dim": 3584,
    "text_embed_2_dim": 1472,
    "image_embed_dim": 1152,
    "rope_theta": 256.0,
    "rope_axes_dim": (16, 56, 56),
}

# Cosmos-Predict2 2B Text2Image (diffusers' scripts/convert_cosmos_to_diffusers.py), without
# the padding-mask input channel: diffusers resizes that mask with torchvision, which this
# project does not install (one input channel of 16; the blocks are the same)
COSMOS_PREDICT2_2B: dict[str, Any] = {
    "in_channels": 16,
    "out_channels": 16,
    "num_attention_heads": 16,
    "attention_head_dim": 128,
    "num_layers": 28,
    "mlp_ratio": 4.0,
    "text_embed_dim": 1024,
    "adaln_lora_dim": 256,
    "max_size": (128, 240, 240),
    "patch_size": (1, 2, 2),
    "rope_scale": (1.0, 4.0, 4.0),
    "concat_padding_mask": False,
    "extra_pos_embed_type": None,
}

# MiniMax H3 (33B, t2va/fl2va partition): diffusers' class defaults, which its docstring gives
# as the released checkpoint's (transformer_minimax_h3.py; 33.1B parameters counted). The 2
# text-refiner blocks are not divided by --depth (never merged)
MINIMAX_H3: dict[str, Any] = {
    "num_attention_heads": 56,
    "attention_head_dim": 128,
    "hidden_size": 5376,
    "num_layers": 50,
    "num_refiner_layers": 2,
    "ffn_dim": 14336,
    "in_channels": 24,
    "audio_in_channels": 32,
    "patch_size": (1, 2, 2),
    "text_dim": 5120,
    "freq_dim": 256,
    "time_embed_hidden_dim": 5376,
    "time_embed_dim": 2688,
    "rope_freq_dim": 16,
    "rope_theta": 10000.0,
}

# Ideogram 4: diffusers' class defaults, as its docs give them (the published config.json is
# not to be had here); 9.28B parameters counted
IDEOGRAM4: dict[str, Any] = {
    "in_channels": 128,
    "num_layers": 34,
    "attention_head_dim": 256,
    "num_attention_heads": 18,
    "intermediate_size": 12288,
    "adaln_dim": 512,
    "llm_features_dim": 53248,
    "rope_theta": 5_000_000,
    "mrope_section": (24, 20, 20),
}

# Kandinsky 5.0 T2V Lite (2B), its 5 s SFT checkpoint: kandinskylab's configs/config_5s_sft.yaml
# (dit_params; diffusers' class defaults otherwise). The 10 s checkpoints add NABLA attention,
# which ToMA runs unmerged
KANDINSKY5_LITE: dict[str, Any] = {
    "in_visual_dim": 16,
    "out_visual_dim": 16,
    "time_dim": 512,
    "patch_size": (1, 2, 2),
    "model_dim": 1792,
    "ff_dim": 7168,
    "num_text_blocks": 2,
    "num_visual_blocks": 32,
    "axes_dims": (16, 24, 24),
    "visual_cond": True,
    "in_text_dim": 3584,
    "in_text_dim2": 768,
}

# ERNIE-Image (8B; Turbo has the same transformer): baidu's transformer/config.json (diffusers'
# class defaults describe a smaller model: hidden 3072, 24 layers)
ERNIE_IMAGE: dict[str, Any] = {
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_layers": 36,
    "ffn_hidden_size": 12288,
    "in_channels": 128,
    "out_channels": 128,
    "patch_size": 1,
    "text_in_dim": 3072,
    "rope_theta": 256,
    "rope_axes_dim": (32, 48, 48),
    "eps": 1e-06,
    "qk_layernorm": True,
}

# Qwen-Image 2.1: diffusers' QwenImage21Transformer2DModel defaults (32 single-stream blocks
# of 32 x 128, text width 4096, 2x2-packed latents of 64 channels), which its pipeline's
# docs describe and which third-party loaders check as the published transformer config;
# the config.json itself was not read (no hub access here)
QWEN_IMAGE_21: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": 64,
    "num_layers": 32,
    "attention_head_dim": 128,
    "num_attention_heads": 32,
    "context_in_dim": 4096,
    "mlp_ratio": 3,
    "axes_dims_rope": (16, 56, 56),
    "causal_condition": True,
}

# FLUX.3: diffusers' Flux3Transformer2DModel defaults (5 blocks per mode and 28 single-stream
# blocks of 24 x 128; text width 20480, stacked Qwen3-VL hidden states; 2x2-packed latents of
# 128 channels). diffusers names two repos, flux-3-image-klein-base and flux-3-image-klein
# (step-distilled: flow_map=True, which adds only a timestep embedder); no published
# config.json was found (no hub access here, none quoted in the public code searched), so
# whether klein has these widths and depths is not known
FLUX3: dict[str, Any] = {
    "in_channels": 128,
    "cond_in_channels": 128,
    "num_layers": 5,
    "num_single_layers": 28,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 20480,
    "timestep_channels": 256,
    "mlp_ratio": 3.0,
    "axes_dims_rope": (32, 32, 32, 32),
}

# Helios: diffusers' class defaults (Wan 2.1 14B's blocks, 40 x 128, and the three history
# embedders). Three third-party ports of Helios-Distilled (FastVideo's and sglang's DiT
# configs, mlx-video's) hard-code the same values; the published config.json itself was not
# read (no hub access here)
HELIOS: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "rope_dim": (44, 42, 42),
}

# its pipeline's chunk: 9 latent frames after histories of 16 (long), 2 (mid) and 1 + 1 (short)
HELIOS_HISTORY = {"long": 16, "mid": 2, "short": 2}

# the config keys that count blocks, per family (what --depth divides)
DEPTH_KEYS: dict[str, tuple[str, ...]] = {
    "flux": ("num_layers", "num_single_layers"),
    "flux2": ("num_layers", "num_single_layers"),
    "qwenimage": ("num_layers",),
    "sd3": ("num_layers",),
    "wan": ("num_layers",),
    "pixart": ("num_layers",),
    "ltx": ("num_layers",),
    "ltx2": ("num_layers",),
    "hunyuanvideo": ("num_layers", "num_single_layers"),
    "cogvideox": ("num_layers",),
    "krea2": ("num_layers",),
    "bria-fibo": ("num_layers", "num_single_layers"),
    "zimage": ("n_layers",),
    "hidream": ("num_layers", "num_single_layers"),
    "chroma": ("num_layers", "num_single_layers"),
    "wan-vace": ("num_layers", "vace_layers"),  # the control blocks: one per entry of vace_layers
    "hunyuanvideo15": ("num_layers",),
    "cosmos": ("num_layers",),
    "minimax-h3": ("num_layers",),
    "ideogram4": ("num_layers",),
    "kandinsky5": ("num_visual_blocks",),  # its 2 text blocks run on the text alone
    "ernie-image": ("num_layers",),
    "lumina2": ("num_layers",),  # its 2 + 2 refiner blocks run on the caption or the image alone
    "qwenimage21": ("num_layers",),
    "flux3": ("num_layers", "num_single_layers"),  # the image's own blocks (each mode has as many)
    "helios": ("num_layers",),
}


class _Stacks(Mapping):
    """The block stacks of each transformer family, in call order, which is the order of its
    DEPTH_KEYS: its spec's (:mod:`toma.adapters`), read at the first look-up of a family, as
    the spec's import needs torch. The families are DEPTH_KEYS's."""

    def __getitem__(self, family: str) -> tuple[str, ...]:
        if family not in DEPTH_KEYS:
            raise KeyError(family)
        return _spec(family).stacks

    def __contains__(self, family: object) -> bool:
        return family in DEPTH_KEYS

    def __iter__(self) -> Iterator[str]:
        return iter(DEPTH_KEYS)

    def __len__(self) -> int:
        return len(DEPTH_KEYS)


STACKS: Mapping[str, tuple[str, ...]] = _Stacks()


def _spec(family: str) -> Any:
    """The :class:`~toma.adapters.spec.FamilySpec` of a transformer family."""
    import importlib

    from toma.adapters import FAMILIES

    return importlib.import_module(FAMILIES[family][0]).SPEC


def denoiser_class(family: str) -> str:
    """The diffusers class name of a family's denoiser: the UNets', or the first its spec names."""
    return "UNet2DConditionModel" if family == "unet" else _spec(family).classes[0]


@dataclass(frozen=True)
class Arch:
    """One benchmarkable denoiser.

    Attributes:
        name: the ``--arch`` value.
        family: ``"unet"`` or a family name of :data:`toma.adapters.FAMILIES` (``"flux"``,
            ``"wan"``, ...; :func:`toma.supported` lists them).
        config: constructor keyword arguments of the diffusers model class.
        resolution: default image resolution in pixels.
        text_tokens: prompt length the pipeline feeds the denoiser.
        text_dim: width of the prompt embeddings (``cross_attention_dim`` / ``joint_attention_dim``).
        pooled_dim: width of the pooled prompt embedding (SDXL text_embeds, Flux pooled), or 0.
        vae_scale: pixels per latent pixel.
        description: one line for the report.
        aspect: width over height of the default frame (Wan's 480p is 832 x 480).
        frames: video: default frames in pixels; 0 for images.
        time_scale: video: frames per latent frame after the first (the VAE keeps the first).
        patch: latent pixels per token side (1 for UNets and LTX, 2 for the other transformers).
        references: reference images (of the generated image's size) whose tokens follow the
            image's in the call, as in editing (Flux Kontext); 0 for plain generation.
    """

    name: str
    family: str
    config: dict[str, Any] = field(repr=False)
    resolution: int
    text_tokens: int
    text_dim: int
    pooled_dim: int
    vae_scale: int
    description: str
    aspect: float = 1.0
    frames: int = 0
    time_scale: int = 4
    patch: int = 2
    references: int = 0

    def size(self, resolution: int) -> tuple[int, int]:
        """``(height, width)`` in pixels for ``resolution`` (the height), a whole number of
        tokens on each side."""
        step = self.patch * self.vae_scale
        return resolution, max(step, round(resolution * self.aspect / step) * step)


ARCHS: dict[str, Arch] = {
    "sdxl": Arch("sdxl", "unet", SDXL_UNET, 1024, 77, 2048, 1280, 8, "SDXL-base UNet", patch=1),
    "sd15": Arch("sd15", "unet", SD15_UNET, 512, 77, 768, 0, 8, "Stable Diffusion 1.5 UNet", patch=1),
    "flux": Arch("flux", "flux", FLUX_DEV, 1024, 512, 4096, 768, 8, "Flux.1-dev transformer"),
    "flux-kontext": Arch(
        "flux-kontext",
        "flux",
        FLUX_DEV,
        1024,
        512,
        4096,
        768,
        8,
        "Flux.1 Kontext transformer, editing one reference image",
        references=1,
    ),
    "tiny-unet": Arch("tiny-unet", "unet", TINY_UNET, 128, 8, 32, 0, 8, "tiny SD-like UNet (tests)", patch=1),
    "tiny-flux": Arch("tiny-flux", "flux", TINY_FLUX, 128, 8, 32, 16, 8, "tiny Flux-like transformer (tests)"),
    "tiny-flux-kontext": Arch(
        "tiny-flux-kontext",
        "flux",
        TINY_FLUX,
        128,
        8,
        32,
        16,
        8,
        "tiny Flux-like transformer with a reference image (tests)",
        references=1,
    ),
    "sd35": Arch("sd35", "sd3", SD35_MEDIUM, 1024, 333, 4096, 2048, 8, "SD3.5-Medium transformer"),
    "wan": Arch("wan", "wan", WAN21_1_3B, 480, 512, 4096, 0, 8, "Wan 2.1 T2V 1.3B transformer", 832 / 480, 81),
    "tiny-sd3": Arch("tiny-sd3", "sd3", TINY_SD3, 128, 8, 32, 16, 8, "tiny SD3-like transformer (tests)"),
    "tiny-wan": Arch("tiny-wan", "wan", TINY_WAN, 64, 8, 32, 0, 8, "tiny Wan-like transformer (tests)", 1.0, 5),
    "pixart": Arch("pixart", "pixart", PIXART_SIGMA, 1024, 300, 4096, 0, 8, "PixArt-Sigma XL 1024 transformer"),
    "ltx": Arch("ltx", "ltx", LTX_VIDEO, 512, 128, 4096, 0, 32, "LTX-Video 0.9 transformer", 768 / 512, 121, 8, 1),
    # LTX2Pipeline's defaults: 768x512, 121 frames at 24 fps, prompts padded to 1024 tokens
    "ltx2": Arch(
        "ltx2",
        "ltx2",
        LTX2_VIDEO,
        512,
        1024,
        3840,
        0,
        32,
        "LTX-2 19B transformer (video + audio)",
        768 / 512,
        121,
        8,
        1,
    ),
    "hunyuanvideo": Arch(
        "hunyuanvideo",
        "hunyuanvideo",
        HUNYUAN_VIDEO,
        720,
        256,
        4096,
        768,
        8,
        "HunyuanVideo 13B transformer",
        1280 / 720,
        129,
    ),
    "cogvideox": Arch(
        "cogvideox", "cogvideox", COGVIDEOX_5B, 480, 226, 4096, 0, 8, "CogVideoX-5B transformer", 720 / 480, 49
    ),
    "tiny-hunyuanvideo": Arch(
        "tiny-hunyuanvideo",
        "hunyuanvideo",
        TINY_HUNYUAN_VIDEO,
        64,
        8,
        32,
        16,
        8,
        "tiny HunyuanVideo-like transformer (tests)",
        1.0,
        5,
    ),
    "tiny-cogvideox": Arch(
        "tiny-cogvideox",
        "cogvideox",
        TINY_COGVIDEOX,
        64,
        8,
        32,
        0,
        8,
        "tiny CogVideoX-like transformer (tests)",
        1.0,
        5,
    ),
    # Qwen-Image's prompt embeddings are as long as the prompt (its pipeline trims the
    # padding); 128 tokens stands for a prompt of a few sentences. FLUX.2 pads to 512.
    "qwenimage": Arch("qwenimage", "qwenimage", QWEN_IMAGE, 1024, 128, 3584, 0, 8, "Qwen-Image transformer"),
    "flux3": Arch("flux3", "flux3", FLUX3, 1024, 512, 20480, 0, 8, "FLUX.3 transformer"),
    # a step after the first: the target's tokens, decoding from a cache of a 128-token prompt
    "qwenimage21": Arch(
        "qwenimage21", "qwenimage21", QWEN_IMAGE_21, 1024, 128, 4096, 0, 8, "Qwen-Image 2.1 transformer, a cached step"
    ),
    "flux2": Arch("flux2", "flux2", FLUX2_DEV, 1024, 512, 15360, 0, 8, "FLUX.2-dev transformer"),
    "tiny-qwenimage": Arch(
        "tiny-qwenimage", "qwenimage", TINY_QWEN_IMAGE, 64, 8, 32, 0, 8, "tiny Qwen-Image-like transformer (tests)"
    ),
    "tiny-flux2": Arch("tiny-flux2", "flux2", TINY_FLUX2, 64, 8, 32, 0, 8, "tiny FLUX.2-like transformer (tests)"),
    # Krea 2's pipeline pads the prompt to 512 tokens (and masks the padding); each token
    # carries 12 tapped text-encoder layers of 2560
    "krea2": Arch("krea2", "krea2", KREA2, 1024, 512, 2560, 0, 8, "Krea 2 transformer (12.9B)"),
    # FIBO's prompt is a structured JSON caption of up to 1000+ words, as long as it is:
    # 1024 tokens stands for one
    "bria-fibo": Arch("bria-fibo", "bria-fibo", BRIA_FIBO, 1024, 1024, 4096, 0, 16, "Bria FIBO transformer", patch=1),
    # the pipeline passes each prompt's own tokens (up to 512), padded to a multiple of 32: 512 stands for one
    "zimage": Arch("zimage", "zimage", ZIMAGE, 1024, 512, 2560, 0, 8, "Z-Image-Turbo transformer (6B)"),
    "lumina2": Arch("lumina2", "lumina2", LUMINA2, 1024, 256, 2304, 0, 8, "Lumina-Image 2.0 transformer (2.6B)"),
    # Chroma's pipeline pads the T5 prompt to 512 tokens, as Flux's
    "chroma": Arch("chroma", "chroma", CHROMA, 1024, 512, 4096, 0, 8, "Chroma1-HD transformer (8.9B)"),
    # the pipeline's 384x640 and chunks of 9 latent frames (33 frames), after its histories
    "helios": Arch("helios", "helios", HELIOS, 384, 512, 4096, 0, 8, "Helios transformer, a chunk", 640 / 384, 33),
    "wan-vace": Arch(
        "wan-vace", "wan-vace", WAN_VACE_14B, 480, 512, 4096, 0, 8, "Wan 2.1 VACE 14B transformer", 832 / 480, 81
    ),
    # 480p (848x480, the pipeline's 16:9), 16x VAE, 1000 MLLM + 256 ByT5 prompt tokens as padded
    # by the pipeline, text to video (its image embedding of zeros)
    "hunyuanvideo15": Arch(
        "hunyuanvideo15",
        "hunyuanvideo15",
        HUNYUAN_VIDEO15,
        480,
        1000,
        3584,
        0,
        16,
        "HunyuanVideo 1.5 480p transformer (8.3B)",
        848 / 480,
        121,
        patch=1,
    ),
    # the pipeline's 768x1360 image (Wan's 8x VAE) and T5 prompt of 512
    "cosmos": Arch(
        "cosmos", "cosmos", COSMOS_PREDICT2_2B, 768, 512, 1024, 0, 8, "Cosmos-Predict2 2B text-to-image", 1360 / 768
    ),
    # the pipeline's T5 and Llama prompts, 128 tokens each
    "hidream": Arch("hidream", "hidream", HIDREAM, 1024, 128, 4096, 2048, 8, "HiDream-I1-Full transformer (17B)"),
    # the modular pipeline's default canvas (768x1344, 16x VAE) and shortest clip (5 s at 24 fps:
    # 124 frames, 37 latent frames); the prompt is as long as it is (no padding): 256 tokens
    # stand for one
    "minimax-h3": Arch(
        "minimax-h3",
        "minimax-h3",
        MINIMAX_H3,
        768,
        256,
        5120,
        0,
        16,
        "MiniMax H3 transformer (33B, video + audio)",
        1344 / 768,
        124,
    ),
    # the pipeline's 2048px default; its conditional transformer always takes 2048 text slots
    # (max_sequence_length), a prompt's tokens left-padded to it
    "ideogram4": Arch("ideogram4", "ideogram4", IDEOGRAM4, 2048, 2048, 53248, 0, 8, "Ideogram 4 transformer (9.3B)"),
    # the T2V pipeline's 512x768 x 121 frames; its Qwen2.5-VL prompt embeddings are as long as
    # the longest prompt (up to 256 tokens): 128 stands for one of a few sentences
    "kandinsky5": Arch(
        "kandinsky5",
        "kandinsky5",
        KANDINSKY5_LITE,
        512,
        128,
        3584,
        768,
        8,
        "Kandinsky 5.0 T2V Lite transformer (2B)",
        768 / 512,
        121,
    ),
    # 1024px: the pipeline's 16x latents (the VAE's 8x, patchified 2x2 by the pipeline), one
    # token each; its Mistral3 prompt embeddings are as long as the prompt (padded to the
    # longest of a CFG batch): 128 stands for one of a few sentences
    "ernie-image": Arch(
        "ernie-image", "ernie-image", ERNIE_IMAGE, 1024, 128, 3072, 0, 16, "ERNIE-Image transformer (8B)", patch=1
    ),
}


def get_arch(name: str) -> Arch:
    """The architecture called ``name``; raises ValueError listing the known ones."""
    if name not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {name!r}")
    return ARCHS[name]


def reduced_config(family: str, config: dict[str, Any], depth: int) -> dict[str, Any]:
    """A transformer config with ``depth`` times fewer blocks in every stack (at least one each).

    Width (heads, head size, MLP) is unchanged, so every block costs what a full one costs.
    SD3.5's image-only second attention stays on the same share of the first blocks.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be an int >= 1 (1 = full depth); got {depth!r}")
    if family not in DEPTH_KEYS:
        raise ValueError(f"depth applies to transformers ({', '.join(DEPTH_KEYS)}); got depth={depth} for a {family}")
    counts = [key for key in DEPTH_KEYS[family] if not isinstance(config[key], (list, tuple))]
    out = {**config, **{key: max(1, round(config[key] / depth)) for key in counts}}
    if family == "wan-vace":  # the control blocks that join the blocks built, at the same share
        every = max(1, round(config["num_layers"] / len(config["vace_layers"])))
        out["vace_layers"] = list(range(0, out["num_layers"], every))
    if family == "hidream":  # one Llama layer's features per block built
        out["llama_layers"] = config["llama_layers"][: out["num_layers"] + out["num_single_layers"]]
    if config.get("dual_attention_layers"):
        dual = round(len(config["dual_attention_layers"]) / depth)
        out["dual_attention_layers"] = tuple(range(min(dual, out["num_layers"])))
    return out


def build_model(
    arch: Arch,
    depth: int = 1,
    model_path: str | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> torch.nn.Module:
    """Build the denoiser of ``arch`` in eval mode.

    Args:
        arch: the architecture.
        depth: transformers: build ``depth`` times fewer blocks (see :func:`reduced_config`).
        model_path: a local directory or an already-cached hub id with real weights (looked up
            without network access, in ``unet/`` or ``transformer/`` or at the top level).
            None builds random weights from ``arch.config``.
        dtype, device: where the weights live (dtype None: float32).
        seed: seed of the random weights.
    """
    import diffusers
    import torch

    dtype = torch.float32 if dtype is None else dtype

    cls = getattr(diffusers, denoiser_class(arch.family))
    if model_path is not None:
        sub = "unet" if arch.family == "unet" else "transformer"
        errors = []
        for subfolder in (sub, None):
            try:
                model = cls.from_pretrained(model_path, subfolder=subfolder, torch_dtype=dtype, local_files_only=True)
                break
            except (OSError, ValueError, EnvironmentError) as err:
                errors.append(f"{subfolder or '.'}: {err}")
        else:
            raise FileNotFoundError(
                f"no {cls.__name__} weights found at --model {model_path!r} (no download is tried): {errors}"
            )
        return model.to(device).eval()
    config = dict(arch.config)
    if depth != 1 or arch.family in DEPTH_KEYS:
        config = reduced_config(arch.family, config, depth)
    device = torch.device(device)
    forked = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked), device:
        torch.manual_seed(seed)
        # initialise where the model will run: a 12B-parameter init on the CPU alone
        # takes minutes, on a GPU seconds
        model = cls(**config)
    if dtype != torch.float32 and getattr(model, "_keep_in_fp32_modules", None):
        return model.to(dtype=dtype).eval()  # its warning is then true: those modules are cast too
    # diffusers' ModelMixin.to warns "should be kept in float32: []" at any dtype cast, even
    # when no module is to be kept or the dtype is float32; nn.Module.to casts alike, silently
    return torch.nn.Module.to(model, dtype=dtype).eval()


def make_inputs(
    arch: Arch,
    resolution: int,
    batch: int = 1,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    frames: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of one denoiser call at ``resolution`` pixels high (see :meth:`Arch.size`).

    UNet: ``sample (B, 4, R/8, R/8)``, ``encoder_hidden_states (B, L, text_dim)``, plus SDXL's
    ``added_cond_kwargs``. Flux: packed latents ``hidden_states (B, (R/16)^2, 64)``, text
    ``(B, 512, 4096)``, ``pooled_projections (B, 768)``, ``img_ids``, ``txt_ids``, ``guidance``.
    SD3: latents ``(B, 16, R/8, R/8)``, text, pooled. Wan: latents ``(B, 16, F', H/8, W/8)``
    with ``F' = (frames - 1) / 4 + 1`` latent frames (``frames`` defaults to the arch's), text.
    HunyuanVideo: the same latents, text with its (all-ones) mask, pooled, guidance.
    CogVideoX: latents ``(B, F', 16, H/8, W/8)``, text, the pipeline's rotary tables.
    Kandinsky 5: channel-last latents ``(B, F', H/8, W/8, C)``, text, pooled, rotary positions.
    ERNIE-Image: latents ``(B, 128, R/16, R/16)``, text ``text_bth`` with its ``text_lens``.
    Qwen-Image: packed latents ``(B, (R/16)^2, 64)``, text, ``img_shapes``. Flux.2: packed
    latents ``(B, (R/16)^2, 128)``, text ``(B, 512, 15360)``, 4-column ``img_ids``, ``txt_ids``.
    The timestep is a placeholder; :func:`set_timestep` changes it per step. ``dtype`` None
    means float32.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    g = torch.Generator().manual_seed(seed)
    height, width = arch.size(resolution)
    step = arch.patch * arch.vae_scale
    if height // arch.vae_scale < 2 or resolution % step:
        raise ValueError(f"resolution must be a multiple of {step} pixels; got {resolution}")
    lh, lw = height // arch.vae_scale, width // arch.vae_scale

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    text = rand(batch, arch.text_tokens, arch.text_dim)
    if arch.family == "kandinsky5":  # channel-last latents (with visual_cond: + conditioning + its mask)
        count, cfg = latent_frames(arch, frames), arch.config
        channels = cfg["in_visual_dim"] * (2 if cfg.get("visual_cond") else 1) + bool(cfg.get("visual_cond"))
        return {
            "hidden_states": rand(batch, count, lh, lw, channels),
            "encoder_hidden_states": text,
            "pooled_projections": rand(batch, arch.pooled_dim),
            "timestep": torch.full((batch,), 999.0, device=device, dtype=dtype),
            "visual_rope_pos": [torch.arange(n, device=device) for n in (count, lh // 2, lw // 2)],
            "text_rope_pos": torch.arange(arch.text_tokens, device=device),
            "scale_factor": (1, 2, 2),  # the pipeline's at 480-854 pixels a side
            "return_dict": False,
        }
    channels = arch.config["in_channels"]
    if arch.family == "unet":
        inputs: dict[str, Any] = {
            "sample": rand(batch, channels, lh, lw),
            "timestep": torch.tensor(999.0, device=device),
            "encoder_hidden_states": text,
        }
        if arch.config.get("addition_embed_type") == "text_time":
            size = [float(height), float(width), 0.0, 0.0, float(height), float(width)]
            inputs["added_cond_kwargs"] = {
                "text_embeds": rand(batch, arch.pooled_dim),
                "time_ids": torch.tensor([size] * batch, device=device, dtype=dtype),
            }
        return inputs
    timestep = torch.full((batch,), 999.0, device=device, dtype=dtype)
    if arch.family == "sd3":
        return {
            "hidden_states": rand(batch, channels, lh, lw),
            "encoder_hidden_states": text,
            "pooled_projections": rand(batch, arch.pooled_dim),
            "timestep": timestep,
            "return_dict": False,
        }
    if arch.family == "wan":
        count = latent_frames(arch, frames)
        return {
            "hidden_states": rand(batch, channels, count, lh, lw),
            "timestep": timestep,
            "encoder_hidden_states": text,
            "return_dict": False,
        }
    if arch.family == "pixart":
        return {
            "hidden_states": rand(batch, channels, lh, lw),
            "encoder_hidden_states": text,
            "timestep": timestep,
            "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
            "return_dict": False,
        }
    if arch.family == "ltx":
        count = latent_frames(arch, frames)
        return {
            "hidden_states": rand(batch, count * lh * lw, channels),
            "encoder_hidden_states": text,
            "timestep": timestep,
            "encoder_attention_mask": torch.ones(batch, arch.text_tokens, device=device, dtype=dtype),
            "num_frames": count,
            "height": lh,
            "width": lw,
            "return_dict": False,
        }
    if arch.family == "ltx2":  # video and audio latents, each stream with its prompt
        count = latent_frames(arch, frames)
        audio = ltx2_audio_frames(arch, frames)
        mask = torch.ones(batch, arch.text_tokens, device=device, dtype=dtype)
        return {
            "hidden_states": rand(batch, count * lh * lw, channels),
            "audio_hidden_states": rand(batch, audio, arch.config["audio_in_channels"]),
            "encoder_hidden_states": text,
            "audio_encoder_hidden_states": rand(batch, arch.text_tokens, arch.text_dim),
            "timestep": timestep,
            "encoder_attention_mask": mask,
            "audio_encoder_attention_mask": mask,
            "num_frames": count,
            "height": lh,
            "width": lw,
            "audio_num_frames": audio,
            "return_dict": False,
        }
    if arch.family == "hunyuanvideo":
        count = latent_frames(arch, frames)
        return {
            "hidden_states": rand(batch, channels, count, lh, lw),
            "timestep": timestep,
            "encoder_hidden_states": text,
            "encoder_attention_mask": torch.ones(batch, arch.text_tokens, device=device, dtype=dtype),
            "pooled_projections": rand(batch, arch.pooled_dim),
            "guidance": torch.full((batch,), 6000.0, device=device, dtype=dtype),
            "return_dict": False,
        }
    if arch.family == "cogvideox":
        count = latent_frames(arch, frames)
        return {
            "hidden_states": rand(batch, count, channels, lh, lw),
            "encoder_hidden_states": text,
            "timestep": timestep,
            "image_rotary_emb": cogvideox_rotary(arch.config, count, lh, lw, device, dtype),
            "return_dict": False,
        }
    if arch.family == "krea2":  # packed 2x2 latent patches, text rows of position_ids first
        th, tw = lh // 2, lw // 2
        rows, cols = torch.meshgrid(torch.arange(th), torch.arange(tw), indexing="ij")
        image_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3)
        layers = arch.config["num_text_layers"]
        return {
            "hidden_states": rand(batch, th * tw, channels),
            "encoder_hidden_states": rand(batch, arch.text_tokens, layers, arch.text_dim),
            "timestep": timestep / 1000,
            "position_ids": torch.cat([torch.zeros(arch.text_tokens, 3), image_ids]).float().to(device),
            "encoder_attention_mask": torch.ones(batch, arch.text_tokens, dtype=torch.bool, device=device),
            "return_dict": False,
        }
    if arch.family == "zimage":  # lists of per-sample (C, 1, H/8, W/8) latents and captions; t = 1 - sigma
        return {
            "x": [rand(channels, 1, lh, lw) for _ in range(batch)],
            "t": torch.zeros(batch, device=device, dtype=dtype),
            "cap_feats": [rand(arch.text_tokens, arch.text_dim) for _ in range(batch)],
            "return_dict": False,
        }
    if arch.family == "lumina2":  # one prompt per call (CFG's passes apart): every caption its full length
        return {
            "hidden_states": rand(batch, channels, lh, lw),
            "timestep": torch.zeros(batch, device=device, dtype=dtype),
            "encoder_hidden_states": text,
            "encoder_attention_mask": torch.ones(batch, arch.text_tokens, dtype=torch.bool, device=device),
            "return_dict": False,
        }
    if arch.family == "helios":  # a chunk after its pipeline's three histories, frame indices in order
        count, call = latent_frames(arch, frames), {}
        first = 0
        for name in ("long", "mid", "short"):
            size = HELIOS_HISTORY[name]
            call[f"latents_history_{name}"] = rand(batch, channels, size, lh, lw)
            call[f"indices_latents_history_{name}"] = torch.arange(first, first + size, device=device)[None].expand(
                batch, -1
            )
            first += size
        return {
            "hidden_states": rand(batch, channels, count, lh, lw),
            "timestep": timestep,
            "encoder_hidden_states": text,
            "indices_hidden_states": torch.arange(first, first + count, device=device)[None].expand(batch, -1),
            **call,
            "return_dict": False,
        }
    if arch.family == "wan-vace":  # Wan's call and a control input (VACE's 96 channels) over the same latents
        count = latent_frames(arch, frames)
        return {
            "hidden_states": rand(batch, channels, count, lh, lw),
            "timestep": timestep,
            "encoder_hidden_states": text,
            "control_hidden_states": rand(batch, arch.config["vace_in_channels"], count, lh, lw),
            "return_dict": False,
        }
    if arch.family == "hunyuanvideo15":  # text to video: the condition channels and image embedding zero
        count = latent_frames(arch, frames)
        latents = torch.cat(
            [
                rand(batch, 32, count, lh, lw),
                torch.zeros(batch, channels - 32, count, lh, lw, device=device, dtype=dtype),
            ],
            dim=1,
        )
        ones = torch.ones(batch, arch.text_tokens, device=device, dtype=dtype)
        return {
            "hidden_states": latents,
            "timestep": timestep,
            "encoder_hidden_states": text,
            "encoder_attention_mask": ones,
            "encoder_hidden_states_2": rand(batch, 256, arch.config["text_embed_2_dim"]),
            "encoder_attention_mask_2": torch.ones(batch, 256, device=device, dtype=dtype),
            "image_embeds": torch.zeros(batch, 729, arch.config["image_embed_dim"], device=device, dtype=dtype),
            "return_dict": False,
        }
    if arch.family == "cosmos":  # one latent frame: the text-to-image pipeline's call
        return {
            "hidden_states": rand(batch, channels, 1, lh, lw),
            "timestep": torch.full((batch,), 0.5, device=device, dtype=dtype),
            "encoder_hidden_states": text,
            "return_dict": False,
        }
    if arch.family == "hidream":  # latents (the model patchifies them); the Llama's hidden states, layer by layer
        return {
            "hidden_states": rand(batch, channels, lh, lw),
            "timesteps": timestep,
            "encoder_hidden_states_t5": text,
            "encoder_hidden_states_llama3": rand(
                max(arch.config["llama_layers"]) + 1, batch, arch.text_tokens, arch.config["caption_channels"][1]
            ),
            "pooled_embeds": rand(batch, arch.pooled_dim),
            "return_dict": False,
        }
    if arch.family == "ideogram4":  # the conditional transformer's [padding; text; image], the pipeline's layout
        from diffusers.pipelines.ideogram4.pipeline_ideogram4 import Ideogram4Pipeline

        th, tw, slots = lh // 2, lw // 2, arch.text_tokens
        prompt = [min(IDEOGRAM4_PROMPT, slots)] * batch
        ids, segments, indicator = Ideogram4Pipeline._prepare_ids(prompt, th, tw, slots, device)
        return {
            "hidden_states": torch.cat(
                [torch.zeros(batch, slots, channels), torch.randn(batch, th * tw, channels, generator=g)], 1
            ).to(device=device, dtype=dtype),
            "timestep": torch.zeros(batch, device=device, dtype=dtype),
            "encoder_hidden_states": rand(batch, slots + th * tw, arch.text_dim),
            "position_ids": ids,
            "segment_ids": segments,
            "indicator": indicator,
            "return_dict": False,
        }
    if arch.family == "minimax-h3":  # the modular pipeline's t2va layout: [text; audio; video], all at one level
        return minimax_h3_inputs(arch, rand, batch, lh, lw, frames, device)
    if arch.family == "ernie-image":  # one token per 16x latent pixel; every prompt its full length
        return {
            "hidden_states": rand(batch, channels, lh, lw),
            "timestep": timestep,
            "text_bth": text,
            "text_lens": torch.full((batch,), arch.text_tokens, device=device, dtype=torch.long),
            "return_dict": False,
        }
    if arch.family == "bria-fibo":  # FIBO's 16x VAE latents, one token per latent pixel
        rows, cols = torch.meshgrid(torch.arange(lh), torch.arange(lw), indexing="ij")
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3)
        blocks = arch.config["num_layers"] + arch.config["num_single_layers"]
        width = arch.config["text_encoder_dim"]
        return {
            "hidden_states": rand(batch, lh * lw, channels),
            "encoder_hidden_states": text,
            # one text-encoder layer per block of the full model (call_denoiser passes the built model's)
            "text_encoder_layers": [rand(batch, arch.text_tokens, width) for _ in range(blocks)],
            "timestep": timestep,
            "img_ids": img_ids.float().to(device),
            "txt_ids": torch.zeros(arch.text_tokens, 3, device=device),
            "return_dict": False,
        }
    # Flux, Flux.2 and Qwen-Image pack 2x2 latent patches into one token
    th, tw = lh // 2, lw // 2
    if arch.family == "qwenimage":  # no text mask: the pipeline drops an all-ones mask
        return {
            "hidden_states": rand(batch, th * tw, channels),
            "encoder_hidden_states": text,
            "timestep": timestep / 1000,
            "img_shapes": [[(1, th, tw)]] * batch,
            "return_dict": False,
        }
    if arch.family == "qwenimage21":  # a cached step: the prompt's keys and values from the prefill
        from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

        cfg = arch.config
        cache = QwenImage21KVCache(cfg["num_layers"])  # as many as the full model: --depth builds fewer
        heads, width = cfg["num_attention_heads"], cfg["attention_head_dim"]
        for layer in cache.layer_caches:
            layer.store(rand(batch, arch.text_tokens, heads, width), rand(batch, arch.text_tokens, heads, width))
        slots = torch.ones(batch, arch.text_tokens + th * tw // 4, dtype=torch.bool, device=device)
        slots[:, : arch.text_tokens] = False  # the encoder's text, then the target's slots of 2x2 tokens
        return {
            "hidden_states": rand(batch, th * tw, channels),
            "encoder_hidden_states": text,
            "timestep": timestep / 1000,
            "img_shapes": [[(1, th, tw)]] * batch,
            "img_mask": slots,
            "kv_cache": cache,
            "kv_cache_mode": "cached",
            "return_dict": False,
        }
    if arch.family == "flux3":  # one set of (t, h, w, l) ids for the batch
        one = torch.arange(1, device=device)
        return {
            "hidden_states": rand(batch, th * tw, channels),
            "encoder_hidden_states": text,
            "timestep": timestep / 1000,
            "img_ids": torch.cartesian_prod(one, torch.arange(th, device=device), torch.arange(tw, device=device), one),
            "txt_ids": torch.cartesian_prod(one, one, one, torch.arange(arch.text_tokens, device=device)),
            "return_dict": False,
        }
    if arch.family == "flux2":
        one = torch.arange(1)
        img_ids = torch.cartesian_prod(one, torch.arange(th), torch.arange(tw), one)
        txt_ids = torch.cartesian_prod(one, one, one, torch.arange(arch.text_tokens))
        return {
            "hidden_states": rand(batch, th * tw, channels),
            "encoder_hidden_states": text,
            "timestep": timestep / 1000,
            "img_ids": img_ids[None].expand(batch, -1, -1).to(device),
            "txt_ids": txt_ids[None].expand(batch, -1, -1).to(device),
            "guidance": torch.full((batch,), 4.0, device=device, dtype=dtype),
            "return_dict": False,
        }
    if arch.family == "chroma":  # Flux.1's call without pooled projections or guidance
        rows, cols = torch.meshgrid(torch.arange(th), torch.arange(tw), indexing="ij")
        return {
            "hidden_states": rand(batch, th * tw, channels),
            "encoder_hidden_states": text,
            "timestep": torch.full((batch,), 1.0, device=device, dtype=dtype),
            "img_ids": torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).to(device, dtype),
            "txt_ids": torch.zeros(arch.text_tokens, 3, device=device, dtype=dtype),
            "return_dict": False,
        }
    ids = torch.zeros(1 + arch.references, th, tw, 3)
    ids[..., 0] = torch.arange(1 + arch.references)[:, None, None]  # Kontext: references are frames 1, 2, ...
    ids[..., 1] = torch.arange(th)[:, None]
    ids[..., 2] = torch.arange(tw)[None, :]
    return {
        "hidden_states": rand(batch, (1 + arch.references) * th * tw, channels),
        "encoder_hidden_states": text,
        "pooled_projections": rand(batch, arch.pooled_dim),
        "timestep": torch.full((batch,), 1.0, device=device, dtype=dtype),
        "img_ids": ids.reshape(-1, 3).to(device=device, dtype=dtype),
        "txt_ids": torch.zeros(arch.text_tokens, 3, device=device, dtype=dtype),
        "guidance": torch.full((batch,), 3.5, device=device, dtype=dtype),
        "return_dict": False,
    }


IDEOGRAM4_PROMPT = 256  # a prompt's tokens in Ideogram 4's text slots (the rest is left padding)


def minimax_h3_inputs(
    arch: Arch, rand: Any, batch: int, lh: int, lw: int, frames: int | None, device: torch.device | str
) -> dict[str, Any]:
    """A MiniMax H3 call as its modular pipeline makes it for text-to-video+audio: the packed
    layout of its ``build_packed_sequence`` (text rows, the stereo soundtrack's rows, then the
    video's), every row at one timestep."""
    import torch
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames

    pixels = arch.frames if frames is None else frames
    count, text = latent_frames(arch, frames), arch.text_tokens
    ids, tags, video, audio, text_rows, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.ones(text, dtype=torch.long), count, lh, lw, audio_latent_num_frames(pixels), (1, 2, 2), 2, 2, 0
    )
    config = arch.config
    return {
        "hidden_states": rand(batch, video.numel(), config["in_channels"] * 4),
        "audio_hidden_states": rand(batch, audio.numel(), config["audio_in_channels"]),
        "encoder_hidden_states": rand(batch, text, arch.text_dim),
        "timestep": torch.ones(1, device=device),
        "timestep_indices": torch.zeros(ids.shape[0], dtype=torch.long, device=device),
        "token_tags": tags.to(device),
        "position_ids": ids.float().to(device),
        "video_indices": video.to(device),
        "audio_indices": audio.to(device),
        "text_indices": text_rows.to(device),
        "return_dict": False,
    }


def cogvideox_rotary(
    config: dict[str, Any],
    frames: int,
    lh: int,
    lw: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(frames * h * w, head_dim)`` cos and sin tables CogVideoXPipeline passes for a
    ``frames x lh x lw`` latent video (CogVideoX 1.0's crop-to-base-grid positions), in
    ``dtype`` (None: float32)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    p = config["patch_size"]
    h, w = lh // p, lw // p
    crops = get_resize_crop_region_for_grid((h, w), config["sample_width"] // p, config["sample_height"] // p)
    cos, sin = get_3d_rotary_pos_embed(config["attention_head_dim"], crops, (h, w), frames, device=device)
    return cos.to(dtype), sin.to(dtype)


def latent_frames(arch: Arch, frames: int | None = None) -> int:
    """Latent frames of a video arch for ``frames`` pixel frames (its default if None): the
    VAE keeps the first frame and compresses the rest ``time_scale`` times. 1 for images."""
    if arch.family == "minimax-h3":  # its video VAE encodes chunks of 17 frames to 5 latents
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import video_latent_num_frames

        frames = arch.frames if frames is None else frames
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 5 or frames % 17 != 5:
            raise ValueError(f"frames must be 17k + 5 (MiniMax H3's video VAE chunks); got {frames!r}")
        return video_latent_num_frames(frames, 17, 5)
    if not arch.frames:
        if frames not in (None, 0, 1):
            raise ValueError(f"frames applies to video archs; {arch.name} draws images")
        return 1
    frames = arch.frames if frames is None else frames
    k = arch.time_scale
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1 or (frames - 1) % k:
        raise ValueError(
            f"frames must be 1 + {k}k (the video VAE keeps the first frame and compresses {k} into 1); got {frames!r}"
        )
    return (frames - 1) // k + 1


def ltx2_audio_frames(arch: Arch, frames: int | None = None, fps: float = 24.0) -> int:
    """Audio latents LTX2Pipeline makes for ``frames`` pixel frames (the arch's default if None)
    at ``fps``: the clip's seconds times the audio VAE's latents a second."""
    frames = arch.frames if frames is None else frames
    config = arch.config
    per_second = config["audio_sampling_rate"] / config["audio_hop_length"] / config["audio_scale_factor"]
    return max(1, round(frames / fps * per_second))


def set_timestep(arch: Arch, inputs: dict[str, Any], step: int, steps: int) -> dict[str, Any]:
    """``inputs`` at denoising step ``step`` of ``steps`` (timesteps decrease, as in a sampler)."""
    import torch

    frac = 1.0 - step / max(steps, 1)
    if arch.family == "zimage":  # t = 1 - sigma: rises over a run
        return {**inputs, "t": torch.full_like(inputs["t"], 1.0 - frac)}
    if arch.family == "hidream":
        return {**inputs, "timesteps": torch.full_like(inputs["timesteps"], 999.0 * frac)}
    if arch.family in ("ideogram4", "lumina2"):  # model time 1 - sigma (0 is noise): rises over a run
        return {**inputs, "timestep": torch.full_like(inputs["timestep"], 1.0 - frac)}
    t = inputs["timestep"]
    # the flow-matching transformers take the timestep in [0, 1]
    flow = ("flux", "flux2", "flux3", "qwenimage", "qwenimage21", "krea2", "chroma", "cosmos", "minimax-h3")  # [0, 1]
    value = max(frac, 1e-3) if arch.family in flow else 999.0 * frac
    return {**inputs, "timestep": torch.full_like(t, value)}


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


def token_grid(arch: Arch, resolution: int, frames: int | None = None) -> tuple[int, ...]:
    """Token grid of the first attention level: ``(h, w)`` for images (UNet at downsample 1,
    transformer image tokens), ``(t, h, w)`` for video."""
    height, width = arch.size(resolution)
    h, w = height // arch.vae_scale // arch.patch, width // arch.vae_scale // arch.patch
    return (latent_frames(arch, frames), h, w) if arch.frames else (h, w)


def block_count(config: dict[str, Any], key: str) -> int:
    """The blocks a ``DEPTH_KEYS`` entry of ``config`` counts: its value, or the length of a
    list of the blocks they join (Wan VACE's ``vace_layers``)."""
    value = config[key]
    return len(value) if isinstance(value, (list, tuple)) else value


def merged_blocks(count: int, full_count: int, skip: int = 5) -> tuple[int, ...]:
    """Merged block indices when ``count`` of ``full_count`` blocks are built: the default
    skip of the first ``skip`` blocks, scaled by ``count / full_count`` (at least one merged)."""
    skip = min(skip, full_count // 2)  # as the families' skip_first rule: at most half a stack
    scaled = min(count - 1, math.floor(skip * count / full_count + 0.5))
    return tuple(range(max(scaled, 0), count))


def default_placement(arch: Arch, model: torch.nn.Module) -> dict[str, Any]:
    """ToMA's default placement on a (possibly reduced-depth) transformer, as ``blocks``:
    the full model's skip of the first 5 blocks per stack, scaled to the blocks built."""
    if arch.family not in STACKS:
        return {}
    full = dict(zip(STACKS[arch.family], (block_count(arch.config, k) for k in DEPTH_KEYS[arch.family])))
    return {"blocks": {s: merged_blocks(len(model.get_submodule(s)), full[s]) for s in STACKS[arch.family]}}


def call_denoiser(arch: Arch, model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
    """One denoiser forward on :func:`make_inputs` arguments.

    UNets get ``sample`` and ``timestep`` positionally, as diffusers pipelines pass them
    (tomesd's hook reads the latent size from the first positional argument).
    """
    if arch.family == "unet":
        rest = {k: v for k, v in inputs.items() if k not in ("sample", "timestep")}
        return model(inputs["sample"], inputs["timestep"], return_dict=False, **rest)
    if arch.family == "bria-fibo":  # one text-encoder layer per block the model has (at --depth, fewer)
        inputs = {**inputs, "text_encoder_layers": inputs["text_encoder_layers"][: len(model.caption_projection)]}
    return model(**inputs)
