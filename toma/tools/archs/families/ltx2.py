"""The bench's ltx2 architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, latent_frames

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "ltx2"


# LTX-2 (19B, Lightricks/LTX-2): diffusers 0.42.1's LTX2VideoTransformer3DModel defaults are
# the published model (18.9B parameters built from them; its pipelines' docs load
# Lightricks/LTX-2 into it): video 32 heads of 128, audio 32 heads of 64, 48 blocks, prompt
# embeddings of Gemma 3 12B's width (3840). The audio fields set the audio token count
# (make_inputs: 25 latents a second at 16 kHz, hop 160, 4x)
LTX2_VIDEO: dict[str, Any] = {
    "in_channels": 128,
    "out_channels": 128,
    "patch_size": 1,
    "patch_size_t": 1,
    "num_attention_heads": 32,
    "attention_head_dim": 128,
    "cross_attention_dim": 4096,
    "audio_in_channels": 128,
    "audio_out_channels": 128,
    "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64,
    "audio_cross_attention_dim": 2048,
    "audio_scale_factor": 4,
    "audio_sampling_rate": 16000,
    "audio_hop_length": 160,
    "num_layers": 48,
    "caption_channels": 3840,
    "rope_type": "interleaved",
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def inputs(c: Call) -> dict[str, Any]:
    """Video and audio latents, each stream with its prompt. See :func:`toma.tools.archs.make_inputs`."""
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
    audio = audio_frames(arch, frames)
    mask = torch.ones(batch, arch.text_tokens, device=device, dtype=dtype)
    return {
        "hidden_states": rand(batch, count * lh * lw, channels),
        "audio_hidden_states": rand(batch, audio, arch.config["audio_in_channels"]),
        "encoder_hidden_states": text,
        "audio_encoder_hidden_states": rand(batch, arch.text_tokens, arch.text_dim),
        "timestep": timestep,
        "encoder_attention_mask": mask,
        "audio_encoder_attention_mask": mask,
        "num_frames": count,
        "height": lh,
        "width": lw,
        "audio_num_frames": audio,
        "return_dict": False,
    }


def audio_frames(arch: Arch, frames: int | None = None, fps: float = 24.0) -> int:
    """Audio latents LTX2Pipeline makes for ``frames`` pixel frames (the arch's default if None)
    at ``fps``: the clip's seconds times the audio VAE's latents a second."""
    frames = arch.frames if frames is None else frames
    config = arch.config
    per_second = config["audio_sampling_rate"] / config["audio_hop_length"] / config["audio_scale_factor"]
    return max(1, round(frames / fps * per_second))


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # LTX2Pipeline's defaults: 768x512, 121 frames at 24 fps, prompts padded to 1024 tokens
    Arch(
        "ltx2",
        FAMILY,
        LTX2_VIDEO,
        512,
        1024,
        3840,
        0,
        32,
        "LTX-2 19B transformer (video + audio)",
        768 / 512,
        121,
        8,
        1,
    ),
)
