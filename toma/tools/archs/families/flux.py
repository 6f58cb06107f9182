"""The bench's flux architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, flow_timestep

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "flux"


FLUX_DEV: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}

TINY_FLUX: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 16,
    "guidance_embeds": True,
    "axes_dims_rope": (4, 6, 6),
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("num_layers", "num_single_layers")


def inputs(c: Call) -> dict[str, Any]:
    """Flux.1's call: packed latents ``hidden_states (B, (R/16)^2, 64)``, text ``(B, 512, 4096)``,
    ``pooled_projections (B, 768)``, ``img_ids``, ``txt_ids``, ``guidance``; Kontext's
    references (frames 1, 2, ...) follow the image's tokens.

    See :func:`toma.tools.archs.make_inputs`.
    """
    import torch

    arch = c.arch
    batch = c.batch
    dtype = c.dtype
    device = c.device
    rand = c.rand
    text = c.text
    channels = c.channels
    th = c.th
    tw = c.tw
    ids = torch.zeros(1 + arch.references, th, tw, 3)
    ids[..., 0] = torch.arange(1 + arch.references)[:, None, None]  # Kontext: references are frames 1, 2, ...
    ids[..., 1] = torch.arange(th)[:, None]
    ids[..., 2] = torch.arange(tw)[None, :]
    return {
        "hidden_states": rand(batch, (1 + arch.references) * th * tw, channels),
        "encoder_hidden_states": text,
        "pooled_projections": rand(batch, arch.pooled_dim),
        "timestep": torch.full((batch,), 1.0, device=device, dtype=dtype),
        "img_ids": ids.reshape(-1, 3).to(device=device, dtype=dtype),
        "txt_ids": torch.zeros(arch.text_tokens, 3, device=device, dtype=dtype),
        "guidance": torch.full((batch,), 3.5, device=device, dtype=dtype),
        "return_dict": False,
    }


# a flow-matching transformer: the timestep is sigma, in [0, 1]
timestep_at = flow_timestep


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    Arch("flux", FAMILY, FLUX_DEV, 1024, 512, 4096, 768, 8, "Flux.1-dev transformer"),
    Arch(
        "flux-kontext",
        FAMILY,
        FLUX_DEV,
        1024,
        512,
        4096,
        768,
        8,
        "Flux.1 Kontext transformer, editing one reference image",
        references=1,
    ),
    Arch("tiny-flux", FAMILY, TINY_FLUX, 128, 8, 32, 16, 8, "tiny Flux-like transformer (tests)"),
    Arch(
        "tiny-flux-kontext",
        FAMILY,
        TINY_FLUX,
        128,
        8,
        32,
        16,
        8,
        "tiny Flux-like transformer with a reference image (tests)",
        references=1,
    ),
)
