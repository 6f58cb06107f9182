"""The bench's zimage architecture: its configs, the config keys ``--depth``
divides and one denoiser call's inputs."""

from __future__ import annotations

from typing import Any

from toma.tools.archs.arch import Arch, Call, rising_timestep

# the family of this module's archs (Arch.family): a toma.adapters.FAMILIES name, or unet
FAMILY = "zimage"


# Z-Image-Turbo: the published transformer/config.json (Tongyi-MAI/Z-Image-Turbo); 6B.
# The 2 noise- and 2 context-refiner blocks are not divided by --depth (never merged)
ZIMAGE: dict[str, Any] = {
    "all_patch_size": (2,),
    "all_f_patch_size": (1,),
    "in_channels": 16,
    "dim": 3840,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "n_heads": 30,
    "n_kv_heads": 30,
    "norm_eps": 1e-05,
    "qk_norm": True,
    "cap_feat_dim": 2560,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
    "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
}

# tiny, for tests (also ComfyUI's tiny-zimage, toma.tools.bench.comfyui): Z-Image's layout at
# dim 256 (its modulation takes min(dim, 256) features: no smaller dim works), 2 heads of 128
TINY_ZIMAGE: dict[str, Any] = {
    **ZIMAGE,
    "in_channels": 4,
    "dim": 256,
    "n_layers": 2,
    "n_refiner_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 2,
    "cap_feat_dim": 32,
}

# the config keys that count blocks (what --depth divides)
DEPTH_KEYS: tuple[str, ...] = ("n_layers",)


def inputs(c: Call) -> dict[str, Any]:
    """Lists of per-sample (C, 1, H/8, W/8) latents and captions; t = 1 - sigma.

    See :func:`toma.tools.archs.make_inputs`.
    """
    import torch

    arch = c.arch
    batch = c.batch
    dtype = c.dtype
    device = c.device
    lh = c.lh
    lw = c.lw
    rand = c.rand
    channels = c.channels
    return {
        "x": [rand(channels, 1, lh, lw) for _ in range(batch)],
        "t": torch.zeros(batch, device=device, dtype=dtype),
        "cap_feats": [rand(arch.text_tokens, arch.text_dim) for _ in range(batch)],
        "return_dict": False,
    }


# the call's timestep argument: t = 1 - sigma, rising over a run
TIMESTEP_KEY = "t"
timestep_at = rising_timestep


# this family's entries of toma.tools.archs.ARCHS: the published configs, then tiny ones for tests
ARCHS: tuple[Arch, ...] = (
    # the pipeline passes each prompt's own tokens (up to 512), padded to a multiple of 32: 512 stands for one
    Arch("zimage", FAMILY, ZIMAGE, 1024, 512, 2560, 0, 8, "Z-Image-Turbo transformer (6B)"),
    Arch("tiny-zimage", FAMILY, TINY_ZIMAGE, 64, 8, 32, 0, 8, "tiny Z-Image-like transformer (tests)"),
)
