"""toma: ToMA token merging with attention for diffusers pipelines.

Quick start::

    import toma
    toma.apply_toma(pipe, ratio=0.5)   # pipeline or denoiser
    image = pipe(prompt).images[0]
    toma.remove_toma(pipe)             # exact undo
    toma.apply_toma(pipe, config=toma.load_config("tuned.json"))   # settings from `toma tune`
    toma.supported()                   # the model families it merges, and what each supports
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from toma.api import ToMAPatch, apply_toma, get_toma, remove_toma
    from toma.config import ConfigFileError, ToMAConfig, load_config
    from toma.support import FamilySupport, supported

__version__ = "0.1.0"

__all__ = [
    "ConfigFileError",
    "FamilySupport",
    "ToMAConfig",
    "ToMAPatch",
    "apply_toma",
    "get_toma",
    "load_config",
    "remove_toma",
    "supported",
    "__version__",
]

# public name -> module defining it. They load on first use (PEP 562), so that the ``toma``
# command can print its help and version without importing torch (about 1.3 s).
_LAZY = {
    "ConfigFileError": "toma.config",
    "ToMAConfig": "toma.config",
    "load_config": "toma.config",
    "ToMAPatch": "toma.api",
    "apply_toma": "toma.api",
    "get_toma": "toma.api",
    "remove_toma": "toma.api",
    "FamilySupport": "toma.support",
    "supported": "toma.support",
}


def __getattr__(name: str) -> Any:
    if name == "builtin":  # a submodule (built-in models as pipelines): torch loads with it
        return importlib.import_module("toma.builtin")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'toma' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"builtin"})
