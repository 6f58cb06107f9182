"""The bench's chronoedit architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, latent_frames

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "chronoedit"

# ChronoEdit-14B: Wan 2.1 I2V 14B's layout, which it is fine-tuned from (36 input channels:
# 16 latent, 4 mask and 16 condition; CLIP image embeddings of 1280 before the text), with
# its rotary's reasoning clip of 8 frames
CHRONOEDIT_14B: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 36,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "image_dim": 1280,
    "added_kv_proj_dim": 5120,
    "rope_max_seq_len": 1024,
    "rope_temporal_skip_len": 8,
}

TINY_CHRONOEDIT: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "in_channels": 8,
    "out_channels": 4,
    "text_dim": 32,
    "freq_dim": 16,
    "ffn_dim": 32,
    "num_layers": 2,
    "image_dim": 16,
    "added_kv_proj_dim": 16,
    "rope_max_seq_len": 32,
    "rope_temporal_skip_len": 8,
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)

# CLIP ViT-H's 257 tokens (class token and 16x16 patches), which the pipeline puts before the text
IMAGE_TOKENS = 257


def inputs(c: Call) -> dict[str, Any]:
    """The pipeline's call: latents with the edited image's condition channels, the prompt and
    the input image's CLIP embeddings. See :func:`toma.tools.archs.make_inputs`."""
    arch = c.arch
    count = latent_frames(arch, c.frames)
    return {
        "hidden_states": c.rand(c.batch, c.channels, count, c.lh, c.lw),
        "timestep": c.timestep,
        "encoder_hidden_states": c.text,
        "encoder_hidden_states_image": c.rand(c.batch, IMAGE_TOKENS, arch.config["image_dim"]),
        "return_dict": False,
    }


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # the pipeline's 480x832 and its edit without temporal reasoning: 5 frames (2 latent: the
    # input image and the edited one); the T5 prompt padded to 512
    Arch("chronoedit", FAMILY, CHRONOEDIT_14B, 480, 512, 4096, 0, 8, "ChronoEdit-14B transformer", 832 / 480, 5),
    Arch(
        "tiny-chronoedit",
        FAMILY,
        TINY_CHRONOEDIT,
        64,
        512,
        32,
        0,
        8,
        "tiny ChronoEdit-like transformer (tests)",
        1.0,
        5,
    ),
)
