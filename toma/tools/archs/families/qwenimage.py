"""The bench's qwenimage architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, flow_timestep

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "qwenimage"


# Qwen-Image (20B): Qwen/Qwen-Image transformer/config.json, which matches diffusers'
# QwenImageTransformer2DModel defaults (60 blocks of width 24 x 128; text width 3584, the
# Qwen2.5-VL-7B encoder's hidden size)
QWEN_IMAGE: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 60,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "guidance_embeds": False,
    "axes_dims_rope": (16, 56, 56),
}

TINY_QWEN_IMAGE: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "axes_dims_rope": (4, 6, 6),
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def inputs(c: Call) -> dict[str, Any]:
    """Qwen-Image's call: packed latents ``(B, (R/16)^2, 64)``, text, ``img_shapes``; no text
    mask (the pipeline drops an all-ones mask). See :func:`toma.tools.archs.make_inputs`."""
    batch = c.batch
    rand = c.rand
    text = c.text
    channels = c.channels
    timestep = c.timestep
    th = c.th
    tw = c.tw
    return {
        "hidden_states": rand(batch, th * tw, channels),
        "encoder_hidden_states": text,
        "timestep": timestep / 1000,
        "img_shapes": [[(1, th, tw)]] * batch,
        "return_dict": False,
    }


# a flow-matching transformer: the timestep is sigma, in [0, 1]
timestep_at = flow_timestep


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # Qwen-Image's prompt embeddings are as long as the prompt (its pipeline trims the
    # padding); 128 tokens stands for a prompt of a few sentences.
    Arch("qwenimage", FAMILY, QWEN_IMAGE, 1024, 128, 3584, 0, 8, "Qwen-Image transformer"),
    Arch("tiny-qwenimage", FAMILY, TINY_QWEN_IMAGE, 64, 8, 32, 0, 8, "tiny Qwen-Image-like transformer (tests)"),
)
