"""The bench's wan architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, latent_frames

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "wan"


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

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def inputs(c: Call) -> dict[str, Any]:
    """Wan's call: latents ``(B, 16, F', H/8, W/8)`` with ``F' = (frames - 1) / 4 + 1`` latent
    frames (``frames`` defaults to the arch's), text. See :func:`toma.tools.archs.make_inputs`."""
    arch = c.arch
    batch = c.batch
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
        "return_dict": False,
    }


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    Arch("wan", FAMILY, WAN21_1_3B, 480, 512, 4096, 0, 8, "Wan 2.1 T2V 1.3B transformer", 832 / 480, 81),
    Arch("tiny-wan", FAMILY, TINY_WAN, 64, 8, 32, 0, 8, "tiny Wan-like transformer (tests)", 1.0, 5),
)
