"""The bench's pixart architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "pixart"


PIXART_SIGMA: dict[str, Any] = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 4,
    "out_channels": 8,
    "num_layers": 28,
    "attention_head_dim": 72,
    "num_attention_heads": 16,
    "cross_attention_dim": 1152,
    "caption_channels": 4096,
    "attention_bias": True,
    "activation_fn": "gelu-approximate",
    "num_embeds_ada_norm": 1000,
    "norm_type": "ada_norm_single",
    "norm_elementwise_affine": False,
    "norm_eps": 1e-6,
    "interpolation_scale": 2,
    "use_additional_conditions": False,
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def inputs(c: Call) -> dict[str, Any]:
    """One denoiser call. See :func:`toma.tools.archs.make_inputs`."""
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
        "timestep": timestep,
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
        "return_dict": False,
    }


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    Arch("pixart", FAMILY, PIXART_SIGMA, 1024, 300, 4096, 0, 8, "PixArt-Sigma XL 1024 transformer"),
)
