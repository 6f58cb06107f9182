"""The bench's cosmos architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, flow_timestep

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "cosmos"


# Cosmos-Predict2 2B Text2Image (diffusers' scripts/convert_cosmos_to_diffusers.py), without
# the padding-mask input channel: diffusers resizes that mask with torchvision, which this
# project does not install (one input channel of 16; the blocks are the same)
COSMOS_PREDICT2_2B: dict[str, Any] = {
    "in_channels": 16,
    "out_channels": 16,
    "num_attention_heads": 16,
    "attention_head_dim": 128,
    "num_layers": 28,
    "mlp_ratio": 4.0,
    "text_embed_dim": 1024,
    "adaln_lora_dim": 256,
    "max_size": (128, 240, 240),
    "patch_size": (1, 2, 2),
    "rope_scale": (1.0, 4.0, 4.0),
    "concat_padding_mask": False,
    "extra_pos_embed_type": None,
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def inputs(c: Call) -> dict[str, Any]:
    """One latent frame: the text-to-image pipeline's call. See :func:`toma.tools.archs.make_inputs`."""
    import torch

    batch = c.batch
    dtype = c.dtype
    device = c.device
    lh = c.lh
    lw = c.lw
    rand = c.rand
    text = c.text
    channels = c.channels
    return {
        "hidden_states": rand(batch, channels, 1, lh, lw),
        "timestep": torch.full((batch,), 0.5, device=device, dtype=dtype),
        "encoder_hidden_states": text,
        "return_dict": False,
    }


# a flow-matching transformer: the timestep is sigma, in [0, 1]
timestep_at = flow_timestep


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # the pipeline's 768x1360 image (Wan's 8x VAE) and T5 prompt of 512
    Arch("cosmos", FAMILY, COSMOS_PREDICT2_2B, 768, 512, 1024, 0, 8, "Cosmos-Predict2 2B text-to-image", 1360 / 768),
)
