"""The bench's helios architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, latent_frames

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "helios"


# Helios: diffusers' class defaults (Wan 2.1 14B's blocks, 40 x 128, and the three history
# embedders). Three third-party ports of Helios-Distilled (FastVideo's and sglang's DiT
# configs, mlx-video's) hard-code the same values; the published config.json itself was not
# read (no hub access here)
HELIOS: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "rope_dim": (44, 42, 42),
}

# its pipeline's chunk: 9 latent frames after histories of 16 (long), 2 (mid) and 1 + 1 (short)
HELIOS_HISTORY = {"long": 16, "mid": 2, "short": 2}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def inputs(c: Call) -> dict[str, Any]:
    """A chunk after its pipeline's three histories, frame indices in order.

    See :func:`toma.tools.archs.make_inputs`.
    """
    import torch

    arch = c.arch
    batch = c.batch
    device = c.device
    frames = c.frames
    lh = c.lh
    lw = c.lw
    rand = c.rand
    text = c.text
    channels = c.channels
    timestep = c.timestep
    count, call = latent_frames(arch, frames), {}
    first = 0
    for name in ("long", "mid", "short"):
        size = HELIOS_HISTORY[name]
        call[f"latents_history_{name}"] = rand(batch, channels, size, lh, lw)
        call[f"indices_latents_history_{name}"] = torch.arange(first, first + size, device=device)[None].expand(
            batch, -1
        )
        first += size
    return {
        "hidden_states": rand(batch, channels, count, lh, lw),
        "timestep": timestep,
        "encoder_hidden_states": text,
        "indices_hidden_states": torch.arange(first, first + count, device=device)[None].expand(batch, -1),
        **call,
        "return_dict": False,
    }


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # the pipeline's 384x640 and chunks of 9 latent frames (33 frames), after its histories
    Arch("helios", FAMILY, HELIOS, 384, 512, 4096, 0, 8, "Helios transformer, a chunk", 640 / 384, 33),
)
