"""ComfyUI's denoiser families, one module each; each states a ``FAMILY``
(:class:`~toma.comfyui.family.ComfyFamily`): its classes, and how toma merges there or why
it does not.

A new family is a new file here: the modules are found on first use, with no list to extend.
Its ComfyUI internals are named in :mod:`toma.comfyui.hooks`, where they are checked.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Any

from toma.comfyui.family import ComfyFamily, class_name

__all__ = ["ComfyFamily", "FAMILIES", "class_name", "family_of", "supported"]


@functools.cache
def _families() -> tuple[ComfyFamily, ...]:
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, ComfyFamily):
            raise TypeError(f"{module.__name__} states no FAMILY (a ComfyFamily)")
        found.append(family)
    return tuple(found)


def __getattr__(name: str) -> Any:
    # FAMILIES is built when first read, so that importing the package imports no family
    if name == "FAMILIES":
        return _families()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def family_of(diffusion_model: object) -> ComfyFamily | None:
    """The family of a ComfyUI denoiser (``model.model.diffusion_model``), or None for a
    class toma does not know."""
    name = class_name(type(diffusion_model))
    for family in _families():
        if name in family.classes:
            return family
    return None


def supported() -> list[dict[str, object]]:
    """Every ComfyUI family toma knows: ``name``, ``classes``, ``merges`` and, where it does
    not merge, ``reason``."""
    return [{"name": f.name, "classes": list(f.classes), "merges": f.merges, "reason": f.reason} for f in _families()]
