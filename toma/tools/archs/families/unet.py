"""The bench's unet architecture: its configs and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "unet"


# Published configs (only the fields that differ from diffusers' defaults
# or that define the architecture).
SDXL_UNET: dict[str, Any] = {
    "sample_size": 128,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    "block_out_channels": (320, 640, 1280),
    "layers_per_block": 2,
    "transformer_layers_per_block": (1, 2, 10),
    "attention_head_dim": (5, 10, 20),
    "cross_attention_dim": 2048,
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,
    "norm_num_groups": 32,
}

SD15_UNET: dict[str, Any] = {
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    "block_out_channels": (320, 640, 1280, 1280),
    "layers_per_block": 2,
    "attention_head_dim": 8,
    "cross_attention_dim": 768,
    "norm_num_groups": 32,
}

# Small stand-ins with the same structure, for tests.
TINY_UNET: dict[str, Any] = {
    "sample_size": 16,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
    "block_out_channels": (32, 64),
    "layers_per_block": 1,
    "attention_head_dim": 8,
    "cross_attention_dim": 32,
    "norm_num_groups": 8,
}


def inputs(c: Call) -> dict[str, Any]:
    """The UNet's call: ``sample (B, 4, R/8, R/8)``, ``encoder_hidden_states (B, L, text_dim)``,
    plus SDXL's ``added_cond_kwargs``. See :func:`toma.tools.archs.make_inputs`."""
    import torch

    arch = c.arch
    batch = c.batch
    dtype = c.dtype
    device = c.device
    height = c.height
    width = c.width
    lh = c.lh
    lw = c.lw
    rand = c.rand
    text = c.text
    channels = c.channels
    inputs: dict[str, Any] = {
        "sample": rand(batch, channels, lh, lw),
        "timestep": torch.tensor(999.0, device=device),
        "encoder_hidden_states": text,
    }
    if arch.config.get("addition_embed_type") == "text_time":
        size = [float(height), float(width), 0.0, 0.0, float(height), float(width)]
        inputs["added_cond_kwargs"] = {
            "text_embeds": rand(batch, arch.pooled_dim),
            "time_ids": torch.tensor([size] * batch, device=device, dtype=dtype),
        }
    return inputs


# diffusers' class and the weights' subfolder: the UNets have no transformer spec to name them
DENOISER_CLASS = "UNet2DConditionModel"
WEIGHTS_SUBFOLDER = "unet"


def call(model: Any, inputs: dict[str, Any]) -> Any:
    """One forward with ``sample`` and ``timestep`` positional, as diffusers pipelines pass
    them (tomesd's hook reads the latent size from the first positional argument)."""
    rest = {k: v for k, v in inputs.items() if k not in ("sample", "timestep")}
    return model(inputs["sample"], inputs["timestep"], return_dict=False, **rest)


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    Arch("sdxl", FAMILY, SDXL_UNET, 1024, 77, 2048, 1280, 8, "SDXL-base UNet", patch=1),
    Arch("sd15", FAMILY, SD15_UNET, 512, 77, 768, 0, 8, "Stable Diffusion 1.5 UNet", patch=1),
    Arch("tiny-unet", FAMILY, TINY_UNET, 128, 8, 32, 0, 8, "tiny SD-like UNet (tests)", patch=1),
)
