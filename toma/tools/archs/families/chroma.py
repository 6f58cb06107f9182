"""The bench's chroma architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, flow_timestep

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "chroma"


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

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers", "num_single_layers")


def inputs(c: Call) -> dict[str, Any]:
    """Flux.1's call without pooled projections or guidance. See :func:`toma.tools.archs.make_inputs`."""
    import torch

    arch = c.arch
    batch = c.batch
    dtype = c.dtype
    device = c.device
    rand = c.rand
    text = c.text
    channels = c.channels
    th = c.th
    tw = c.tw
    rows, cols = torch.meshgrid(torch.arange(th), torch.arange(tw), indexing="ij")
    return {
        "hidden_states": rand(batch, th * tw, channels),
        "encoder_hidden_states": text,
        "timestep": torch.full((batch,), 1.0, device=device, dtype=dtype),
        "img_ids": torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).to(device, dtype),
        "txt_ids": torch.zeros(arch.text_tokens, 3, device=device, dtype=dtype),
        "return_dict": False,
    }


# a flow-matching transformer: the timestep is sigma, in [0, 1]
timestep_at = flow_timestep


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # Chroma's pipeline pads the T5 prompt to 512 tokens, as Flux's
    Arch("chroma", FAMILY, CHROMA, 1024, 512, 4096, 0, 8, "Chroma1-HD transformer (8.9B)"),
)
