"""The bench's flux2 architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, flow_timestep

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "flux2"


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

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers", "num_single_layers")


def inputs(c: Call) -> dict[str, Any]:
    """FLUX.2's call: packed latents ``(B, (R/16)^2, 128)``, text ``(B, 512, 15360)``,
    4-column ``img_ids``, ``txt_ids``. See :func:`toma.tools.archs.make_inputs`."""
    import torch

    arch = c.arch
    batch = c.batch
    dtype = c.dtype
    device = c.device
    rand = c.rand
    text = c.text
    channels = c.channels
    timestep = c.timestep
    th = c.th
    tw = c.tw
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


# a flow-matching transformer: the timestep is sigma, in [0, 1]
timestep_at = flow_timestep


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # the pipeline pads the prompt to 512 tokens
    Arch("flux2", FAMILY, FLUX2_DEV, 1024, 512, 15360, 0, 8, "FLUX.2-dev transformer"),
    Arch("tiny-flux2", FAMILY, TINY_FLUX2, 64, 8, 32, 0, 8, "tiny FLUX.2-like transformer (tests)"),
)
