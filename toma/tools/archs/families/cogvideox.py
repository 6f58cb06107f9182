"""The bench's cogvideox architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toma.tools.archs.arch import Arch, Call, latent_frames

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "cogvideox"

if TYPE_CHECKING:
    import torch


# CogVideoX-5B: the class defaults with 42 layers, 48 heads and rotary positions
# (diffusers' scripts/convert_cogvideox_to_diffusers.py: "For 5B, it is 42 / 48 / True")
COGVIDEOX_5B: dict[str, Any] = {
    "num_attention_heads": 48,
    "attention_head_dim": 64,
    "in_channels": 16,
    "out_channels": 16,
    "time_embed_dim": 512,
    "text_embed_dim": 4096,
    "num_layers": 42,
    "sample_width": 90,
    "sample_height": 60,
    "sample_frames": 49,
    "patch_size": 2,
    "temporal_compression_ratio": 4,
    "max_text_seq_length": 226,
    "use_rotary_positional_embeddings": True,
}

TINY_COGVIDEOX: dict[str, Any] = {
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "in_channels": 4,
    "out_channels": 4,
    "time_embed_dim": 8,
    "text_embed_dim": 32,
    "num_layers": 2,
    "sample_width": 8,
    "sample_height": 8,
    "sample_frames": 5,
    "patch_size": 2,
    "max_text_seq_length": 8,
    "use_rotary_positional_embeddings": True,
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def cogvideox_rotary(
    config: dict[str, Any],
    frames: int,
    lh: int,
    lw: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(frames * h * w, head_dim)`` cos and sin tables CogVideoXPipeline passes for a
    ``frames x lh x lw`` latent video (CogVideoX 1.0's crop-to-base-grid positions), in
    ``dtype`` (None: float32)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    p = config["patch_size"]
    h, w = lh // p, lw // p
    crops = get_resize_crop_region_for_grid((h, w), config["sample_width"] // p, config["sample_height"] // p)
    cos, sin = get_3d_rotary_pos_embed(config["attention_head_dim"], crops, (h, w), frames, device=device)
    return cos.to(dtype), sin.to(dtype)


def inputs(c: Call) -> dict[str, Any]:
    """CogVideoX's call: latents ``(B, F', 16, H/8, W/8)``, text, the pipeline's rotary tables.
    See :func:`toma.tools.archs.make_inputs`."""
    arch = c.arch
    batch = c.batch
    dtype = c.dtype
    device = c.device
    frames = c.frames
    lh = c.lh
    lw = c.lw
    rand = c.rand
    text = c.text
    channels = c.channels
    timestep = c.timestep
    count = latent_frames(arch, frames)
    return {
        "hidden_states": rand(batch, count, channels, lh, lw),
        "encoder_hidden_states": text,
        "timestep": timestep,
        "image_rotary_emb": cogvideox_rotary(arch.config, count, lh, lw, device, dtype),
        "return_dict": False,
    }


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    Arch("cogvideox", FAMILY, COGVIDEOX_5B, 480, 226, 4096, 0, 8, "CogVideoX-5B transformer", 720 / 480, 49),
    Arch(
        "tiny-cogvideox",
        FAMILY,
        TINY_COGVIDEOX,
        64,
        8,
        32,
        0,
        8,
        "tiny CogVideoX-like transformer (tests)",
        1.0,
        5,
    ),
)
