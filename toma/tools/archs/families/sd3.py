"""The bench's sd3 architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "sd3"


SD35_MEDIUM: dict[str, Any] = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 384,
    "qk_norm": "rms_norm",
    "dual_attention_layers": tuple(range(13)),
}

TINY_SD3: dict[str, Any] = {
    "sample_size": 16,
    "patch_size": 2,
    "in_channels": 4,
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "caption_projection_dim": 16,
    "pooled_projection_dim": 16,
    "pos_embed_max_size": 32,
    "dual_attention_layers": (0,),
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def inputs(c: Call) -> dict[str, Any]:
    """SD3's call: latents ``(B, 16, R/8, R/8)``, text, pooled. See :func:`toma.tools.archs.make_inputs`."""
    arch = c.arch
    batch = c.batch
    lh = c.lh
    lw = c.lw
    rand = c.rand
    text = c.text
    channels = c.channels
    timestep = c.timestep
    return {
        "hidden_states": rand(batch, channels, lh, lw),
        "encoder_hidden_states": text,
        "pooled_projections": rand(batch, arch.pooled_dim),
        "timestep": timestep,
        "return_dict": False,
    }


def reduce(full: dict[str, Any], reduced: dict[str, Any], depth: int) -> dict[str, Any]:
    """``reduced`` (``full`` with ``depth`` times fewer blocks) with SD3.5's image-only second
    attention on the same share of the first blocks. See :func:`toma.tools.archs.reduced_config`."""
    if not full.get("dual_attention_layers"):
        return reduced
    dual = round(len(full["dual_attention_layers"]) / depth)
    return {**reduced, "dual_attention_layers": tuple(range(min(dual, reduced["num_layers"])))}


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    Arch("sd35", FAMILY, SD35_MEDIUM, 1024, 333, 4096, 2048, 8, "SD3.5-Medium transformer"),
    Arch("tiny-sd3", FAMILY, TINY_SD3, 128, 8, 32, 16, 8, "tiny SD3-like transformer (tests)"),
)
