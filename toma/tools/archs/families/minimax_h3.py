"""The bench's minimax-h3 architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toma.tools.archs.arch import Arch, Call, flow_timestep

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "minimax-h3"

if TYPE_CHECKING:
    import torch


# MiniMax H3 (33B, t2va/fl2va partition): diffusers' class defaults, which its docstring gives
# as the released checkpoint's (transformer_minimax_h3.py; 33.1B parameters counted). The 2
# text-refiner blocks are not divided by --depth (never merged)
MINIMAX_H3: dict[str, Any] = {
    "num_attention_heads": 56,
    "attention_head_dim": 128,
    "hidden_size": 5376,
    "num_layers": 50,
    "num_refiner_layers": 2,
    "ffn_dim": 14336,
    "in_channels": 24,
    "audio_in_channels": 32,
    "patch_size": (1, 2, 2),
    "text_dim": 5120,
    "freq_dim": 256,
    "time_embed_hidden_dim": 5376,
    "time_embed_dim": 2688,
    "rope_freq_dim": 16,
    "rope_theta": 10000.0,
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers",)


def minimax_h3_inputs(
    arch: Arch, rand: Any, batch: int, lh: int, lw: int, frames: int | None, device: torch.device | str
) -> dict[str, Any]:
    """A MiniMax H3 call as its modular pipeline makes it for text-to-video+audio: the packed
    layout of its ``build_packed_sequence`` (text rows, the stereo soundtrack's rows, then the
    video's), every row at one timestep."""
    import torch
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames

    pixels = arch.frames if frames is None else frames
    count, text = count_latent_frames(arch, frames), arch.text_tokens
    ids, tags, video, audio, text_rows, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.ones(text, dtype=torch.long), count, lh, lw, audio_latent_num_frames(pixels), (1, 2, 2), 2, 2, 0
    )
    config = arch.config
    return {
        "hidden_states": rand(batch, video.numel(), config["in_channels"] * 4),
        "audio_hidden_states": rand(batch, audio.numel(), config["audio_in_channels"]),
        "encoder_hidden_states": rand(batch, text, arch.text_dim),
        "timestep": torch.ones(1, device=device),
        "timestep_indices": torch.zeros(ids.shape[0], dtype=torch.long, device=device),
        "token_tags": tags.to(device),
        "position_ids": ids.float().to(device),
        "video_indices": video.to(device),
        "audio_indices": audio.to(device),
        "text_indices": text_rows.to(device),
        "return_dict": False,
    }


def inputs(c: Call) -> dict[str, Any]:
    """The modular pipeline's t2va layout: [text; audio; video], all at one level.

    See :func:`toma.tools.archs.make_inputs`.
    """
    arch = c.arch
    batch = c.batch
    device = c.device
    frames = c.frames
    lh = c.lh
    lw = c.lw
    rand = c.rand
    return minimax_h3_inputs(arch, rand, batch, lh, lw, frames, device)


# a flow-matching transformer: the timestep is sigma, in [0, 1]
timestep_at = flow_timestep


def count_latent_frames(arch: Arch, frames: int | None = None) -> int:
    """Latent frames for ``frames`` pixel frames (the arch's if None): the video VAE encodes
    chunks of 17 frames to 5 latents. See :func:`toma.tools.archs.arch.latent_frames`."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import video_latent_num_frames

    frames = arch.frames if frames is None else frames
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 5 or frames % 17 != 5:
        raise ValueError(f"frames must be 17k + 5 (MiniMax H3's video VAE chunks); got {frames!r}")
    return video_latent_num_frames(frames, 17, 5)


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # the modular pipeline's default canvas (768x1344, 16x VAE) and shortest clip (5 s at 24 fps:
    # 124 frames, 37 latent frames); the prompt is as long as it is (no padding): 256 tokens
    # stand for one
    Arch(
        "minimax-h3",
        FAMILY,
        MINIMAX_H3,
        768,
        256,
        5120,
        0,
        16,
        "MiniMax H3 transformer (33B, video + audio)",
        1344 / 768,
        124,
    ),
)
