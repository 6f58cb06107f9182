"""The bench's kandinsky5 architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, latent_frames

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "kandinsky5"


# Kandinsky 5.0 T2V Lite (2B), its 5 s SFT checkpoint: kandinskylab's configs/config_5s_sft.yaml
# (dit_params; diffusers' class defaults otherwise). The 10 s checkpoints add NABLA attention,
# which ToMA runs unmerged
KANDINSKY5_LITE: dict[str, Any] = {
    "in_visual_dim": 16,
    "out_visual_dim": 16,
    "time_dim": 512,
    "patch_size": (1, 2, 2),
    "model_dim": 1792,
    "ff_dim": 7168,
    "num_text_blocks": 2,
    "num_visual_blocks": 32,
    "axes_dims": (16, 24, 24),
    "visual_cond": True,
    "in_text_dim": 3584,
    "in_text_dim2": 768,
}

# the config keys that count blocks (what --depth divides); its 2 text blocks run on the text alone
DEPTH_KEYS: tuple[str, ...] = ("num_visual_blocks",)


def inputs(c: Call) -> dict[str, Any]:
    """Kandinsky 5's call: channel-last latents ``(B, F', H/8, W/8, C)`` (with visual_cond:
    + conditioning + its mask), text, pooled, rotary positions. See :func:`toma.tools.archs.make_inputs`."""
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
    count, cfg = latent_frames(arch, frames), arch.config
    channels = cfg["in_visual_dim"] * (2 if cfg.get("visual_cond") else 1) + bool(cfg.get("visual_cond"))
    return {
        "hidden_states": rand(batch, count, lh, lw, channels),
        "encoder_hidden_states": text,
        "pooled_projections": rand(batch, arch.pooled_dim),
        "timestep": torch.full((batch,), 999.0, device=device, dtype=dtype),
        "visual_rope_pos": [torch.arange(n, device=device) for n in (count, lh // 2, lw // 2)],
        "text_rope_pos": torch.arange(arch.text_tokens, device=device),
        "scale_factor": (1, 2, 2),  # the pipeline's at 480-854 pixels a side
        "return_dict": False,
    }


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # the T2V pipeline's 512x768 x 121 frames; its Qwen2.5-VL prompt embeddings are as long as
    # the longest prompt (up to 256 tokens): 128 stands for one of a few sentences
    Arch(
        "kandinsky5",
        FAMILY,
        KANDINSKY5_LITE,
        512,
        128,
        3584,
        768,
        8,
        "Kandinsky 5.0 T2V Lite transformer (2B)",
        768 / 512,
        121,
    ),
)
