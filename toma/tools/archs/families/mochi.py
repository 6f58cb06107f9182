"""The bench's mochi architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, latent_frames

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "mochi"

# Mochi 1 preview: the class defaults (48 blocks of 24 heads of 128, a text stream of 1536,
# T5-XXL prompt embeddings of 4096, 12 latent channels)
MOCHI_1: dict[str, Any] = {
    "patch_size": 2,
    "num_attention_heads": 24,
    "attention_head_dim": 128,
    "num_layers": 48,
    "pooled_projection_dim": 1536,
    "in_channels": 12,
    "qk_norm": "rms_norm",
    "text_embed_dim": 4096,
    "time_embed_dim": 256,
    "activation_fn": "swiglu",
    "max_sequence_length": 256,
}

TINY_MOCHI: dict[str, Any] = {
    "patch_size": 2,
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "num_layers": 2,
    "pooled_projection_dim": 16,
    "in_channels": 4,
    "text_embed_dim": 32,
    "time_embed_dim": 16,
    "max_sequence_length": 16,
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def inputs(c: Call) -> dict[str, Any]:
    """The pipeline's call: latents, the T5 prompt padded to its length with its mask (all
    of it kept), a timestep. See :func:`toma.tools.archs.make_inputs`."""
    import torch

    count = latent_frames(c.arch, c.frames)
    return {
        "hidden_states": c.rand(c.batch, c.channels, count, c.lh, c.lw),
        "encoder_hidden_states": c.text,
        "timestep": c.timestep,
        "encoder_attention_mask": torch.ones(c.batch, c.arch.text_tokens, dtype=torch.bool, device=c.device),
        "return_dict": False,
    }


def timestep_at(frac: float) -> float:
    """The timestep at ``frac`` of the noise left: Mochi's scheduler inverts the sigmas, so
    t = 1000 (1 - sigma) rises over a run."""
    return 1000.0 * (1.0 - frac)


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # the pipeline's 480x848 x 19 frames (4 latent: its VAE keeps the first and compresses 6
    # into 1) and T5 prompt padded to 256
    Arch("mochi", FAMILY, MOCHI_1, 480, 256, 4096, 0, 8, "Mochi 1 preview transformer (10B)", 848 / 480, 19, 6),
    Arch("tiny-mochi", FAMILY, TINY_MOCHI, 64, 8, 32, 0, 8, "tiny Mochi-like transformer (tests)", 1.0, 13, 6),
)
