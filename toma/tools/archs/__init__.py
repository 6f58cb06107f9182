"""Denoiser architectures for benchmarking, built from config with random weights.

Speed does not depend on the weights, so a full-size SDXL, SD 1.5 or Flux.1-dev denoiser
built from its published config times like the real one, and nothing is downloaded. The
``tiny-*`` architectures exist for tests. :func:`make_inputs` builds one denoiser call's
keyword arguments at a given image resolution.

Each arch family is one module under :mod:`toma.tools.archs.families`, found there at
import (adding a family adds a module and touches nothing here). A family module states:

- ``FAMILY``: its family name (``Arch.family``: a :data:`toma.adapters.FAMILIES` name, or
  ``"unet"``), and ``ARCHS``: its :class:`Arch` entries (published configs, tiny ones);
- ``inputs(call)``: one denoiser call's keyword arguments (see :class:`Call`);
- ``DEPTH_KEYS``: transformers: the config keys that count blocks, which ``--depth`` divides.

and, where the family differs from the common case, any of these optional quirks:

- ``reduce(full, reduced, depth)``: finishes :func:`reduced_config` (config lists that
  follow the block counts);
- ``TIMESTEP_KEY`` (default ``"timestep"``) and ``timestep_at(frac)`` (default
  ``999 * frac``): the denoiser's timestep at ``frac`` of the noise left, for :func:`set_timestep`;
- ``call(model, inputs)``: one forward, where ``model(**inputs)`` is not it (:func:`call_denoiser`);
- ``count_latent_frames(arch, frames)``: a video VAE that does not keep one frame and compress
  ``time_scale`` frames into one (:func:`latent_frames`);
- ``DENOISER_CLASS`` (default: the first class of the family's spec) and ``WEIGHTS_SUBFOLDER``
  (default ``"transformer"``).

This package holds the generic code and the table of archs (:data:`ARCHS`). Like the
modules, it imports no torch until a model or a call is built.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
# torch loads inside the functions that build models and inputs: ``toma bench --help``
# reads ARCHS without paying for it

from toma.tools.archs.arch import Arch, Call
from toma.tools.archs.arch import latent_frames as vae_latent_frames

FAMILIES_PACKAGE = "toma.tools.archs.families"


def discover(package: str = FAMILIES_PACKAGE) -> tuple[dict[str, ModuleType], dict[str, Arch]]:
    """The arch family modules of ``package`` by family and their archs by name.

    Every module of the package whose name does not start with ``_`` is a family module
    (see this package's docstring); modules come in name order, and each one's archs in
    its own order. Importing them imports no torch.

    Raises:
        ValueError: a module lacks ``FAMILY``, ``ARCHS`` or ``inputs``; states a family
            another module states too; has an arch of another family; or an arch name is
            taken.
    """
    modules: dict[str, ModuleType] = {}
    archs: dict[str, Arch] = {}
    path = importlib.import_module(package).__path__
    for info in sorted(pkgutil.iter_modules(path), key=lambda info: info.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        missing = [name for name in ("FAMILY", "ARCHS", "inputs") if not hasattr(module, name)]
        if missing:
            raise ValueError(f"arch family module {module.__name__} must define {', '.join(missing)}")
        family = module.FAMILY
        if family in modules:
            raise ValueError(f"family {family!r} is stated by both {modules[family].__name__} and {module.__name__}")
        modules[family] = module
        for arch in module.ARCHS:
            if arch.family != family:
                raise ValueError(
                    f"arch {arch.name!r} of {module.__name__} must have family {family!r}; got {arch.family!r}"
                )
            if arch.name in archs:
                raise ValueError(
                    f"arch name {arch.name!r} of {module.__name__} is taken (family {archs[arch.name].family!r})"
                )
            archs[arch.name] = arch
    return modules, archs


def depth_keys(modules: Mapping[str, ModuleType]) -> dict[str, tuple[str, ...]]:
    """The ``DEPTH_KEYS`` of each family module that has them (the transformers), by family."""
    return {family: module.DEPTH_KEYS for family, module in modules.items() if hasattr(module, "DEPTH_KEYS")}


# each arch family's module (see the docstring above), and every arch by its --arch name
FAMILY_MODULES: dict[str, ModuleType]
ARCHS: dict[str, Arch]
FAMILY_MODULES, ARCHS = discover()

# the config keys that count blocks, per transformer family (what --depth divides)
DEPTH_KEYS: dict[str, tuple[str, ...]] = depth_keys(FAMILY_MODULES)


class _Stacks(Mapping):
    """The block stacks of each transformer family, in call order, which is the order of its
    DEPTH_KEYS: its spec's (:mod:`toma.adapters`), read at the first look-up of a family, as
    the spec's import needs torch. The families are DEPTH_KEYS's."""

    def __getitem__(self, family: str) -> tuple[str, ...]:
        if family not in DEPTH_KEYS:
            raise KeyError(family)
        return _spec(family).stacks

    def __contains__(self, family: object) -> bool:
        return family in DEPTH_KEYS

    def __iter__(self) -> Iterator[str]:
        return iter(DEPTH_KEYS)

    def __len__(self) -> int:
        return len(DEPTH_KEYS)


STACKS: Mapping[str, tuple[str, ...]] = _Stacks()


def _spec(family: str) -> Any:
    """The :class:`~toma.adapters.spec.FamilySpec` of a transformer family."""
    from toma.adapters import FAMILIES

    return importlib.import_module(FAMILIES[family][0]).SPEC


def latent_frames(arch: Arch, frames: int | None = None) -> int:
    """Latent frames of a video arch for ``frames`` pixel frames (its default if None): as
    its family module's ``count_latent_frames`` says, else as the common video VAE counts
    (:func:`toma.tools.archs.arch.latent_frames`). 1 for images."""
    own = getattr(FAMILY_MODULES.get(arch.family), "count_latent_frames", None)
    return own(arch, frames) if own is not None else vae_latent_frames(arch, frames)


def denoiser_class(family: str) -> str:
    """The diffusers class name of a family's denoiser: its module's ``DENOISER_CLASS``, or
    the first its spec names."""
    stated = getattr(FAMILY_MODULES[family], "DENOISER_CLASS", None)
    return stated if stated is not None else _spec(family).classes[0]


def get_arch(name: str) -> Arch:
    """The architecture called ``name``; raises ValueError listing the known ones."""
    if name not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {name!r}")
    return ARCHS[name]


def reduced_config(family: str, config: dict[str, Any], depth: int) -> dict[str, Any]:
    """A transformer config with ``depth`` times fewer blocks in every stack (at least one each).

    Width (heads, head size, MLP) is unchanged, so every block costs what a full one costs.
    A family module's ``reduce`` then fits the config entries that follow the block counts
    (SD3.5's image-only second attention stays on the same share of the first blocks).
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be an int >= 1 (1 = full depth); got {depth!r}")
    if family not in DEPTH_KEYS:
        raise ValueError(f"depth applies to transformers ({', '.join(DEPTH_KEYS)}); got depth={depth} for a {family}")
    counts = [key for key in DEPTH_KEYS[family] if not isinstance(config[key], (list, tuple))]
    out = {**config, **{key: max(1, round(config[key] / depth)) for key in counts}}
    reduce = getattr(FAMILY_MODULES[family], "reduce", None)
    return out if reduce is None else reduce(config, out, depth)


def build_model(
    arch: Arch,
    depth: int = 1,
    model_path: str | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> torch.nn.Module:
    """Build the denoiser of ``arch`` in eval mode.

    Args:
        arch: the architecture.
        depth: transformers: build ``depth`` times fewer blocks (see :func:`reduced_config`).
        model_path: a local directory or an already-cached hub id with real weights (looked up
            without network access, in ``unet/`` or ``transformer/`` or at the top level).
            None builds random weights from ``arch.config``.
        dtype, device: where the weights live (dtype None: float32).
        seed: seed of the random weights.
    """
    import diffusers
    import torch

    dtype = torch.float32 if dtype is None else dtype

    cls = getattr(diffusers, denoiser_class(arch.family))
    if model_path is not None:
        sub = getattr(FAMILY_MODULES[arch.family], "WEIGHTS_SUBFOLDER", "transformer")
        errors = []
        for subfolder in (sub, None):
            try:
                model = cls.from_pretrained(model_path, subfolder=subfolder, torch_dtype=dtype, local_files_only=True)
                break
            except (OSError, ValueError, EnvironmentError) as err:
                errors.append(f"{subfolder or '.'}: {err}")
        else:
            raise FileNotFoundError(
                f"no {cls.__name__} weights found at --model {model_path!r} (no download is tried): {errors}"
            )
        return model.to(device).eval()
    config = dict(arch.config)
    if depth != 1 or arch.family in DEPTH_KEYS:
        config = reduced_config(arch.family, config, depth)
    device = torch.device(device)
    forked = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked), device:
        torch.manual_seed(seed)
        # initialise where the model will run: a 12B-parameter init on the CPU alone
        # takes minutes, on a GPU seconds
        model = cls(**config)
    if dtype != torch.float32 and getattr(model, "_keep_in_fp32_modules", None):
        return model.to(dtype=dtype).eval()  # its warning is then true: those modules are cast too
    # diffusers' ModelMixin.to warns "should be kept in float32: []" at any dtype cast, even
    # when no module is to be kept or the dtype is float32; nn.Module.to casts alike, silently
    return torch.nn.Module.to(model, dtype=dtype).eval()


def make_inputs(
    arch: Arch,
    resolution: int,
    batch: int = 1,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    frames: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of one denoiser call at ``resolution`` pixels high (see :meth:`Arch.size`).

    The arguments are the arch's family module's ``inputs`` (its docstring lists them), from
    a :class:`Call` that draws the prompt embeddings ``(B, text_tokens, text_dim)`` first, so
    every family's random draws start alike. The timestep is a placeholder; :func:`set_timestep`
    changes it per step. ``dtype`` None means float32.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    height, width = arch.size(resolution)
    step = arch.patch * arch.vae_scale
    if height // arch.vae_scale < 2 or resolution % step:
        raise ValueError(f"resolution must be a multiple of {step} pixels; got {resolution}")
    call = Call(arch, batch, dtype, device, frames, torch.Generator().manual_seed(seed), height, width)
    return FAMILY_MODULES[arch.family].inputs(call)


def set_timestep(arch: Arch, inputs: dict[str, Any], step: int, steps: int) -> dict[str, Any]:
    """``inputs`` at denoising step ``step`` of ``steps`` (timesteps decrease, as in a sampler)."""
    import torch

    module = FAMILY_MODULES[arch.family]
    frac = 1.0 - step / max(steps, 1)  # the noise left: 1 at the first step
    key = getattr(module, "TIMESTEP_KEY", "timestep")
    timestep_at = getattr(module, "timestep_at", None)
    value = 999.0 * frac if timestep_at is None else timestep_at(frac)
    return {**inputs, key: torch.full_like(inputs[key], value)}


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


def token_grid(arch: Arch, resolution: int, frames: int | None = None) -> tuple[int, ...]:
    """Token grid of the first attention level: ``(h, w)`` for images (UNet at downsample 1,
    transformer image tokens), ``(t, h, w)`` for video."""
    height, width = arch.size(resolution)
    h, w = height // arch.vae_scale // arch.patch, width // arch.vae_scale // arch.patch
    return (latent_frames(arch, frames), h, w) if arch.frames else (h, w)


def block_count(config: dict[str, Any], key: str) -> int:
    """The blocks a ``DEPTH_KEYS`` entry of ``config`` counts: its value, or the length of a
    list of the blocks they join (Wan VACE's ``vace_layers``)."""
    value = config[key]
    return len(value) if isinstance(value, (list, tuple)) else value


def merged_blocks(count: int, full_count: int, skip: int = 5) -> tuple[int, ...]:
    """Merged block indices when ``count`` of ``full_count`` blocks are built: the default
    skip of the first ``skip`` blocks, scaled by ``count / full_count`` (at least one merged)."""
    skip = min(skip, full_count // 2)  # as the families' skip_first rule: at most half a stack
    scaled = min(count - 1, math.floor(skip * count / full_count + 0.5))
    return tuple(range(max(scaled, 0), count))


def default_placement(arch: Arch, model: torch.nn.Module) -> dict[str, Any]:
    """ToMA's default placement on a (possibly reduced-depth) transformer, as ``blocks``:
    the full model's skip of the first 5 blocks per stack, scaled to the blocks built."""
    if arch.family not in STACKS:
        return {}
    full = dict(zip(STACKS[arch.family], (block_count(arch.config, k) for k in DEPTH_KEYS[arch.family])))
    return {"blocks": {s: merged_blocks(len(model.get_submodule(s)), full[s]) for s in STACKS[arch.family]}}


def call_denoiser(arch: Arch, model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
    """One denoiser forward on :func:`make_inputs` arguments: ``model(**inputs)``, or the
    family module's ``call(model, inputs)`` where it has one (the UNets, Bria FIBO)."""
    call = getattr(FAMILY_MODULES[arch.family], "call", None)
    return model(**inputs) if call is None else call(model, inputs)
