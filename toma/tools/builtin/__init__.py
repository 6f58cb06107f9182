"""The built-in pretrained models, offline in the package: a registry of them by ``--model`` name.

``toma generate`` and ``toma eval`` run without a download on tiny models trained on
scikit-learn's digits: the class-conditional UNet (:mod:`toma.tools.builtin.unet`, the
default), the Flux image DiT (:mod:`toma.tools.builtin.dit`) and the moving-digits Wan
video DiT (:mod:`toma.tools.builtin.video`), each behind one interface
(:mod:`toma.tools.builtin.samplers`). Their weights sit next to the code: ``digits-unet/``,
``scheduler/`` and the ``*.safetensors`` and ``metadata.json`` of the UNet and its digit
classifier, ``digits-dit/`` and ``digits-video/``.

This module is torch-free: what applies to each model is known before loading it, and
the loaders import the models' code when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from toma.tools.builtin import samplers

if TYPE_CHECKING:
    from toma.tools.builtin.samplers import BuiltinSampler

# what an eval of a UNet and of a transformer can run; tomesd patches UNet blocks only
UNET_METHODS = ("none", "toma", "toma-random", "toma-grid", "tomesd")
TRANSFORMER_METHODS = ("none", "toma", "toma-random", "toma-grid")


@dataclass(frozen=True)
class BuiltinEntry:
    """How to load a built-in model and what applies to it, known before loading it."""

    load: Callable[[Path | None], BuiltinSampler]  # reads the model's files; imports torch
    title: str  # what reports call the model
    methods: tuple[str, ...]
    why_not: str = ""  # why a method outside ``methods`` does not apply
    transformer: bool = False  # whether ``--blocks`` chooses its merged blocks


_NO_CACHE = "the step caches (+CACHE) go on transformers; diffusers and cache-dit cache no UNet"
_NO_TOMESD = "tomesd merges the transformer blocks of UNets only; {name} is a {kind} transformer"

# ``--model`` name -> entry; "builtin-unet" is an alias of the default. A new built-in model
# adds a loader returning a BuiltinSampler (in samplers.py) and an entry here.
BUILTIN_MODELS: dict[str, BuiltinEntry] = {
    "builtin": BuiltinEntry(samplers.unet_sampler, "built-in digits", UNET_METHODS, _NO_CACHE),
    "builtin-unet": BuiltinEntry(samplers.unet_sampler, "built-in digits", UNET_METHODS, _NO_CACHE),
    "builtin-dit": BuiltinEntry(
        samplers.dit_sampler,
        "built-in digits DiT (Flux)",
        TRANSFORMER_METHODS,
        _NO_TOMESD.format(name="the built-in DiT", kind="Flux"),
        transformer=True,
    ),
    "builtin-video": BuiltinEntry(
        samplers.video_sampler,
        "built-in moving-digits video DiT (Wan)",
        TRANSFORMER_METHODS,
        _NO_TOMESD.format(name="the built-in video DiT", kind="Wan"),
        transformer=True,
    ),
}


def builtin_name(model: str | None) -> str | None:
    """The built-in model a ``--model`` value names (``None`` -> ``"builtin"``), or None for a pipeline."""
    if model is None:
        return "builtin"
    return model if model in BUILTIN_MODELS else None


def check_blocks(name: str, blocks: Any) -> None:
    """Raise ``ValueError`` naming ``--blocks`` when it is given for a built-in UNet (which would ignore it)."""
    if blocks is not None and not BUILTIN_MODELS[name].transformer:
        raise ValueError(
            f"--blocks chooses transformer blocks; --model {name} is a UNet, whose merged "
            "attention levels --levels chooses (or use --model builtin-dit or builtin-video)"
        )


def check_methods(name: str, methods: Sequence[str]) -> None:
    """Raise ``ValueError`` naming ``--methods`` if a method does not apply to built-in model ``name``."""
    entry = BUILTIN_MODELS[name]
    # a step cache after "+" (toma eval --methods toma+fbcache) goes on transformers only
    bad = [m for m in methods if m.partition("+")[0] not in entry.methods or ("+" in m and not entry.transformer)]
    if bad:
        raise ValueError(
            f"--methods {', '.join(bad)} cannot run on --model {name} ({entry.why_not}); "
            f"choose from {', '.join(entry.methods)}"
        )


def load_sampler(name: str, path: Path | None = None) -> BuiltinSampler:
    """Load the built-in model ``name`` (a key of :data:`BUILTIN_MODELS`) from ``path`` or the package.

    Raises:
        ValueError: an unknown name.
        FileNotFoundError: the model's files are missing.
    """
    if name not in BUILTIN_MODELS:
        raise ValueError(f"--model must be a diffusers pipeline or one of {', '.join(BUILTIN_MODELS)}; got {name!r}")
    return BUILTIN_MODELS[name].load(path)
