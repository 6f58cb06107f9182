"""The bench's ltx architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, latent_frames

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "ltx"


LTX_VIDEO: dict[str, Any] = {
    "in_channels": 128,
    "out_channels": 128,
    "patch_size": 1,
    "patch_size_t": 1,
    "num_attention_heads": 32,
    "attention_head_dim": 64,
    "cross_attention_dim": 2048,
    "num_layers": 28,
    "caption_channels": 4096,
    "qk_norm": "rms_norm_across_heads",
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def inputs(c: Call) -> dict[str, Any]:
    """One denoiser call. See :func:`toma.tools.archs.make_inputs`."""
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
        "hidden_states": rand(batch, count * lh * lw, channels),
        "encoder_hidden_states": text,
        "timestep": timestep,
        "encoder_attention_mask": torch.ones(batch, arch.text_tokens, device=device, dtype=dtype),
        "num_frames": count,
        "height": lh,
        "width": lw,
        "return_dict": False,
    }


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    Arch("ltx", FAMILY, LTX_VIDEO, 512, 128, 4096, 0, 32, "LTX-Video 0.9 transformer", 768 / 512, 121, 8, 1),
)
