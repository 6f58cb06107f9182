"""The bench's qwenimage21 architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, flow_timestep

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "qwenimage21"


# Qwen-Image 2.1: diffusers' QwenImage21Transformer2DModel defaults (32 single-stream blocks
# of 32 x 128, text width 4096, 2x2-packed latents of 64 channels), which its pipeline's
# docs describe and which third-party loaders check as the published transformer config;
# the config.json itself was not read (no hub access here)
QWEN_IMAGE_21: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": 64,
    "num_layers": 32,
    "attention_head_dim": 128,
    "num_attention_heads": 32,
    "context_in_dim": 4096,
    "mlp_ratio": 3,
    "axes_dims_rope": (16, 56, 56),
    "causal_condition": True,
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def inputs(c: Call) -> dict[str, Any]:
    """A cached step: the prompt's keys and values from the prefill. See :func:`toma.tools.archs.make_inputs`."""
    import torch

    arch = c.arch
    batch = c.batch
    device = c.device
    rand = c.rand
    text = c.text
    channels = c.channels
    timestep = c.timestep
    th = c.th
    tw = c.tw
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    cfg = arch.config
    cache = QwenImage21KVCache(cfg["num_layers"])  # as many as the full model: --depth builds fewer
    heads, width = cfg["num_attention_heads"], cfg["attention_head_dim"]
    for layer in cache.layer_caches:
        layer.store(rand(batch, arch.text_tokens, heads, width), rand(batch, arch.text_tokens, heads, width))
    slots = torch.ones(batch, arch.text_tokens + th * tw // 4, dtype=torch.bool, device=device)
    slots[:, : arch.text_tokens] = False  # the encoder's text, then the target's slots of 2x2 tokens
    return {
        "hidden_states": rand(batch, th * tw, channels),
        "encoder_hidden_states": text,
        "timestep": timestep / 1000,
        "img_shapes": [[(1, th, tw)]] * batch,
        "img_mask": slots,
        "kv_cache": cache,
        "kv_cache_mode": "cached",
        "return_dict": False,
    }


# a flow-matching transformer: the timestep is sigma, in [0, 1]
timestep_at = flow_timestep


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # a step after the first: the target's tokens, decoding from a cache of a 128-token prompt
    Arch("qwenimage21", FAMILY, QWEN_IMAGE_21, 1024, 128, 4096, 0, 8, "Qwen-Image 2.1 transformer, a cached step"),
)
