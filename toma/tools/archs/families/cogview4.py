"""The bench's cogview4 architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "cogview4"

# CogView4-6B: 28 blocks of 32 heads of 128 (width 4096), GLM-4 prompt embeddings of 4096
COGVIEW4_6B: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 28,
    "attention_head_dim": 128,
    "num_attention_heads": 32,
    "text_embed_dim": 4096,
    "time_embed_dim": 512,
    "condition_dim": 256,
    "pos_embed_max_size": 128,
    "sample_size": 128,
    "rope_axes_dim": (256, 256),
}

TINY_COGVIEW4: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 4,
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "text_embed_dim": 32,
    "time_embed_dim": 16,
    "condition_dim": 4,
    "pos_embed_max_size": 32,
    "sample_size": 16,
    "rope_axes_dim": (16, 16),
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def inputs(c: Call) -> dict[str, Any]:
    """The pipeline's call: latents, the prompt, and the size conditioning of an image
    generated at its own size, uncropped. See :func:`toma.tools.archs.make_inputs`."""
    import torch

    size = torch.tensor([[c.height, c.width]], dtype=c.dtype, device=c.device).repeat(c.batch, 1)
    return {
        "hidden_states": c.rand(c.batch, c.channels, c.lh, c.lw),
        "encoder_hidden_states": c.text,
        "timestep": c.timestep,
        "original_size": size,
        "target_size": size.clone(),
        "crop_coords": torch.zeros_like(size),
        "return_dict": False,
    }


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # the pipeline's 1024px; its GLM-4 prompt embeddings are as long as the prompt, padded to a
    # multiple of 16: 128 stands for one of a few sentences
    Arch("cogview4", FAMILY, COGVIEW4_6B, 1024, 128, 4096, 0, 8, "CogView4-6B transformer"),
    Arch("tiny-cogview4", FAMILY, TINY_COGVIEW4, 64, 16, 32, 0, 8, "tiny CogView4-like transformer (tests)"),
)
