"""The bench's krea2 architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, flow_timestep

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "krea2"


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

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def inputs(c: Call) -> dict[str, Any]:
    """Packed 2x2 latent patches, text rows of position_ids first. See :func:`toma.tools.archs.make_inputs`."""
    import torch

    arch = c.arch
    batch = c.batch
    device = c.device
    lh = c.lh
    lw = c.lw
    rand = c.rand
    channels = c.channels
    timestep = c.timestep
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


# a flow-matching transformer: the timestep is sigma, in [0, 1]
timestep_at = flow_timestep


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # Krea 2's pipeline pads the prompt to 512 tokens (and masks the padding); each token
    # carries 12 tapped text-encoder layers of 2560
    Arch("krea2", FAMILY, KREA2, 1024, 512, 2560, 0, 8, "Krea 2 transformer (12.9B)"),
)
