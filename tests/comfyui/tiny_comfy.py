"""Tiny ComfyUI models (Flux, SD-style UNets) with seeded weights, and a sampling helper
through ComfyUI's own sampler (``comfy.sample.sample``)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import tempfile
import types
from pathlib import Path
from unittest import mock

import torch

from toma.tools.bench.comfyui import seed_weights  # the bench builds its ComfyUI models with it too


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stand-ins for torchvision and torchaudio and their submodules (no build of either
    imports beside this torch): modules whose every attribute is a mock."""

    PACKAGES = ("torchvision", "torchaudio")

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.PACKAGES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__spec__ = spec
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


STUBS = _Stubs()
STUBS.wanted = False  # set where ComfyUI is imported without torchvision or torchaudio
_stub_modules: dict = {}
_root: list[str] = []  # the ComfyUI folder put on sys.path, once imported


def stubs_on() -> None:
    """Put the stand-ins (and the stub modules ComfyUI already holds) back, where wanted,
    and ComfyUI's folder first on sys.path (its top-level modules import lazily)."""
    for root in _root:
        if root not in sys.path:
            sys.path.insert(0, root)
    if STUBS.wanted and STUBS not in sys.meta_path:
        sys.meta_path.append(STUBS)
        sys.modules.update(_stub_modules)


def stubs_off() -> None:
    """Take the stand-ins and ComfyUI's folder away, so that code run later (other tests)
    finds no torchvision and none of ComfyUI's top-level names (``utils``, ``app``, ...), as
    without ComfyUI; the modules ComfyUI imported keep their references."""
    for root in _root:
        while root in sys.path:
            sys.path.remove(root)
    if STUBS in sys.meta_path:
        sys.meta_path.remove(STUBS)
        for name, module in list(sys.modules.items()):
            if getattr(getattr(module, "__spec__", None), "loader", None) is STUBS:
                _stub_modules[name] = sys.modules.pop(name)


def import_comfyui(root: Path, base: Path) -> types.SimpleNamespace:
    """Import the ComfyUI at ``root`` as SOURCE.md says, its writable folders under ``base``."""
    if not STUBS.wanted and any(importlib.util.find_spec(name) is None for name in _Stubs.PACKAGES):
        STUBS.wanted = True
    if str(root) not in _root:
        _root.append(str(root))
    stubs_on()
    import comfy.cli_args

    args = comfy.cli_args.args
    args.cpu = True
    # torch's SDPA rather than sub-quadratic attention, as on a GPU
    args.use_pytorch_cross_attention = True
    args.base_directory = str(base)
    import comfy.model_management  # noqa: F401
    import comfy.model_patcher
    import comfy.patcher_extension
    import comfy.sample
    import comfy.samplers
    import folder_paths
    import nodes

    base.mkdir(parents=True, exist_ok=True)  # a caller's fresh tmp_path / "base" does not exist yet
    for setter in ("set_output_directory", "set_temp_directory", "set_input_directory", "set_user_directory"):
        getattr(folder_paths, setter)(tempfile.mkdtemp(dir=base))
    return types.SimpleNamespace(
        comfy=comfy, nodes=nodes, folder_paths=folder_paths, root=root, model_patcher=comfy.model_patcher
    )


FLUX_CONTEXT = 32
FLUX_VEC = 16
UNET_CONTEXT = 32


def _flux_config(double: int, single: int, **overrides) -> dict:
    """The tiny Flux's ``unet_config`` (hidden 64, 2 heads, 4 latent channels), ``overrides`` on it."""
    return {
        "image_model": "flux",
        "in_channels": 4,
        "out_channels": 4,
        "vec_in_dim": FLUX_VEC,
        "context_in_dim": FLUX_CONTEXT,
        "hidden_size": 64,
        "mlp_ratio": 2.0,
        "num_heads": 2,
        "depth": double,
        "depth_single_blocks": single,
        "axes_dim": [8, 12, 12],
        "theta": 10000,
        "patch_size": 2,
        "qkv_bias": True,
        "guidance_embed": False,
        "txt_ids_dims": [],
        **overrides,
    }


def flux_patcher(comfy, double: int = 2, single: int = 2, seed: int = 0, weight_dtype=None, **overrides):
    """A ModelPatcher around a tiny ``comfy.model_base.Flux`` (hidden 64, 2 heads); ``overrides``
    change its config (``global_modulation=True, vec_in_dim=None``: Flux.2's layout).
    ``weight_dtype`` (``torch.float8_e4m3fn``: an fp8 checkpoint) stores the weights in that
    dtype, computed in float32 through ComfyUI's ``manual_cast`` layers, as ComfyUI loads one."""
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models

    config = comfy.supported_models.FluxSchnell(_flux_config(double, single, **overrides))
    config.latent_format = comfy.latent_formats.LatentFormat()  # 4 channels, no scaling
    if weight_dtype is not None:
        config.set_inference_dtype(weight_dtype, torch.float32)
    model = comfy.model_base.Flux(config, device=torch.device("cpu"))
    model.eval()
    seed_weights(model.diffusion_model, seed)
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def flux_controlnet(comfy, double: int = 2, single: int = 2, seed: int = 5):
    """A ``comfy.controlnet.ControlNet`` around a tiny ``comfy.ldm.flux.controlnet.ControlNetFlux``
    for the :func:`flux_patcher` of the same depth, laid out as ComfyUI loads an InstantX one
    (``load_controlnet_flux_instantx``): its hint is a latent (4 channels, at the latent's
    size; no VAE, so none is encoded), its residuals go to every double and single block.
    Seeded weights, its output layers too (zero-initialised in a checkpoint's training,
    they would make its residuals zero)."""
    import comfy.controlnet
    import comfy.ldm.flux.controlnet
    import comfy.ops

    model = comfy.ldm.flux.controlnet.ControlNetFlux(
        latent_input=True,
        control_latent_channels=4,
        operations=comfy.ops.disable_weight_init,
        device=torch.device("cpu"),
        **_flux_config(double, single),
    )
    model.eval()
    seed_weights(model, seed)
    return comfy.controlnet.ControlNet(
        model, compression_ratio=1, load_device=torch.device("cpu"), extra_conds=["y", "guidance"]
    )


def zimage_patcher(comfy, layers: int = 2, seed: int = 0, **overrides):
    """A ModelPatcher around a tiny ``comfy.model_base.Lumina2`` with Z-Image's layout (dim 256,
    2 heads of Z-Image's 128 rotary dims, its modulation, caption and image padded to 32
    tokens; 4 latent channels; caption features of ``conds("flux")``): the bench's
    ``tiny-zimage`` with ``layers`` main layers. ``overrides`` change the config (Lumina 2's
    layout: no padding, grouped keys, its own modulation)."""
    from toma.tools.bench.comfyui import COMFY_ARCHS, build_patcher

    config = {"n_layers": layers, "cap_feat_dim": FLUX_CONTEXT, **overrides}
    return build_patcher(COMFY_ARCHS["tiny-zimage"], seed=seed, overrides=config)


def _unet_config(sdxl_like: bool) -> dict:
    depth = [0, 1, 1] if sdxl_like else [1, 1, 0]
    return {
        "image_size": 32,
        "in_channels": 4,
        "out_channels": 4,
        "model_channels": 32,
        "num_res_blocks": [1, 1, 1],
        "channel_mult": [1, 2, 2],
        "transformer_depth": depth,
        "transformer_depth_output": [d for d in depth for _ in range(2)],
        "transformer_depth_middle": 1,
        "num_head_channels": 16,
        "num_heads": -1,
        "context_dim": UNET_CONTEXT,
        "use_linear_in_transformer": True,
        "use_spatial_transformer": True,
        "legacy": False,
        "adm_in_channels": None,
        "use_temporal_attention": False,
    }


def unet_controlnet(comfy, sdxl_like: bool = True, seed: int = 5):
    """A ``comfy.controlnet.ControlNet`` around a tiny ``comfy.cldm.cldm.ControlNet`` for the
    :func:`unet_patcher` of the same layout (RGB hints at 8x the latent), seeded weights (its
    zero convolutions too, so that its residuals change the samples)."""
    import comfy.cldm.cldm
    import comfy.controlnet
    import comfy.ops

    config = {k: v for k, v in _unet_config(sdxl_like).items() if k not in ("out_channels", "use_temporal_attention")}
    model = comfy.cldm.cldm.ControlNet(
        hint_channels=3, device=torch.device("cpu"), operations=comfy.ops.disable_weight_init, **config
    )
    seed_weights(model, seed)
    return comfy.controlnet.ControlNet(model, load_device=torch.device("cpu"))


def unet_patcher(comfy, sdxl_like: bool = True, seed: int = 0):
    """A ModelPatcher around a tiny ``UNetModel`` in a ``comfy.model_base.BaseModel``: with
    ``sdxl_like``, no attention at full resolution (attention at downsample 2 and 4, as SDXL);
    else attention at 1 and 2 (as SD 1.x)."""
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models

    unet_config = _unet_config(sdxl_like)
    config = comfy.supported_models.SD15(unet_config)
    config.unet_config = dict(unet_config)
    config.latent_format = comfy.latent_formats.LatentFormat()
    model = comfy.model_base.BaseModel(config, device=torch.device("cpu"))
    model.eval()
    seed_weights(model.diffusion_model, seed)
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def conds(kind: str, batch: int = 1, seed: int = 1):
    """Seeded positive and negative conditioning for a tiny ``"flux"`` or ``"unet"``."""
    g = torch.Generator().manual_seed(seed)

    def make() -> list:
        if kind == "flux":
            pooled = torch.randn(batch, FLUX_VEC, generator=g)
            return [[torch.randn(batch, 6, FLUX_CONTEXT, generator=g), {"pooled_output": pooled}]]
        return [[torch.randn(batch, 5, UNET_CONTEXT, generator=g), {}]]

    return make(), make()


def sample(comfy, patcher, kind: str, h: int = 16, w: int = 16, steps: int = 3, cfg: float = 2.0, batch: int = 1, **kw):
    """Sample ``steps`` Euler steps on a seeded ``(batch, 4, h, w)`` latent through
    ``comfy.sample.sample`` (from ``latent``, zeros by default; ``kw`` goes to it)."""
    import comfy.sample

    pos, neg = conds(kind, batch)
    latent = kw.pop("latent", None)
    latent = torch.zeros(batch, 4, h, w) if latent is None else latent
    noise = torch.randn(batch, 4, h, w, generator=torch.Generator().manual_seed(7))
    return comfy.sample.sample(
        patcher, noise, steps, cfg, "euler", "normal", pos, neg, latent, disable_pbar=True, seed=7, **kw
    )


WAN_TEXT = 32


def wan_patcher(comfy, layers: int = 2, seed: int = 0):
    """A ModelPatcher around a tiny ``comfy.model_base.WAN21`` (T2V, dim 64, 2 heads)."""
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models

    unet_config = {
        "image_model": "wan2.1",
        "model_type": "t2v",
        "patch_size": (1, 2, 2),
        "text_len": 8,
        "in_dim": 4,
        "dim": 64,
        "ffn_dim": 128,
        "freq_dim": 32,
        "text_dim": WAN_TEXT,
        "out_dim": 4,
        "num_heads": 2,
        "num_layers": layers,
    }
    config = comfy.supported_models.WAN21_T2V(unet_config)
    config.latent_format = comfy.latent_formats.LatentFormat()
    model = comfy.model_base.WAN21(config, device=torch.device("cpu"))
    model.eval()
    seed_weights(model.diffusion_model, seed)
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def sample_video(comfy, patcher, frames: int = 3, h: int = 8, w: int = 8, steps: int = 2, cfg: float = 2.0, **kw):
    """``sample`` for a tiny Wan: a seeded ``(1, 4, frames, h, w)`` latent, text conditioning."""
    import comfy.sample

    g = torch.Generator().manual_seed(1)
    pos = [[torch.randn(1, 5, WAN_TEXT, generator=g), {}]]
    neg = [[torch.randn(1, 5, WAN_TEXT, generator=g), {}]]
    shape = (1, 4, frames, h, w)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    return comfy.sample.sample(
        patcher, noise, steps, cfg, "euler", "normal", pos, neg, torch.zeros(shape), disable_pbar=True, seed=7, **kw
    )


LTX_TEXT = 32


def ltx_patcher(comfy, layers: int = 2, seed: int = 0):
    """A ModelPatcher around a tiny ``comfy.model_base.LTXV`` (LTX-Video, dim 32, 2 heads, 4
    latent channels, one latent pixel per token)."""
    import comfy.latent_formats
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models

    unet_config = {
        "image_model": "ltxv",
        "in_channels": 4,
        "cross_attention_dim": 32,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "caption_channels": LTX_TEXT,
        "num_layers": layers,
    }
    config = comfy.supported_models.LTXV(unet_config)
    config.latent_format = comfy.latent_formats.LatentFormat()
    model = comfy.model_base.LTXV(config, device=torch.device("cpu"))
    model.eval()
    seed_weights(model.diffusion_model, seed)
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def sample_ltx(comfy, patcher, frames: int = 3, h: int = 4, w: int = 6, steps: int = 2, cfg: float = 2.0, **kw):
    """``sample`` for a tiny LTX-Video: a seeded ``(1, 4, frames, h, w)`` latent, text conditioning
    with its attention mask (LTX's forward takes one), the negative's last token masked."""
    import comfy.sample

    g = torch.Generator().manual_seed(1)
    pos = [[torch.randn(1, 5, LTX_TEXT, generator=g), {"attention_mask": torch.ones(1, 5, dtype=torch.long)}]]
    neg = [[torch.randn(1, 5, LTX_TEXT, generator=g), {"attention_mask": torch.tensor([[1, 1, 1, 1, 0]])}]]
    shape = (1, 4, frames, h, w)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    return comfy.sample.sample(
        patcher, noise, steps, cfg, "euler", "normal", pos, neg, torch.zeros(shape), disable_pbar=True, seed=7, **kw
    )


HUNYUAN_TEXT = 32
HUNYUAN_VEC = 16


def hunyuan_patcher(comfy, seed: int = 0):
    """A ModelPatcher around a tiny ``comfy.model_base.HunyuanVideo`` (hidden 64, 2 heads,
    2 double and 2 single blocks)."""
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models

    unet_config = {
        "image_model": "hunyuan_video",
        "in_channels": 4,
        "out_channels": 4,
        "vec_in_dim": HUNYUAN_VEC,
        "context_in_dim": HUNYUAN_TEXT,
        "hidden_size": 64,
        "mlp_ratio": 2.0,
        "num_heads": 2,
        "depth": 2,
        "depth_single_blocks": 2,
        "axes_dim": [8, 12, 12],
        "theta": 256,
        "patch_size": [1, 2, 2],
        "qkv_bias": True,
        "guidance_embed": False,
        "byt5": False,
        "meanflow": False,
        "use_cond_type_embedding": False,
        "vision_in_dim": None,
        "meanflow_sum": False,
    }
    config = comfy.supported_models.HunyuanVideo(unet_config)
    config.latent_format = comfy.latent_formats.LatentFormat()
    model = comfy.model_base.HunyuanVideo(config, device=torch.device("cpu"))
    model.eval()
    seed_weights(model.diffusion_model, seed)
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def sample_hunyuan(comfy, patcher, frames: int = 2, h: int = 8, w: int = 8, steps: int = 2, mask: bool = True):
    """``sample`` for a tiny HunyuanVideo, with ``mask``: text with a padding mask (the last 2
    of 7 tokens) and cfg 1 (ComfyUI's HunyuanVideo builds its mask for a batch of one: with
    cond and uncond in one batch it fails, patched or not); without: cfg 2."""
    import comfy.sample

    g = torch.Generator().manual_seed(1)

    def cond() -> list:
        extra = {"pooled_output": torch.randn(1, HUNYUAN_VEC, generator=g)}
        if mask:
            extra["attention_mask"] = torch.tensor([[1, 1, 1, 1, 1, 0, 0]])
        return [[torch.randn(1, 7, HUNYUAN_TEXT, generator=g), extra]]

    pos, neg = cond(), cond()
    shape = (1, 4, frames, h, w)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    return comfy.sample.sample(
        patcher,
        noise,
        steps,
        1.0 if mask else 2.0,
        "euler",
        "normal",
        pos,
        neg,
        torch.zeros(shape),
        disable_pbar=True,
        seed=7,
    )


QWEN_TEXT = 32


def _qwen_config() -> dict:
    """The tiny Qwen-Image's ``unet_config`` (2 heads of 32, 2 blocks, 4 latent channels)."""
    return {
        "image_model": "qwen_image",
        "patch_size": 2,
        "in_channels": 16,
        "out_channels": 4,
        "num_layers": 2,
        "attention_head_dim": 32,
        "num_attention_heads": 2,
        "joint_attention_dim": QWEN_TEXT,
        "axes_dims_rope": (8, 12, 12),
    }


def qwen_patcher(comfy, seed: int = 0):
    """A ModelPatcher around a tiny ``comfy.model_base.QwenImage`` (2 heads of 32, 2 blocks)."""
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models

    config = comfy.supported_models.QwenImage(_qwen_config())
    config.latent_format = comfy.latent_formats.LatentFormat()
    model = comfy.model_base.QwenImage(config, device=torch.device("cpu"))
    model.eval()
    seed_weights(model.diffusion_model, seed)
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def qwen_controlnet(comfy, seed: int = 5):
    """A ``comfy.controlnet.ControlNet`` around a tiny
    ``comfy.ldm.qwen_image.controlnet.QwenImageControlNetModel`` for the :func:`qwen_patcher`,
    laid out as ComfyUI loads an InstantX one (``load_controlnet_qwen_instantx``): its hint
    is a latent ``(B, 4, 1, H, W)`` at the latent's size (no VAE, so none is encoded).
    Seeded weights, its output layers too."""
    import comfy.controlnet
    import comfy.ldm.qwen_image.controlnet
    import comfy.ops

    model = comfy.ldm.qwen_image.controlnet.QwenImageControlNetModel(
        operations=comfy.ops.disable_weight_init, device=torch.device("cpu"), **_qwen_config()
    )
    model.eval()
    seed_weights(model, seed)
    return comfy.controlnet.ControlNet(model, compression_ratio=1, load_device=torch.device("cpu"), extra_conds=[])


def qwen_conds(mask: bool = False) -> tuple[list, list]:
    """Seeded positive and negative conditioning for a tiny Qwen-Image (7 text tokens); with
    ``mask``, a padding mask over their last 2."""
    g = torch.Generator().manual_seed(1)

    def cond() -> list:
        extra = {"attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0, 0]])} if mask else {}
        return [[torch.randn(1, 7, QWEN_TEXT, generator=g), extra]]

    return cond(), cond()


def sample_qwen(comfy, patcher, h: int = 16, w: int = 16, steps: int = 2, mask: bool = False, cfg: float = 2.0):
    """``sample`` for a tiny Qwen-Image on a ``(1, 4, 1, h, w)`` latent; with ``mask``, text
    with a padding mask (its last 2 of 7 tokens)."""
    import comfy.sample

    pos, neg = qwen_conds(mask)
    shape = (1, 4, 1, h, w)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    return comfy.sample.sample(
        patcher, noise, steps, cfg, "euler", "normal", pos, neg, torch.zeros(shape), disable_pbar=True, seed=7
    )


def chroma_patcher(comfy, seed: int = 0):
    """A ModelPatcher around a tiny ``comfy.model_base.Chroma`` (Flux's blocks, hidden 64)."""
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models

    unet_config = {
        "image_model": "chroma",
        "in_channels": 16,  # patchified: 4 latent channels x 2 x 2
        "out_channels": 4,
        "context_in_dim": FLUX_CONTEXT,
        "hidden_size": 64,
        "mlp_ratio": 2.0,
        "num_heads": 2,
        "depth": 2,
        "depth_single_blocks": 2,
        "axes_dim": [8, 12, 12],
        "theta": 10000,
        "patch_size": 2,
        "qkv_bias": True,
        "in_dim": 64,
        "out_dim": 64,
        "hidden_dim": 32,
        "n_layers": 1,
        "txt_ids_dims": [],
        "vec_in_dim": None,
    }
    config = comfy.supported_models.Chroma(unet_config)
    config.latent_format = comfy.latent_formats.LatentFormat()
    model = comfy.model_base.Chroma(config, device=torch.device("cpu"))
    model.eval()
    seed_weights(model.diffusion_model, seed)
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def _sd3_config() -> dict:
    """The tiny SD3's ``unet_config`` (MMDiT depth 2: hidden 128, 2 heads; 4 latent channels)."""
    return {
        "in_channels": 4,
        "out_channels": 4,
        "pos_embed_scaling_factor": None,
        "pos_embed_offset": None,
        "pos_embed_max_size": 16,
        "patch_size": 2,
        "depth": 2,
        "adm_in_channels": FLUX_VEC,
        "num_patches": 256,
        "context_embedder_config": {
            "target": "torch.nn.Linear",
            "params": {"in_features": FLUX_CONTEXT, "out_features": 128},
        },
    }


def _seed_pos_embed(mmdit, seed: int) -> None:
    """Seed an MMDiT's position table: a buffer, which ComfyUI also leaves as ``torch.empty``."""
    with torch.no_grad():
        mmdit.pos_embed.copy_(torch.randn(mmdit.pos_embed.shape, generator=torch.Generator().manual_seed(seed)) * 0.02)


def sd3_patcher(comfy, seed: int = 0):
    """A ModelPatcher around a tiny ``comfy.model_base.SD3`` (MMDiT depth 2: hidden 128, 2 heads);
    its conditioning is the tiny Flux's (``conds("flux")``)."""
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models

    config = comfy.supported_models.SD3(_sd3_config())
    config.latent_format = comfy.latent_formats.LatentFormat()
    model = comfy.model_base.SD3(config, device=torch.device("cpu"))
    model.eval()
    seed_weights(model.diffusion_model, seed)
    _seed_pos_embed(model.diffusion_model, seed)
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def sd3_controlnet(comfy, seed: int = 5):
    """A ``comfy.controlnet.ControlNet`` around a tiny ``comfy.cldm.mmdit.ControlNet`` for the
    :func:`sd3_patcher`, laid out as ComfyUI loads one (``load_controlnet_mmdit``): one block
    (fewer than the model's, as in the released ones), a latent hint (4 channels, at the
    latent's size; no VAE, so none is encoded). As ComfyUI spreads its residuals, only the
    model's first block gets one. Seeded weights, its output layers too."""
    import comfy.cldm.mmdit
    import comfy.controlnet
    import comfy.ops

    model = comfy.cldm.mmdit.ControlNet(
        num_blocks=1, operations=comfy.ops.disable_weight_init, device=torch.device("cpu"), **_sd3_config()
    )
    model.eval()
    seed_weights(model, seed)
    _seed_pos_embed(model, seed)
    return comfy.controlnet.ControlNet(model, compression_ratio=1, load_device=torch.device("cpu"))


# -- the same weights in diffusers' models (tests/comfyui/test_comfyui_cross_host.py) -------------
# Import diffusers' model classes before ComfyUI: with the torchvision stand-ins in place,
# diffusers' import-time version checks fail.
TWIN_FAMILIES = ("flux", "unet", "wan", "zimage")
_EPS = torch.finfo(torch.float32).eps


def diffusers_twin(comfy, family: str, seed: int = 0, still_refiner: bool = False):
    """A tiny ComfyUI model of ``family`` (``"flux"``, ``"unet"``: SDXL's attention layout,
    ``"wan"``: Wan 2.1 T2V, or ``"zimage"``: Z-Image's NextDiT) with seeded weights, and
    diffusers' model of that family holding the same weights: ``(patcher, diffusers_model)``.

    The keys are converted by the hosts' own maps: ComfyUI's ``comfy.utils.flux_to_diffusers``
    and ``unet_to_diffusers`` (diffusers key -> ComfyUI key, fused q/k/v sliced), and for Wan
    and Z-Image, whose ComfyUI keys are the original checkpoint's, diffusers'
    ``convert_wan_transformer_to_diffusers`` and
    ``convert_z_image_transformer_checkpoint_to_diffusers``. Loading is strict: every key of
    both is used.

    Z-Image at this size needs three settings to be one model in both hosts (at Z-Image's
    own size, dim 3840, the first two hold by themselves): ComfyUI's FFN width rounded to a
    multiple of 2, not 256 (both hosts then take ``int(dim * 8 / 3)``); diffusers' timestep
    MLP with ComfyUI's hidden width ``min(dim, 1024)``, where diffusers fixes 1024 (its own
    ``TimestepEmbedder`` class); and diffusers' q/k RMSNorms with ComfyUI's epsilon. ComfyUI
    0.33.0 builds those norms without one (float32's, 1.2e-7, in its fused ``rms_rope``),
    diffusers with 1e-5: a difference of the hosts, not of rounding (measured 1.1e-5 on
    outputs of size 4 here, 22 float32 steps), aligned so that what remains is rounding.
    With ``still_refiner`` (Z-Image only), the noise refiner's two gates are zero, so the
    refiner passes the image tokens through unchanged: its attention runs each token at its
    own rotary position, which would tell apart the two tokens of an equal pair
    (``twin_inputs(pairs=True)``) before the merged layers.
    """
    import comfy.utils

    if family == "flux":
        from diffusers import FluxTransformer2DModel

        patcher = flux_patcher(comfy, double=2, single=2, seed=seed, mlp_ratio=4.0)  # diffusers' Flux: 4
        model = FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,  # 4 latent channels x 2 x 2, packed as ComfyUI patchifies
            out_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=32,
            num_attention_heads=2,
            joint_attention_dim=FLUX_CONTEXT,
            pooled_projection_dim=FLUX_VEC,
            guidance_embeds=False,
            axes_dims_rope=(8, 12, 12),
        )
        key_map = comfy.utils.flux_to_diffusers({"depth": 2, "depth_single_blocks": 2, "hidden_size": 64})
    elif family == "unet":
        from diffusers import UNet2DConditionModel

        patcher = unet_patcher(comfy, sdxl_like=True, seed=seed)
        model = UNet2DConditionModel(
            sample_size=32,
            in_channels=4,
            out_channels=4,
            block_out_channels=(32, 64, 64),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            layers_per_block=1,
            cross_attention_dim=UNET_CONTEXT,
            attention_head_dim=(2, 4, 4),  # heads per level (diffusers' legacy name): 16 channels each
            use_linear_projection=True,
        )
        key_map = comfy.utils.unet_to_diffusers(patcher.model.model_config.unet_config)
    elif family == "wan":
        from diffusers import WanTransformer3DModel
        from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

        patcher = wan_patcher(comfy, layers=2, seed=seed)
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=32,
            in_channels=4,
            out_channels=4,
            text_dim=WAN_TEXT,
            freq_dim=32,
            ffn_dim=128,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
        )
        original = {k: v.clone() for k, v in patcher.model.diffusion_model.state_dict().items()}
        model.load_state_dict(convert_wan_transformer_to_diffusers(original), strict=True)
        return patcher, model.eval()
    elif family == "zimage":
        from diffusers import ZImageTransformer2DModel
        from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers
        from diffusers.models.transformers.transformer_z_image import TimestepEmbedder

        patcher = zimage_patcher(comfy, layers=2, seed=seed, multiple_of=2)
        dm = patcher.model.diffusion_model
        if still_refiner:
            with torch.no_grad():
                for layer in dm.noise_refiner:  # (scale, gate) for attention, then for the MLP
                    for part in layer.adaLN_modulation[0].weight, layer.adaLN_modulation[0].bias:
                        part.unflatten(0, (4, -1))[1::2] = 0
        dim = dm.dim
        model = ZImageTransformer2DModel(
            in_channels=4,
            dim=dim,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            cap_feat_dim=FLUX_CONTEXT,
            axes_dims=list(dm.axes_dims),
            axes_lens=list(dm.axes_lens),
        )
        model.t_embedder = TimestepEmbedder(min(dim, 256), mid_size=min(dim, 1024))
        for name, module in model.named_modules():
            if name.endswith(".attention"):
                module.norm_q.eps = module.norm_k.eps = _EPS
        original = {k: v.clone() for k, v in dm.state_dict().items()}
        model.load_state_dict(convert_z_image_transformer_checkpoint_to_diffusers(original), strict=True)
        return patcher, model.eval()
    else:
        raise ValueError(f"family must be one of {TWIN_FAMILIES}; got {family!r}")
    source = patcher.model.diffusion_model.state_dict()
    weights = {}
    for key, like in model.state_dict().items():
        found = key_map[key]
        if isinstance(found, str):
            value = source[found]
        elif found[1] is None:  # (ComfyUI key, None, transform)
            value = found[2](source[found[0]])
        else:  # (ComfyUI key, (dim, offset, size)): a slice of a fused tensor
            value = source[found[0]].narrow(*found[1])
        weights[key] = value.reshape(like.shape)
    model.load_state_dict(weights, strict=True)
    return patcher, model.eval()


def twin_inputs(family: str, pairs: bool = False, seed: int = 3) -> dict:
    """Seeded inputs of one denoiser call for :func:`diffusers_twin`'s models: ``x`` (latent),
    ``sigma``, ``context`` and, for Flux, ``pooled``. With ``pairs``, the image tokens come
    in equal pairs (token columns 2j and 2j + 1 equal), so that each 2x2 tile holds two
    pairs (see the cross-host test for why). Z-Image's latent is 12x20: 60 tokens, which
    both hosts pad to 64, as they pad the 6 caption tokens to 32."""
    g = torch.Generator().manual_seed(seed)
    shape = {"wan": (1, 4, 3, 8, 8), "zimage": (1, 4, 12, 20)}.get(family, (1, 4, 16, 16))
    x = torch.randn(shape, generator=g)
    if pairs:  # a token is 2x2 latent pixels: latent columns 4j, 4j+1 repeat as 4j+2, 4j+3
        halves = x.unflatten(-1, (shape[-1] // 4, 4))[..., :2]
        x = torch.cat((halves, halves), -1).flatten(-2)
    dim = {"flux": FLUX_CONTEXT, "unet": UNET_CONTEXT, "wan": WAN_TEXT, "zimage": FLUX_CONTEXT}[family]
    inputs = {"x": x, "sigma": torch.tensor([0.7 if family != "unet" else 2.0])}
    inputs["context"] = torch.randn(1, 6, dim, generator=g)
    if family == "flux":
        inputs["pooled"] = torch.randn(1, FLUX_VEC, generator=g)
    return inputs


def comfy_denoise(patcher, x, sigma, context, pooled=None) -> torch.Tensor:
    """One denoiser call of ComfyUI's ``BaseModel.apply_model`` with ``patcher``'s patches and
    wrappers (as sampling passes them): the denoised latent. A NextDiT (Z-Image) is loaded
    first, as sampling loads it (:func:`loaded_denoise`): toma reaches its layers through
    object patches, which only loading puts in place."""
    import comfy.model_base

    if isinstance(patcher.model, comfy.model_base.Lumina2):
        return loaded_denoise(patcher, x, sigma, context, num_tokens=context.shape[1])
    options = {**patcher.model_options.get("transformer_options", {}), "wrappers": patcher.wrappers}
    extra = {} if pooled is None else {"y": pooled}
    with torch.no_grad():
        return patcher.model.apply_model(
            x, sigma, c_crossattn=context, transformer_options={**options, "sigmas": sigma}, **extra
        )


def loaded_denoise(patcher, x, sigma, context, **conds) -> torch.Tensor:
    """``comfy_denoise`` after loading ``patcher`` as sampling does (``load_models_gpu``): its
    object patches are then in place, and those of a patcher loaded before are undone.
    ``conds`` go to ``apply_model`` (``num_tokens`` for NextDiT)."""
    import comfy.model_management

    comfy.model_management.load_models_gpu([patcher])
    options = {**patcher.model_options.get("transformer_options", {}), "wrappers": patcher.wrappers}
    with torch.no_grad():
        return patcher.model.apply_model(
            x, sigma, c_crossattn=context, transformer_options={**options, "sigmas": sigma}, **conds
        )


def diffusers_denoise(family: str, patcher, model, x, sigma, context, pooled=None) -> torch.Tensor:
    """The same call on diffusers' ``model``: ComfyUI's model sampling turns sigma into the
    denoiser's input scaling and timestep, and its output into the denoised latent, exactly as
    ``apply_model`` does; the latent is packed into tokens as ComfyUI's Flux patchifies it.
    Z-Image takes lists of ``(C, 1, H, W)`` latents and captions, and a rising ``t``, as
    ComfyUI's NextDiT computes it (``1 - timestep``); both hosts' output is the negated
    flow, which ComfyUI's NextDiT negates itself and diffusers' pipeline does after."""
    sampling = patcher.model.model_sampling
    xc = sampling.calculate_input(sigma, x)
    t = sampling.timestep(sigma).float()
    with torch.no_grad():
        if family == "flux":
            b, c, h, w = x.shape
            hp, wp = h // 2, w // 2
            packed = xc.reshape(b, c, hp, 2, wp, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, hp * wp, c * 4)
            rows, cols = torch.meshgrid(torch.arange(hp), torch.arange(wp), indexing="ij")
            img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
            out = model(
                hidden_states=packed,
                encoder_hidden_states=context,
                pooled_projections=pooled,
                timestep=t,
                img_ids=img_ids,
                txt_ids=torch.zeros(context.shape[1], 3),
                return_dict=False,
            )[0]
            out = out.reshape(b, hp, wp, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
        elif family == "zimage":
            out = model(list(xc.unsqueeze(2)), 1.0 - t, list(context), return_dict=False)[0]
            out = -torch.stack(out).squeeze(2)
        else:
            out = model(xc, t, encoder_hidden_states=context, return_dict=False)[0]
    return sampling.calculate_denoised(sigma, out, x)


def fp32_floor(reference: torch.Tensor) -> float:
    """One fp32 rounding step at the output's scale: ``eps * max|reference|``."""
    return _EPS * float(reference.abs().max())


# -- UI-format workflows from API-format prompts (examples/comfyui/, scripts/comfyui_ui_workflows.py) --
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")


def node_widgets(node_class) -> list[tuple[str, dict]]:
    """The widgets of a ComfyUI node class, in the order the front end lays out
    ``widgets_values``: its required, then optional, inputs that are widgets (numbers,
    strings, booleans, choices), each ``(input name, options)``; a seed's
    ``control_after_generate`` is a widget of its own, right after it, named ``"<name>:control"``."""
    schema = node_class.INPUT_TYPES()
    out = []
    for part in ("required", "optional"):
        for name, spec in schema.get(part, {}).items():
            kind, options = spec[0], (spec[1] if len(spec) > 1 else {}) or {}
            if isinstance(kind, (list, tuple)) or kind in WIDGET_TYPES:
                out.append((name, options))
                if options.get("control_after_generate"):
                    out.append((f"{name}:control", {}))
    return out


def ui_workflow(prompt: dict, mappings: dict) -> dict:
    """The UI-format (LiteGraph) workflow of an API-format ``prompt``: the same nodes (ids
    kept), links and widget values, laid out in columns by depth. ``mappings`` is ComfyUI's
    ``nodes.NODE_CLASS_MAPPINGS``. Seeds are ``"fixed"`` after generation, so the workflow
    reproduces the prompt."""
    ids = sorted(prompt, key=int)
    depth: dict[str, int] = {}

    def depth_of(nid: str) -> int:
        if nid not in depth:
            sources = [v[0] for v in prompt[nid]["inputs"].values() if isinstance(v, list)]
            depth[nid] = 1 + max((depth_of(s) for s in sources), default=-1)
        return depth[nid]

    links: list[list] = []
    outputs: dict[str, list[dict]] = {}
    for nid in ids:
        cls = mappings[prompt[nid]["class_type"]]
        names = getattr(cls, "RETURN_NAMES", None) or cls.RETURN_TYPES
        outputs[nid] = [
            {"name": n, "type": t, "links": [], "slot_index": i}
            for i, (n, t) in enumerate(zip(names, cls.RETURN_TYPES))
        ]
    nodes, rows = [], {}
    for order, nid in enumerate(ids):
        node = prompt[nid]
        cls = mappings[node["class_type"]]
        schema = cls.INPUT_TYPES()
        sockets, widgets = [], []
        for part in ("required", "optional"):
            for name, spec in schema.get(part, {}).items():
                value = node["inputs"].get(name)
                if isinstance(value, list):  # a link [source id, output slot]
                    source, slot = value
                    link = len(links) + 1
                    kind = outputs[source][slot]["type"]
                    links.append([link, int(source), slot, int(nid), len(sockets), kind])
                    outputs[source][slot]["links"].append(link)
                    sockets.append({"name": name, "type": kind, "link": link})
        for name, options in node_widgets(cls):
            if name.endswith(":control"):
                widgets.append("fixed")
            elif name in node["inputs"] or "default" in options:
                widgets.append(node["inputs"].get(name, options.get("default")))
            else:
                raise ValueError(f"node {nid} ({node['class_type']}): give a value for its widget {name!r}")
        column = depth_of(nid)
        row = rows[column] = rows.get(column, -1) + 1
        nodes.append(
            {
                "id": int(nid),
                "type": node["class_type"],
                "title": node.get("_meta", {}).get("title", node["class_type"]),
                "pos": [40 + 380 * column, 40 + 260 * row],
                "size": [340, 130 + 26 * len(widgets)],
                "flags": {},
                "order": order,
                "mode": 0,
                "inputs": sockets,
                "outputs": outputs[nid],
                "properties": {"Node name for S&R": node["class_type"]},
                "widgets_values": widgets,
            }
        )
    return {
        "last_node_id": max(int(i) for i in ids),
        "last_link_id": len(links),
        "nodes": nodes,
        "links": links,
        "groups": [],
        "config": {},
        "extra": {},
        "version": 0.4,
    }
