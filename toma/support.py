"""What toma merges, read at run time from the family records.

:func:`supported` lists every model family toma merges, with what each supports, from the
same records :func:`toma.apply_toma` uses to find a family's adapter
(:data:`toma.adapters.FAMILIES`, each adapter's spec, and the context-parallel list of
:mod:`toma.adapters.parallel`). The generated pages (``python -m toma.tools.docs``), the
README's model table and ``toma doctor --models`` are all made from it, so none of them can
name a family the code does not have.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass


def _comfyui() -> dict[str, str]:
    """Family -> how it runs in the ComfyUI node, from the node's own records
    (:data:`toma.comfyui.families.FAMILIES`, whose names are these families'): ``"✔"``, or
    ``"✖ "`` and why not. A family with no record there is not claimed either way."""
    from toma.comfyui.families import FAMILIES as COMFY

    return {f.name: "✔" if f.merges else f"✖ {f.reason}" for f in COMFY}


# UNets have no entry in FAMILIES: they are matched by structure (down and up blocks holding
# BasicTransformerBlocks), not by class name, so their record is written here.
_UNET = {
    "family": "unet",
    "title": "SD 1.x / 2.x, SDXL, AnimateDiff, Stable Video Diffusion",
    "classes": ("UNet2DConditionModel", "UNetMotionModel", "UNetSpatioTemporalConditionModel"),
    "summary": "self-attention of the highest-resolution attention level (``levels`` adds more; "
    "temporal attention passes whole)",
    "default_blocks": "highest-resolution attention level",
}


@dataclass(frozen=True)
class FamilySupport:
    """One model family toma merges, and what it supports.

    Attributes:
        family: the family's short name (as in :data:`toma.adapters.FAMILIES` and the
            summary that ``print(apply_toma(...))`` shows).
        title: the models it covers, as their makers name them.
        classes: the diffusers denoiser classes it matches.
        video: whether it generates video (tiles may then span frames, ``tile_frames``).
        summary: the layout of its blocks and what merges in them.
        default_blocks: which blocks merge when ``blocks`` is not given.
        context_parallel: whether it merges under diffusers' context parallelism
            (``enable_parallelism``); the others are refused there, with the reason.
        comfyui: how it runs in the ComfyUI node: ``"✔"``, ``"✖ "`` and why not, or ``""``
            where the node has no record of it.
    """

    family: str
    title: str
    classes: tuple[str, ...]
    video: bool
    summary: str
    default_blocks: str
    context_parallel: bool
    comfyui: str


def _docstring_head(module: object) -> tuple[str, str]:
    """``(title, summary)`` from a family module's first docstring paragraph, which reads
    ``Title (``Class``): summary.``"""
    doc = (getattr(module, "__doc__", None) or "").strip()
    first = " ".join(doc.split("\n\n")[0].split())
    match = re.match(r"(?P<title>.*?)\s*\((?P<classes>``[^)]*``)\):\s*(?P<summary>.*)", first)
    if match is None:
        return first, ""
    summary = match.group("summary").rstrip(".")
    return match.group("title"), summary


def _default_blocks(spec: object) -> str:
    """The spec's default blocks in words, read off ``default_blocks`` on a 40-block stack."""
    n = 40
    words = []
    for stack in spec.stacks:
        chosen = tuple(spec.default_blocks(stack, n))
        skipped = n - len(chosen)
        if chosen == tuple(range(skipped, n)):
            words.append("every block" if skipped == 0 else f"every block but the first {skipped}")
        else:
            words.append(f"{stack}: {', '.join(map(str, chosen))} (of 40)")
    return "; ".join(dict.fromkeys(words))


def supported() -> list[FamilySupport]:
    """Every model family toma merges, with what each supports, read from the family records.

    The UNet family comes first, then the transformer families in the order of
    :data:`toma.adapters.FAMILIES`. Importing each family's adapter module imports no model
    weights; it takes a few seconds, once per process.

    Returns:
        One :class:`FamilySupport` per family.
    """
    from toma.adapters import FAMILIES
    from toma.adapters.parallel import SUPPORTED as CONTEXT_PARALLEL

    comfyui = _comfyui()
    out = [
        FamilySupport(
            video=False,
            context_parallel="unet" in CONTEXT_PARALLEL,
            comfyui=comfyui.get("unet", ""),
            **_UNET,
        )
    ]
    for family, (module_name, classes) in FAMILIES.items():
        module = importlib.import_module(module_name)
        spec = getattr(getattr(module, "ADAPTER", module), "spec", None) or getattr(module, "SPEC", None)
        if spec is None:
            raise RuntimeError(f"family {family!r}: {module_name} has no spec (ADAPTER.spec or SPEC)")
        title, summary = _docstring_head(module)
        out.append(
            FamilySupport(
                family=family,
                title=title,
                classes=tuple(classes),
                video=bool(spec.video),
                summary=summary,
                default_blocks=_default_blocks(spec),
                context_parallel=family in CONTEXT_PARALLEL,
                comfyui=comfyui.get(family, ""),
            )
        )
    return out


def family_names() -> list[str]:
    """The names of the families :func:`supported` lists, in its order, without importing
    their adapter modules (what ``toma doctor`` prints)."""
    from toma.adapters import FAMILIES

    return ["unet", *FAMILIES]


def format_short(names: list[str]) -> str:
    """One line naming the families (``toma doctor``'s ``families:`` line)."""
    return f"{len(names)}: {', '.join(names)} (toma doctor --models: what each supports)"


def refused() -> dict[str, str]:
    """Denoiser classes toma knows and refuses to merge, each with the reason
    (:data:`toma.adapters.UNSUPPORTED`)."""
    from toma.adapters import UNSUPPORTED

    return dict(UNSUPPORTED)


def format_table(families: list[FamilySupport]) -> str:
    """A plain-text table of ``families``, one line each (what ``toma doctor --models`` prints)."""
    rows = [("family", "kind", "context parallel", "ComfyUI", "classes")]
    for f in families:
        rows.append(
            (
                f.family,
                "video" if f.video else "image",
                "yes" if f.context_parallel else "no",
                f.comfyui or "see docs/comfyui.md",
                ", ".join(f.classes),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows)
