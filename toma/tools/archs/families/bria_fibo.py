"""The bench's bria-fibo architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "bria-fibo"


# Bria FIBO: 8 double-stream and 38 single-stream blocks at Flux's width (8.29B parameters
# built; diffusers' docs give 8B, its class defaults of 19 double blocks 12.1B), text from
# two SmolLM3-3B layers (2 x 2048) and one more per block
BRIA_FIBO: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 8,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "axes_dims_rope": (16, 56, 56),
    "text_encoder_dim": 2048,
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers", "num_single_layers")


def inputs(c: Call) -> dict[str, Any]:
    """FIBO's 16x VAE latents, one token per latent pixel. See :func:`toma.tools.archs.make_inputs`."""
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
    rows, cols = torch.meshgrid(torch.arange(lh), torch.arange(lw), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3)
    blocks = arch.config["num_layers"] + arch.config["num_single_layers"]
    width = arch.config["text_encoder_dim"]
    return {
        "hidden_states": rand(batch, lh * lw, channels),
        "encoder_hidden_states": text,
        # one text-encoder layer per block of the full model (call_denoiser passes the built model's)
        "text_encoder_layers": [rand(batch, arch.text_tokens, width) for _ in range(blocks)],
        "timestep": timestep,
        "img_ids": img_ids.float().to(device),
        "txt_ids": torch.zeros(arch.text_tokens, 3, device=device),
        "return_dict": False,
    }


def call(model: Any, inputs: dict[str, Any]) -> Any:
    """One forward with one text-encoder layer per block the model has (at ``--depth``, fewer)."""
    return model(**{**inputs, "text_encoder_layers": inputs["text_encoder_layers"][: len(model.caption_projection)]})


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # FIBO's prompt is a structured JSON caption of up to 1000+ words, as long as it is:
    # 1024 tokens stands for one
    Arch("bria-fibo", FAMILY, BRIA_FIBO, 1024, 1024, 4096, 0, 16, "Bria FIBO transformer", patch=1),
)
