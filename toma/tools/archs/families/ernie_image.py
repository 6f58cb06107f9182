"""The bench's ernie-image architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "ernie-image"


# ERNIE-Image (8B; Turbo has the same transformer): baidu's transformer/config.json (diffusers'
# class defaults describe a smaller model: hidden 3072, 24 layers)
ERNIE_IMAGE: dict[str, Any] = {
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_layers": 36,
    "ffn_hidden_size": 12288,
    "in_channels": 128,
    "out_channels": 128,
    "patch_size": 1,
    "text_in_dim": 3072,
    "rope_theta": 256,
    "rope_axes_dim": (32, 48, 48),
    "eps": 1e-06,
    "qk_layernorm": True,
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def inputs(c: Call) -> dict[str, Any]:
    """ERNIE-Image's call: latents ``(B, 128, R/16, R/16)``, one token per 16x latent pixel,
    text ``text_bth`` with its ``text_lens`` (every prompt its full length).
    See :func:`toma.tools.archs.make_inputs`."""
    import torch

    arch = c.arch
    batch = c.batch
    device = c.device
    lh = c.lh
    lw = c.lw
    rand = c.rand
    text = c.text
    channels = c.channels
    timestep = c.timestep
    return {
        "hidden_states": rand(batch, channels, lh, lw),
        "timestep": timestep,
        "text_bth": text,
        "text_lens": torch.full((batch,), arch.text_tokens, device=device, dtype=torch.long),
        "return_dict": False,
    }


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # 1024px: the pipeline's 16x latents (the VAE's 8x, patchified 2x2 by the pipeline), one
    # token each; its Mistral3 prompt embeddings are as long as the prompt (padded to the
    # longest of a CFG batch): 128 stands for one of a few sentences
    Arch("ernie-image", FAMILY, ERNIE_IMAGE, 1024, 128, 3072, 0, 16, "ERNIE-Image transformer (8B)", patch=1),
)
