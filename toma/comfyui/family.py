"""The record of one ComfyUI denoiser family: its classes, and how toma merges there (a
:class:`~toma.comfyui.sites.Site`) or why it does not.

Each family states one in its own file under :mod:`toma.comfyui.families`. A family is found
from the class of ``model.model.diffusion_model``, compared by name (module and qualified
name), so that a subclass (another architecture built on a family's class) is never taken
for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from toma.comfyui import hooks


@dataclass(frozen=True)
class ComfyFamily:
    """One ComfyUI denoiser family.

    Attributes:
        name: short name, shown in logs and errors; a diffusers family of the same name is
            the same model (the documentation's tables join on it).
        classes: the denoiser classes, ``"module:QualName"``.
        site: how toma merges there (a :class:`~toma.comfyui.sites.Site`); None where it is
            refused.
        reason: why the family is refused (one line naming the missing hook), or None.
        needs: the ComfyUI hooks the family's merging needs (:mod:`toma.comfyui.hooks`).
        reference: image tokens of the family's reference frame, which ``tile_size`` "auto"
            scales tiles to (None: 4x4 tiles always).
        label: the family's name in messages (default: ``name``).
    """

    name: str
    classes: tuple[str, ...]
    site: Any = None
    reason: str | None = None
    needs: tuple[hooks.Need, ...] = ()
    reference: int | None = None
    label: str = ""

    @property
    def title(self) -> str:
        """The family's name in messages."""
        return self.label or self.name

    @property
    def merges(self) -> bool:
        """Whether toma merges this family in ComfyUI."""
        return self.site is not None


def class_name(cls: type) -> str:
    """``"module:QualName"`` of a class."""
    return f"{cls.__module__}:{cls.__qualname__}"
