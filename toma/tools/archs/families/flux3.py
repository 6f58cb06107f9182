"""The bench's flux3 architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, flow_timestep

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "flux3"


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

# the config keys that count blocks (what --depth divides); the image's own blocks (each mode has as many)
DEPTH_KEYS: tuple[str, ...] = ("num_layers", "num_single_layers")


def inputs(c: Call) -> dict[str, Any]:
    """One set of (t, h, w, l) ids for the batch. See :func:`toma.tools.archs.make_inputs`."""
    import torch

    arch = c.arch
    batch = c.batch
    device = c.device
    rand = c.rand
    text = c.text
    channels = c.channels
    timestep = c.timestep
    th = c.th
    tw = c.tw
    one = torch.arange(1, device=device)
    return {
        "hidden_states": rand(batch, th * tw, channels),
        "encoder_hidden_states": text,
        "timestep": timestep / 1000,
        "img_ids": torch.cartesian_prod(one, torch.arange(th, device=device), torch.arange(tw, device=device), one),
        "txt_ids": torch.cartesian_prod(one, one, one, torch.arange(arch.text_tokens, device=device)),
        "return_dict": False,
    }


# a flow-matching transformer: the timestep is sigma, in [0, 1]
timestep_at = flow_timestep


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (Arch("flux3", FAMILY, FLUX3, 1024, 512, 20480, 0, 8, "FLUX.3 transformer"),)
