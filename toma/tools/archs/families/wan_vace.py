"""The bench's wan-vace architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, latent_frames

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "wan-vace"


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

# the config keys that count blocks (what --depth divides); the control blocks: one per entry of vace_layers
DEPTH_KEYS: tuple[str, ...] = ("num_layers", "vace_layers")


def inputs(c: Call) -> dict[str, Any]:
    """Wan's call and a control input (VACE's 96 channels) over the same latents.

    See :func:`toma.tools.archs.make_inputs`.
    """
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
        "control_hidden_states": rand(batch, arch.config["vace_in_channels"], count, lh, lw),
        "return_dict": False,
    }


def reduce(full: dict[str, Any], reduced: dict[str, Any], depth: int) -> dict[str, Any]:
    """``reduced`` (``full`` with ``depth`` times fewer blocks) with the control blocks joining
    the blocks built at the same share. See :func:`toma.tools.archs.reduced_config`."""
    every = max(1, round(full["num_layers"] / len(full["vace_layers"])))
    return {**reduced, "vace_layers": list(range(0, reduced["num_layers"], every))}


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    Arch("wan-vace", FAMILY, WAN_VACE_14B, 480, 512, 4096, 0, 8, "Wan 2.1 VACE 14B transformer", 832 / 480, 81),
)
