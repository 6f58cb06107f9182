"""The bench's hunyuanvideo15 architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, latent_frames

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "hunyuanvideo15"


# HunyuanVideo 1.5 (8.3B, 480p): the class defaults; 32-channel latents of a 16x VAE (4x in
# time) with the image-to-video condition and mask channels (65 in)
HUNYUAN_VIDEO15: dict[str, Any] = {
    "in_channels": 65,
    "out_channels": 32,
    "num_attention_heads": 16,
    "attention_head_dim": 128,
    "num_layers": 54,
    "num_refiner_layers": 2,
    "mlp_ratio": 4.0,
    "patch_size": 1,
    "patch_size_t": 1,
    "text_embed_dim": 3584,
    "text_embed_2_dim": 1472,
    "image_embed_dim": 1152,
    "rope_theta": 256.0,
    "rope_axes_dim": (16, 56, 56),
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def inputs(c: Call) -> dict[str, Any]:
    """Text to video: the condition channels and image embedding zero. See :func:`toma.tools.archs.make_inputs`."""
    import torch

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
    latents = torch.cat(
        [
            rand(batch, 32, count, lh, lw),
            torch.zeros(batch, channels - 32, count, lh, lw, device=device, dtype=dtype),
        ],
        dim=1,
    )
    ones = torch.ones(batch, arch.text_tokens, device=device, dtype=dtype)
    return {
        "hidden_states": latents,
        "timestep": timestep,
        "encoder_hidden_states": text,
        "encoder_attention_mask": ones,
        "encoder_hidden_states_2": rand(batch, 256, arch.config["text_embed_2_dim"]),
        "encoder_attention_mask_2": torch.ones(batch, 256, device=device, dtype=dtype),
        "image_embeds": torch.zeros(batch, 729, arch.config["image_embed_dim"], device=device, dtype=dtype),
        "return_dict": False,
    }


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # 480p (848x480, the pipeline's 16:9), 16x VAE, 1000 MLLM + 256 ByT5 prompt tokens as padded
    # by the pipeline, text to video (its image embedding of zeros)
    Arch(
        "hunyuanvideo15",
        FAMILY,
        HUNYUAN_VIDEO15,
        480,
        1000,
        3584,
        0,
        16,
        "HunyuanVideo 1.5 480p transformer (8.3B)",
        848 / 480,
        121,
        patch=1,
    ),
)
