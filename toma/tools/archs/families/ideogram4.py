"""The bench's ideogram4 architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, rising_timestep

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "ideogram4"


# Ideogram 4: diffusers' class defaults, as its docs give them (the published config.json is
# not to be had here); 9.28B parameters counted
IDEOGRAM4: dict[str, Any] = {
    "in_channels": 128,
    "num_layers": 34,
    "attention_head_dim": 256,
    "num_attention_heads": 18,
    "intermediate_size": 12288,
    "adaln_dim": 512,
    "llm_features_dim": 53248,
    "rope_theta": 5_000_000,
    "mrope_section": (24, 20, 20),
}

IDEOGRAM4_PROMPT = 256  # a prompt's tokens in Ideogram 4's text slots (the rest is left padding)

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def inputs(c: Call) -> dict[str, Any]:
    """The conditional transformer's [padding; text; image], the pipeline's layout.

    See :func:`toma.tools.archs.make_inputs`.
    """
    import torch

    arch = c.arch
    batch = c.batch
    dtype = c.dtype
    device = c.device
    g = c.g
    lh = c.lh
    lw = c.lw
    rand = c.rand
    channels = c.channels
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import Ideogram4Pipeline

    th, tw, slots = lh // 2, lw // 2, arch.text_tokens
    prompt = [min(IDEOGRAM4_PROMPT, slots)] * batch
    ids, segments, indicator = Ideogram4Pipeline._prepare_ids(prompt, th, tw, slots, device)
    return {
        "hidden_states": torch.cat(
            [torch.zeros(batch, slots, channels), torch.randn(batch, th * tw, channels, generator=g)], 1
        ).to(device=device, dtype=dtype),
        "timestep": torch.zeros(batch, device=device, dtype=dtype),
        "encoder_hidden_states": rand(batch, slots + th * tw, arch.text_dim),
        "position_ids": ids,
        "segment_ids": segments,
        "indicator": indicator,
        "return_dict": False,
    }


# model time 1 - sigma (0 is noise): rises over a run
timestep_at = rising_timestep


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # the pipeline's 2048px default; its conditional transformer always takes 2048 text slots
    # (max_sequence_length), a prompt's tokens left-padded to it
    Arch("ideogram4", FAMILY, IDEOGRAM4, 2048, 2048, 53248, 0, 8, "Ideogram 4 transformer (9.3B)"),
)
