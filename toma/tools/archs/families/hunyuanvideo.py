"""The bench's hunyuanvideo architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, latent_frames

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "hunyuanvideo"


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

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers", "num_single_layers")


def inputs(c: Call) -> dict[str, Any]:
    """HunyuanVideo's call: Wan's latents, text with its (all-ones) mask, pooled, guidance.
    See :func:`toma.tools.archs.make_inputs`."""
    import torch

    arch = c.arch
    batch = c.batch
    dtype = c.dtype
    device = c.device
    frames = c.frames
    lh = c.lh
    lw = c.lw
    rand = c.rand
    text = c.text
    channels = c.channels
    timestep = c.timestep
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


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    Arch(
        "hunyuanvideo",
        FAMILY,
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
    Arch(
        "tiny-hunyuanvideo",
        FAMILY,
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
)
