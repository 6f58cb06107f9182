"""Model adapters: one module per model family, each with ``matches``, ``find_targets`` and ``attach``."""

from __future__ import annotations

from types import ModuleType

import torch

from toma.adapters import flux, unet

ADAPTERS: dict[str, ModuleType] = {"flux": flux, "unet": unet}


def adapter_for(model: torch.nn.Module) -> tuple[str, ModuleType] | None:
    """The first adapter whose ``matches(model)`` is true, as ``(name, module)``."""
    for name, adapter in ADAPTERS.items():
        if adapter.matches(model):
            return name, adapter
    return None
