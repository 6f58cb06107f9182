"""The bench's lumina2 architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, rising_timestep

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "lumina2"


# Lumina-Image 2.0 (2.6B), Alpha-VLLM/Lumina-Image-2.0's published transformer config: Gemma-2-2B
# captions (2304 wide), 16-channel latents (Flux's VAE), 24 query heads sharing 8 key heads
LUMINA2: dict[str, Any] = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "hidden_size": 2304,
    "num_layers": 26,
    "num_refiner_layers": 2,
    "num_attention_heads": 24,
    "num_kv_heads": 8,
    "multiple_of": 256,
    "norm_eps": 1e-05,
    "axes_dim_rope": (32, 32, 32),
    "axes_lens": (300, 512, 512),
    "cap_feat_dim": 2304,
}

# the config keys that count blocks (what --depth divides); its 2 + 2 refiner blocks run
# on the caption or the image alone
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def inputs(c: Call) -> dict[str, Any]:
    """One prompt per call (CFG's passes apart): every caption its full length.

    See :func:`toma.tools.archs.make_inputs`.
    """
    import torch

    arch = c.arch
    batch = c.batch
    dtype = c.dtype
    device = c.device
    lh = c.lh
    lw = c.lw
    rand = c.rand
    text = c.text
    channels = c.channels
    return {
        "hidden_states": rand(batch, channels, lh, lw),
        "timestep": torch.zeros(batch, device=device, dtype=dtype),
        "encoder_hidden_states": text,
        "encoder_attention_mask": torch.ones(batch, arch.text_tokens, dtype=torch.bool, device=device),
        "return_dict": False,
    }


# model time 1 - sigma (0 is noise): rises over a run
timestep_at = rising_timestep


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    Arch("lumina2", FAMILY, LUMINA2, 1024, 256, 2304, 0, 8, "Lumina-Image 2.0 transformer (2.6B)"),
)
