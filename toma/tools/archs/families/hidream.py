"""The bench's hidream architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "hidream"


# HiDream-I1-Full (17B): the class defaults, with the published config's 16-channel latents
# (Flux's VAE) and text widths: T5-XXL and Llama-3.1-8B (4096 each; a Llama layer's hidden
# states per block, its 32 layers, then the last one again) and pooled CLIP-L + CLIP-G (2048)
HIDREAM: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 16,
    "num_single_layers": 32,
    "attention_head_dim": 128,
    "num_attention_heads": 20,
    "caption_channels": [4096, 4096],
    "text_emb_dim": 2048,
    "num_routed_experts": 4,
    "num_activated_experts": 2,
    "axes_dims_rope": (64, 32, 32),
    "max_resolution": (128, 128),
    "llama_layers": list(range(32)) + [31] * 16,
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers", "num_single_layers")


def inputs(c: Call) -> dict[str, Any]:
    """Latents (the model patchifies them); the Llama's hidden states, layer by layer.

    See :func:`toma.tools.archs.make_inputs`.
    """
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
        "timesteps": timestep,
        "encoder_hidden_states_t5": text,
        "encoder_hidden_states_llama3": rand(
            max(arch.config["llama_layers"]) + 1, batch, arch.text_tokens, arch.config["caption_channels"][1]
        ),
        "pooled_embeds": rand(batch, arch.pooled_dim),
        "return_dict": False,
    }


def reduce(full: dict[str, Any], reduced: dict[str, Any], depth: int) -> dict[str, Any]:
    """``reduced`` (``full`` with ``depth`` times fewer blocks) with one Llama layer's
    features per block built. See :func:`toma.tools.archs.reduced_config`."""
    return {**reduced, "llama_layers": full["llama_layers"][: reduced["num_layers"] + reduced["num_single_layers"]]}


# the call's timestep argument (999 at the first step, as the default)
TIMESTEP_KEY = "timesteps"


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # the pipeline's T5 and Llama prompts, 128 tokens each
    Arch("hidream", FAMILY, HIDREAM, 1024, 128, 4096, 2048, 8, "HiDream-I1-Full transformer (17B)"),
)
