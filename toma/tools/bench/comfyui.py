"""``toma bench --host comfyui``: ComfyUI's own model classes, unpatched, with the ToMA node's
patch, and the ideal, timed side by side.

ComfyUI is imported, never copied (it is GPL-3.0): the one already in ``sys.modules``, else
the folder ``--comfyui`` or ``$TOMA_COMFYUI`` names (:func:`locate_comfyui`). Its model classes
(``comfy.model_base.Flux``, ``WAN21``, ``SDXL``, ``Lumina2``) are built at their published width with
fewer blocks (``--depth``) and seeded random weights (ComfyUI's layers skip initialisation,
so an unloaded model's weights would be whatever ``torch.empty`` held). A measurement is one
denoiser call, ``BaseModel.apply_model`` with the patcher's transformer options and wrappers
as sampling passes them. The rows:

- ``none``: the unpatched ModelPatcher;
- ``toma``: the clone :func:`toma.comfyui.patch.patch_model` returns (what the node returns);
- ``ideal``: the same ComfyUI model run on K image tokens with no selection cost. Where every
  block merges (Flux) that is the model itself on a latent cut to K tokens; where part of the
  model stays at N tokens (the SDXL UNet's convolutions, Wan's patch embedding, Z-Image's
  refiners), the node's own hooks with plans that keep every N/K-th token
  (:class:`toma.tools.baselines.IdealPlanCache`).

The report is ``toma bench``'s (:mod:`toma.tools.bench.report`). This module imports no torch
and no ComfyUI at import time; ``benchmarks/comfyui_*_cpu.py`` call :func:`benchmark_comfyui` too.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import math
import os
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

COMFYUI_ENV = "TOMA_COMFYUI"


@dataclass(frozen=True)
class ComfyArch:
    """One ComfyUI denoiser ``toma bench --host comfyui`` builds.

    Attributes:
        name: the ``--arch`` value; the geometry (default resolution, aspect, frames, VAE
            scale, patch) is that of the same name in :data:`toma.tools.archs.ARCHS`.
        kind: ``"flux"``, ``"wan"``, ``"unet"`` or ``"zimage"``: how the inputs and the ideal
            are made (Z-Image's NextDiT takes the caption's length, and its layers are patched
            by object patches, which loading the patcher puts in place).
        description: one line for the report.
        supported: the ``comfy.supported_models`` class of its config.
        model: the ``comfy.model_base`` class.
        config: ``depth -> unet_config``: the published config with ``depth`` times fewer blocks.
        channels: latent channels.
        text_dim: width of the prompt embeddings (``c_crossattn``).
        pooled_dim: width of ``y`` (Flux's pooled text, SDXL's ADM vector), or 0.
        text_tokens: prompt tokens by default.
        blocks: the node's ``blocks`` input here ("" = the node's default).
        ideal: ``"tokens"`` (the model on a latent of K tokens) or ``"plans"`` (zero-cost plans).
        probe: the module whose input's token count shows what attention saw (for Z-Image, less
            the padded caption and the image's pad that its layers take with the image).
        guidance: Flux.1-dev's guidance embedding is in the model (a ``guidance`` input).
        plain_latent: a 4-channel unscaled latent format (the tiny test models).
    """

    name: str
    kind: str
    description: str
    supported: str
    model: str
    config: Callable[[int], dict[str, Any]]
    channels: int
    text_dim: int
    pooled_dim: int
    text_tokens: int
    blocks: str
    ideal: str
    probe: str
    guidance: bool = False
    plain_latent: bool = False


def fewer(count: int, depth: int) -> int:
    """``count`` blocks built ``depth`` times fewer (at least one), as ``--depth`` does for diffusers' models."""
    return max(1, round(count / depth))


def _flux_dev(depth: int) -> dict[str, Any]:
    return {
        "image_model": "flux",
        "in_channels": 16,
        "out_channels": 16,
        "vec_in_dim": 768,
        "context_in_dim": 4096,
        "hidden_size": 3072,
        "mlp_ratio": 4.0,
        "num_heads": 24,
        "depth": fewer(19, depth),
        "depth_single_blocks": fewer(38, depth),
        "axes_dim": [16, 56, 56],
        "theta": 10000,
        "patch_size": 2,
        "qkv_bias": True,
        "guidance_embed": True,
        "txt_ids_dims": [],
    }


def _tiny_flux(depth: int) -> dict[str, Any]:
    return {
        **_flux_dev(depth),
        "in_channels": 4,
        "out_channels": 4,
        "vec_in_dim": 16,
        "context_in_dim": 32,
        "hidden_size": 64,
        "mlp_ratio": 2.0,
        "num_heads": 2,
        "depth": fewer(2, depth),
        "depth_single_blocks": fewer(2, depth),
        "axes_dim": [8, 12, 12],
        "guidance_embed": False,
    }


def _wan21_1_3b(depth: int) -> dict[str, Any]:
    return {
        "image_model": "wan2.1",
        "model_type": "t2v",
        "patch_size": (1, 2, 2),
        "text_len": 512,
        "in_dim": 16,
        "dim": 1536,
        "ffn_dim": 8960,
        "freq_dim": 256,
        "text_dim": 4096,
        "out_dim": 16,
        "num_heads": 12,
        "num_layers": fewer(30, depth),
    }


def _tiny_wan(depth: int) -> dict[str, Any]:
    return {
        **_wan21_1_3b(depth),
        "text_len": 8,
        "in_dim": 4,
        "dim": 64,
        "ffn_dim": 128,
        "freq_dim": 32,
        "text_dim": 32,
        "out_dim": 4,
        "num_heads": 2,
        "num_layers": fewer(2, depth),
    }


def _sdxl(depth: int) -> dict[str, Any]:
    # SDXL has 10 transformer blocks per block at 1/4 of the latent and 2 at 1/2: --depth
    # divides the 10, the level the node merges second
    d = fewer(10, depth)
    return {
        "model_channels": 320,
        "use_linear_in_transformer": True,
        "transformer_depth": [0, 0, 2, 2, d, d],
        "transformer_depth_output": [0, 0, 0, 2, 2, 2, d, d, d],
        "transformer_depth_middle": d,
        "context_dim": 2048,
        "adm_in_channels": 2816,
        "num_classes": "sequential",  # the ADM vector, as ComfyUI's detection sets it for SDXL
        "use_temporal_attention": False,
        "in_channels": 4,
        "out_channels": 4,
        "num_res_blocks": [2, 2, 2],
        "channel_mult": [1, 2, 4],
        "num_head_channels": 64,
        "num_heads": -1,
        "use_spatial_transformer": True,
        "legacy": False,
        "image_size": 32,
    }


def _tiny_sdxl(depth: int) -> dict[str, Any]:
    # SDXL's layout (no attention at full resolution; at 1/2 and 1/4), tiny
    d = fewer(2, depth)
    return {
        **_sdxl(depth),
        "model_channels": 32,
        "transformer_depth": [0, 0, 1, 1, d, d],
        "transformer_depth_output": [0, 0, 0, 1, 1, 1, d, d, d],
        "transformer_depth_middle": d,
        "context_dim": 32,
        "adm_in_channels": 16,
        "num_res_blocks": [2, 2, 2],
        "channel_mult": [1, 2, 2],
        "num_head_channels": 16,
    }


# Z-Image's sizes, which ComfyUI's NextDiT config names as diffusers' does: the bench's own
# (toma.tools.archs.families.zimage), so that both hosts build the same model
_ZIMAGE_SIZES = (
    "in_channels",
    "dim",
    "cap_feat_dim",
    "n_refiner_layers",
    "n_heads",
    "n_kv_heads",
    "qk_norm",
    "axes_dims",
    "axes_lens",
    "rope_theta",
)


def _zimage_config(sizes: dict[str, Any], depth: int) -> dict[str, Any]:
    # what ComfyUI's model detection reads off a Z-Image checkpoint; its noise and caption
    # refiner layers are kept whole, as on the diffusers host (never merged)
    return {
        "image_model": "lumina2",
        "patch_size": sizes["all_patch_size"][0],
        **{key: sizes[key] for key in _ZIMAGE_SIZES},
        "n_layers": fewer(sizes["n_layers"], depth),
        "ffn_dim_multiplier": 8.0 / 3.0,
        "z_image_modulation": True,
        "time_scale": sizes["t_scale"],
        "pad_tokens_multiple": 32,
    }


def _zimage_turbo(depth: int) -> dict[str, Any]:
    from toma.tools.archs.families.zimage import ZIMAGE

    return _zimage_config(ZIMAGE, depth)


def _tiny_zimage(depth: int) -> dict[str, Any]:
    from toma.tools.archs.families.zimage import TINY_ZIMAGE

    return _zimage_config(TINY_ZIMAGE, depth)


_FLUX = {"kind": "flux", "model": "Flux", "blocks": "double:all single:all", "ideal": "tokens"}
_WAN = {"kind": "wan", "supported": "WAN21_T2V", "model": "WAN21", "blocks": "blocks:all", "ideal": "plans"}
_UNET = {"kind": "unet", "supported": "SDXL", "model": "SDXL", "blocks": "", "ideal": "plans"}
# Z-Image's ideal is sized by the node's own layer patches with zero-cost plans: its main layers
# see what ToMA's do, [caption padded to 32; K image tokens; the pad of the N-token image]. A
# latent cut to K tokens would pad K, not N, up to 32 and run the refiners, the patch embedding
# and the final layer on K tokens too, which toma never merges: no merging at the layers gets there
_ZIMAGE = {"kind": "zimage", "supported": "ZImage", "model": "Lumina2", "blocks": "layers:all", "ideal": "plans"}
_PROBES = {
    "flux": "double_blocks.0.img_attn.qkv",
    "wan": "blocks.0.self_attn.q",
    "unet": "input_blocks.4.1.transformer_blocks.0.attn1.to_q",  # the first at 1/2: SDXL's level 1
    "zimage": "layers.0.attention.qkv",  # the first main layer: [caption; image; image pad]
}
_TINY = {"channels": 4, "text_dim": 32, "text_tokens": 8, "plain_latent": True}

COMFY_ARCHS: dict[str, ComfyArch] = {
    a.name: a
    for a in (
        ComfyArch(
            name="flux",
            description="ComfyUI's Flux (comfy.model_base.Flux) at Flux.1-dev's width",
            supported="Flux",
            config=_flux_dev,
            channels=16,
            text_dim=4096,
            pooled_dim=768,
            text_tokens=512,
            probe=_PROBES["flux"],
            guidance=True,
            **_FLUX,
        ),
        ComfyArch(
            name="wan",
            description="ComfyUI's Wan 2.1 (comfy.model_base.WAN21) at T2V 1.3B's width",
            config=_wan21_1_3b,
            channels=16,
            text_dim=4096,
            pooled_dim=0,
            text_tokens=512,
            probe=_PROBES["wan"],
            **_WAN,
        ),
        ComfyArch(
            name="sdxl",
            description="ComfyUI's SDXL UNet (comfy.model_base.SDXL) at SDXL's width",
            config=_sdxl,
            channels=4,
            text_dim=2048,
            pooled_dim=2816,
            text_tokens=77,
            probe=_PROBES["unet"],
            **_UNET,
        ),
        ComfyArch(
            name="zimage",
            description="ComfyUI's Z-Image (comfy.model_base.Lumina2, NextDiT) at Z-Image-Turbo's width",
            config=_zimage_turbo,
            channels=16,
            text_dim=2560,
            pooled_dim=0,
            text_tokens=512,  # as the diffusers host's zimage: a long prompt's, padded to 32
            probe=_PROBES["zimage"],
            **_ZIMAGE,
        ),
        ComfyArch(
            name="tiny-flux",
            description="tiny ComfyUI Flux (comfy.model_base.Flux, tests)",
            supported="FluxSchnell",
            config=_tiny_flux,
            pooled_dim=16,
            probe=_PROBES["flux"],
            **_FLUX,
            **_TINY,
        ),
        ComfyArch(
            name="tiny-wan",
            description="tiny ComfyUI Wan 2.1 (comfy.model_base.WAN21, tests)",
            config=_tiny_wan,
            pooled_dim=0,
            probe=_PROBES["wan"],
            **_WAN,
            **_TINY,
        ),
        ComfyArch(
            name="tiny-unet",
            description="tiny ComfyUI SDXL-like UNet (comfy.model_base.SDXL, tests)",
            config=_tiny_sdxl,
            pooled_dim=16,
            probe=_PROBES["unet"],
            **_UNET,
            **_TINY,
        ),
        ComfyArch(
            name="tiny-zimage",
            description="tiny ComfyUI Z-Image (comfy.model_base.Lumina2, NextDiT, tests)",
            config=_tiny_zimage,
            pooled_dim=0,
            probe=_PROBES["zimage"],
            **_ZIMAGE,
            **_TINY,
        ),
    )
}

COMFY_METHODS = ("none", "toma", "ideal")


# -- finding and importing ComfyUI ------------------------------------------------------------
class _Standins(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Modules whose every attribute is a mock, for torchvision and torchaudio where neither
    is installed: ComfyUI imports them at start, its denoisers never call them."""

    PACKAGES = ("torchvision", "torchaudio")

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        """A spec of ours for the stood-in packages and their submodules."""
        if name.split(".")[0] in self.PACKAGES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        """A mock module that answers every attribute."""
        from unittest import mock

        module = mock.MagicMock(name=spec.name)
        module.__spec__ = spec
        module.__path__ = []
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run."""


def is_comfyui(root: Path) -> bool:
    """Whether ``root`` is a ComfyUI checkout (it holds ``comfy/model_patcher.py``)."""
    return (root / "comfy" / "model_patcher.py").is_file()


def locate_comfyui(path: str | None = None, env: dict[str, str] | None = None) -> tuple[ModuleType, str]:
    """ComfyUI's ``comfy`` package and where it came from.

    The one already imported wins (``sys.modules``: a test session's, or ComfyUI's own process);
    else the checkout ``path`` (``--comfyui``) or ``$TOMA_COMFYUI`` names is imported
    (:func:`import_comfyui`). Raises ValueError naming ``--comfyui`` where neither is there.
    """
    comfy = sys.modules.get("comfy")
    if comfy is not None and getattr(comfy, "__path__", None):
        return comfy, f"already imported from {list(comfy.__path__)[0]}"
    env = os.environ if env is None else env
    given, source = (path, "--comfyui") if path else (env.get(COMFYUI_ENV), f"${COMFYUI_ENV}")
    if not given:
        raise ValueError(
            f"--host comfyui needs ComfyUI: pass --comfyui PATH (a ComfyUI checkout) or set ${COMFYUI_ENV}; "
            "toma imports it from there"
        )
    root = Path(given).expanduser().resolve()
    if not is_comfyui(root):
        raise ValueError(f"--comfyui: {source} = {given} is not a ComfyUI checkout (no comfy/model_patcher.py there)")
    import_comfyui(root)
    return sys.modules["comfy"], f"imported from {root} ({source})"


def import_comfyui(root: Path, cpu: bool | None = None) -> None:
    """Import the ComfyUI checkout at ``root``: its folder on ``sys.path``, its writable folders in
    a temporary directory, CPU mode where no CUDA device is (or ``cpu``), torch's SDPA, and
    stand-ins for torchvision and torchaudio where they are not installed (ComfyUI imports
    them at start; no denoiser calls them)."""
    import torch

    # diffusers, which toma's baselines import, probes torchvision: before the stand-ins
    import toma.tools.baselines  # noqa: F401

    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    if any(importlib.util.find_spec(name) is None for name in _Standins.PACKAGES):
        sys.meta_path.append(_Standins())
    import comfy.cli_args  # parses no command line unless ComfyUI's main asks it to

    args = comfy.cli_args.args
    args.cpu = (not torch.cuda.is_available()) if cpu is None else cpu
    args.use_pytorch_cross_attention = True
    # nothing is written into the checkout
    args.base_directory = tempfile.mkdtemp(prefix="toma-comfyui-")
    import comfy.model_management  # noqa: F401
    import comfy.model_patcher  # noqa: F401


def comfyui_version() -> str | None:
    """The imported ComfyUI's version (its ``comfyui_version.py``), or None where it has none."""
    comfy = sys.modules.get("comfy")
    if comfy is None:
        return None
    path = Path(list(comfy.__path__)[0]).parent / "comfyui_version.py"
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    return None


# -- the model and its inputs -----------------------------------------------------------------
def seed_weights(module: torch.nn.Module, seed: int = 0, scale: float = 0.2) -> None:
    """Seeded random weights in place: ComfyUI's layers skip initialisation (``torch.empty``).
    Biases near 0, 1-D norm weights near 1, the rest scaled by ``1/sqrt(fan_in)`` so that
    activations stay in range through the blocks."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif "norm" in name and p.ndim == 1:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.02)
            else:
                fan_in = p[0].numel() if p.ndim > 1 else p.numel()
                p.copy_(torch.randn(p.shape, generator=g) * (scale / max(fan_in, 1) ** 0.5) * 4)


def build_patcher(
    spec: ComfyArch,
    depth: int = 1,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> Any:
    """A ``comfy.model_patcher.ModelPatcher`` around ``spec``'s ComfyUI model with ``depth`` times
    fewer blocks and seeded random weights, in eval mode on ``device`` (ComfyUI already imported).
    ``overrides`` replace entries of its config (block counts the benchmark scripts set)."""
    import comfy.latent_formats
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models
    import torch

    device = torch.device(device)
    config = getattr(comfy.supported_models, spec.supported)({**spec.config(depth), **(overrides or {})})
    if spec.plain_latent:
        config.latent_format = comfy.latent_formats.LatentFormat()
    if dtype is not None and dtype != torch.float32:
        config.set_inference_dtype(dtype, None)
    model = getattr(comfy.model_base, spec.model)(config, device=device)
    model.eval()
    seed_weights(model.diffusion_model, seed)
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)


def blocks_built(spec: ComfyArch, patcher: Any) -> dict[str, int]:
    """The blocks of the model as built, per stack."""
    dm = patcher.model.diffusion_model
    if spec.kind == "flux":
        return {"double": len(dm.double_blocks), "single": len(dm.single_blocks)}
    if spec.kind == "wan":
        return {"blocks": len(dm.blocks)}
    if spec.kind == "zimage":  # the refiners, never merged, are not counted
        return {"layers": len(dm.layers)}
    count = sum(type(m).__name__ == "BasicTransformerBlock" for m in dm.modules())
    return {"transformer_blocks": count}


@dataclass(frozen=True)
class Geometry:
    """The latent of one call: ``frames`` latent frames (0 for images) of ``lh x lw``, and
    the token grid the denoiser packs it into."""

    lh: int
    lw: int
    frames: int
    patch: int

    @property
    def grid(self) -> tuple[int, ...]:
        """Tokens per side (frames first for video)."""
        side = (math.ceil(self.lh / self.patch), math.ceil(self.lw / self.patch))
        return (self.frames, *side) if self.frames else side

    @property
    def tokens(self) -> int:
        """Image (video) tokens N."""
        return math.prod(self.grid)


def geometry(spec: ComfyArch, resolution: int, frames: int | None = None, width: int | None = None) -> Geometry:
    """The latent for ``resolution`` pixels high and ``width`` wide (default: the arch's aspect),
    and ``frames`` pixel frames. Raises ValueError naming ``--resolution`` where it is not a
    whole number of tokens."""
    from toma.tools.archs import ARCHS, latent_frames

    arch = ARCHS[spec.name]
    step = arch.patch * arch.vae_scale
    if resolution < 2 * step or resolution % step:
        raise ValueError(f"--resolution must be a multiple of {step} pixels, at least {2 * step}; got {resolution}")
    height, aspect_width = arch.size(resolution)
    width = width or aspect_width
    if width < 2 * step or width % step:
        raise ValueError(f"width must be a multiple of {step} pixels, at least {2 * step}; got {width}")
    return Geometry(
        height // arch.vae_scale, width // arch.vae_scale, latent_frames(arch, frames) if arch.frames else 0, arch.patch
    )


def kept_columns(geo: Geometry, ratio: float) -> int:
    """Token columns of the ideal's cut latent at ``ratio``: ``(1 - ratio)`` of them, at least one."""
    return max(1, round(geo.grid[-1] * (1 - ratio)))


def make_inputs(
    spec: ComfyArch,
    geo: Geometry,
    batch: int,
    ratios: list[float],
    text_tokens: int,
    dtype: torch.dtype,
    device: Any,
    seed: int,
) -> dict[str, Any]:
    """One call's inputs: the latent ``x``, its cuts for the ideal (``("x", ratio)``, where the
    ideal runs on fewer tokens) and ``conds`` (``apply_model``'s keyword arguments but sigma)."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    conds: dict[str, Any] = {"c_crossattn": rand(batch, text_tokens, spec.text_dim)}
    if spec.pooled_dim:
        conds["y"] = rand(batch, spec.pooled_dim)
    if spec.guidance:
        conds["guidance"] = torch.full((batch,), 3.5, device=device, dtype=dtype)
    if spec.kind == "zimage":  # NextDiT takes the caption's length (ComfyUI's conds give it)
        conds["num_tokens"] = text_tokens
    x = rand(batch, spec.channels, *((geo.frames,) if geo.frames else ()), geo.lh, geo.lw)
    inputs: dict[str, Any] = {"x": x, "conds": conds}
    if spec.ideal == "tokens":
        for r in ratios:
            inputs[("x", r)] = x[..., : kept_columns(geo, r) * geo.patch]
    return inputs


# -- the methods --------------------------------------------------------------------------------
class ComfyMethods:
    """The three rows on one ComfyUI model, with the :class:`~toma.tools.bench.harness.MethodPatcher`
    interface that :func:`~toma.tools.bench.harness.time_rounds` drives: every patched clone is
    made once up front (ComfyUI's clones share the model's weights), and ``apply`` picks one.
    """

    def __init__(self, spec: ComfyArch, patcher: Any, node: dict[str, Any]) -> None:
        self.spec = spec
        self.patcher = patcher
        self.node = node  # the node's inputs but the ratio
        self.clones: dict[tuple[str, float | None], Any] = {}
        self.current: tuple[str, float | None] | None = None
        self.seen: dict[tuple[str, float | None], int] = {}  # tokens the probe module saw

    def prepare(self, methods: list[str], ratios: list[float]) -> None:
        """Patch a clone per ToMA ratio (and per ideal ratio where the ideal uses plans).

        Raises ValueError for input the node refuses (naming the node's input), RuntimeError
        where the node hands the model back unpatched (its warning says why)."""
        from toma.comfyui.patch import patch_model

        for r in ratios:
            if "toma" in methods:
                self.clones[("toma", r)] = self._patched(patch_model, r, self.node)
            if "ideal" in methods and self.spec.ideal == "plans":
                from toma.tools.baselines import IdealPlanCache

                ideal = self._patched(patch_model, r, {**self.node, "proportional_attention": False})
                run = ideal.toma_run
                run.cache = IdealPlanCache(run.config, reference=run.family.reference)
                self.clones[("ideal", r)] = ideal

    def _patched(self, patch_model: Callable, ratio: float, node: dict[str, Any]) -> Any:
        clone = patch_model(self.patcher, ratio, **node)
        if clone is self.patcher or getattr(clone, "toma_run", None) is None:
            raise RuntimeError(f"the ToMA node did not patch {self.spec.description}: its warning above says why")
        return clone

    def apply(self, variant: Any) -> dict[str, Any]:
        """Make ``variant`` the one :meth:`call` runs (loading its patcher, untimed, where its
        patch is object patches: sampling loads it once per run); returns its settings."""
        self.current = (variant.method, variant.ratio)
        if self.spec.kind == "zimage":
            import comfy.model_management

            # loading puts this patcher's layer stand-ins in place and takes another's away
            comfy.model_management.load_models_gpu([self.clones.get(self.current, self.patcher)])
        return {}

    def remove(self) -> None:
        """Back to no variant."""
        self.current = None

    def call(self, inputs: dict[str, Any]) -> Any:
        """One denoiser call of the current variant on ``inputs`` (with ``sigma``)."""
        import torch

        method, ratio = self.current or ("none", None)
        patcher = self.clones.get((method, ratio), self.patcher)
        x = inputs.get(("x", ratio), inputs["x"]) if method == "ideal" else inputs["x"]
        sigma = inputs["sigma"]
        options = {**patcher.model_options.get("transformer_options", {}), "wrappers": patcher.wrappers}
        key = (method, ratio)
        handle = None
        if key not in self.seen:  # the first call of each variant reads what attention sees
            probe = patcher.model.diffusion_model.get_submodule(self.spec.probe)

            beside = self._beside_image(inputs)

            def read(module: Any, args: tuple) -> None:
                self.seen[key] = int(args[0].shape[-2]) - beside

            handle = probe.register_forward_pre_hook(read)
        try:
            with torch.inference_mode():
                options = {**options, "sigmas": sigma}
                return patcher.model.apply_model(x, sigma, transformer_options=options, **inputs["conds"])
        finally:
            if handle is not None:
                handle.remove()

    def _beside_image(self, inputs: dict[str, Any]) -> int:
        """Tokens the probe sees beside the image's: 0 but on NextDiT, whose layers take
        ``[caption; image; image pad]``, caption and image each padded to its pad multiple."""
        if self.spec.kind != "zimage":
            return 0
        dm = self.patcher.model.diffusion_model
        multiple = dm.pad_tokens_multiple or 1
        text = inputs["conds"]["c_crossattn"].shape[1]
        image = math.prod(math.ceil(side / dm.patch_size) for side in inputs["x"].shape[-2:])
        return math.ceil(text / multiple) * multiple + (-image % multiple)

    def settings(self, method: str, ratio: float | None, geo: Geometry) -> dict[str, Any]:
        """What ``method`` at ``ratio`` ran with: image tokens, those its attention saw and,
        for ToMA, what the node's run recorded (the calls that merged, the blocks)."""
        out: dict[str, Any] = {"image_tokens": geo.tokens, "attention_tokens": self.seen.get((method, ratio))}
        if method == "ideal" and self.spec.ideal == "tokens" and ratio is not None:
            out["image_tokens"] = math.prod(geo.grid[:-1]) * kept_columns(geo, ratio)
        run = getattr(self.clones.get((method, ratio)), "toma_run", None)
        if run is not None:
            n, k = run.tokens or (None, None)
            out.update(
                image_tokens=n,
                kept_tokens=k,
                merged_calls=run.merged_calls,
                calls=run.calls,
                merged_blocks={stack: sorted(idx) for stack, idx in sorted(run.merged_blocks.items())},
            )
            if run.levels:  # UNet: per merged level (downsample factor), its grid's tokens N and K
                grids = [(math.ceil(geo.lh / ds), math.ceil(geo.lw / ds)) for ds in run.levels]
                out["levels"] = {
                    f"1/{ds}": [h * w, run.cache.layout(h, w).num_merged] for ds, (h, w) in zip(run.levels, grids)
                }
        return out


def benchmark_comfyui(
    arch: str,
    resolution: int,
    methods: list[str] = COMFY_METHODS,  # type: ignore[assignment]
    ratios: list[float] = (0.5,),  # type: ignore[assignment]
    batches: list[int] = (1,),  # type: ignore[assignment]
    steps: int = 1,
    repeats: int = 3,
    warmup: int = 1,
    dtype: torch.dtype | None = None,
    device: Any = "cpu",
    depth: int = 1,
    frames: int | None = None,
    width: int | None = None,
    text_tokens: int | None = None,
    node: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
    profile: bool = True,
    seed: int = 0,
    progress: bool = False,
    clock: str = "wall",
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Time ComfyUI's own model of ``arch`` (:data:`COMFY_ARCHS`) unpatched, with the ToMA node's
    patch and as the ideal, interleaved round by round; returns ``toma bench``'s report dict
    (``host: comfyui``). ComfyUI must be imported (:func:`locate_comfyui`).

    ``node`` holds the node's inputs but the ratio (``blocks``, ``tile_size``, ``merge_mlp``,
    ``proportional_attention``); ``blocks`` defaults to every block of the DiTs (their default
    skips the first blocks, all of a model built with few), the node's default levels on
    UNets. Each timed sample is ``steps`` calls at falling sigmas. ``width`` (pixels) replaces
    the arch's aspect, ``overrides`` entries of the model's config (:func:`build_patcher`).
    Raises ValueError for input the node refuses.
    """
    import torch

    from toma.tools.archs import ARCHS
    from toma.tools.bench.harness import CLOCKS, Measurement, Variant, _profile_forward, progress_bar, time_rounds
    from toma.tools.bench.report import RunConditions, build_report
    from toma.tools.common.report import load_average
    from toma.tools.opcount import count_kernels

    spec = COMFY_ARCHS[arch]
    load_before = load_average()
    dtype = dtype or torch.float32
    device = torch.device(device)
    node = {"blocks": spec.blocks, **(node or {})}
    text_tokens = text_tokens or spec.text_tokens
    geo = geometry(spec, resolution, frames, width)
    log(
        f"building {spec.description} (random weights, --depth {depth}) in {str(dtype).replace('torch.', '')} on "
        f"{device}; ComfyUI {comfyui_version() or '(version unknown)'}"
    )
    patcher = build_patcher(spec, depth, dtype, device, seed, overrides)
    built = blocks_built(spec, patcher)
    harness = ComfyMethods(spec, patcher, node)
    harness.prepare(methods, ratios)
    variants = [Variant("none", None)] if "none" in methods else []
    variants += [Variant(m, r) for r in ratios for m in ("toma", "ideal") if m in methods]
    sampling = patcher.get_model_object("model_sampling")
    step_inputs = {
        b: [
            {
                **make_inputs(spec, geo, b, ratios, text_tokens, dtype, device, seed + 1),
                "sigma": torch.full((b,), float(sampling.percent_to_sigma((s + 0.5) / steps)), device=device),
            }
            for s in range(steps)
        ]
        for b in batches
    }
    notes = [
        f"{spec.description}, {' and '.join(f'{n} {s}' for s, n in built.items())} (--depth {depth}); "
        f"{geo.tokens} image tokens{f' over {geo.frames} latent frames' if geo.frames else ''}, "
        f"{text_tokens} text tokens",
        "the ideal: "
        + (
            "the same model on a latent cut to K image tokens (every block merges here)"
            if spec.ideal == "tokens"
            else "the node's own hooks with plans that keep every N/K-th token (no selection, no merge matmuls, "
            "no attention bias)"
        ),
    ]
    if spec.kind == "zimage":
        dm = patcher.model.diffusion_model
        multiple = dm.pad_tokens_multiple
        padded = f"each padded to a multiple of {multiple} tokens" if multiple else "not padded"
        refiners = len(dm.noise_refiner)
        notes.append(
            f"the caption and the image are {padded}; the noise and caption refiners ({refiners} "
            f"layer{'s' if refiners != 1 else ''} each) run on every token in all three rows (toma never merges them)"
        )
    results = {(v, b): Measurement(v, b) for v in variants for b in batches}
    settings: dict[str, Any] = {}
    interrupted = False
    bar = progress_bar(len(variants) * len(batches) * (warmup + repeats), progress)
    try:
        time_rounds(
            harness,
            harness.call,
            variants,
            batches,
            step_inputs,
            warmup,
            repeats,
            device,
            results,
            settings,
            bar,
            clock=CLOCKS[clock],
        )
        if profile:
            for v in variants:
                bar.set_postfix_str(f"profiling {v.label}")
                harness.apply(v)
                try:
                    first = step_inputs[batches[0]][0]
                    results[(v, batches[0])].kernels = sum(count_kernels(lambda: harness.call(first)).values())
                    if v.method != "none":
                        results[(v, batches[0])].overhead = _profile_forward(harness.call, first, device, v.method)
                finally:
                    harness.remove()
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: reporting what was measured so far")
    finally:
        bar.close()
    for v in variants:
        settings[v.label] = harness.settings(v.method, v.ratio, geo)
        s = settings[v.label]
        if v.method != "none":
            log(
                f"{v.label}: attention saw {s['attention_tokens']} of {geo.tokens} image tokens"
                + (
                    f"; the node merged {s['image_tokens']} -> {s['kept_tokens']} in {s['merged_calls']} of "
                    f"{s['calls']} calls, blocks {s['merged_blocks']}"
                    if "kept_tokens" in s
                    else ""
                )
            )
    rows = [
        {
            "method": v.method,
            "ratio": v.ratio,
            "batch": b,
            "compiled": False,
            "times_s": m.times,
            "overhead": m.overhead,
            "kernels": m.kernels,
            "settings": settings.get(v.label),
        }
        for (v, b), m in results.items()
        if m.times
    ]
    conditions = RunConditions(
        arch=replace(ARCHS[arch], description=spec.description),
        parameters=sum(p.numel() for p in patcher.model.diffusion_model.parameters()),
        blocks=built,
        resolution=resolution,
        dtype=dtype,
        device=device,
        depth=depth,
        steps=steps,
        repeats=repeats,
        warmup=warmup,
        methods=list(methods),
        ratios=list(ratios),
        batches=list(batches),
        placement={**node, "text_tokens": text_tokens, "frames": frames, "latent": [geo.lh, geo.lw]},
        toma_options={},
        compiled=False,
    )
    report = build_report(conditions, rows, {}, notes, interrupted)
    report.update(
        host="comfyui",
        comfyui_version=comfyui_version(),
        clock=clock,
        image_tokens=geo.tokens,
        token_grid=list(geo.grid),
        cuda_graph=False,
        freezing=False,
        load_average_before=load_before,
        load_average_after=load_average(),
    )
    return report
