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
}

# the parts of a block that merge, each behind its ToMAConfig switch: the defaults name them
_PARTS = (("merge_attn", "attention"), ("merge_crossattn", "cross-attention queries"), ("merge_mlp", "MLP"))


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
        default_blocks: which blocks merge when ``blocks`` (UNets: ``levels``) is not given.
        context_parallel: whether it merges under diffusers' context parallelism
            (``enable_parallelism``); the others are refused there, with the reason.
        comfyui: how it runs in the ComfyUI node: ``"✔"``, ``"✖ "`` and why not, or ``""``
            where the node has no record of it.
        merges: what merges by default, in a few words (the README's column): the parts
            whose ``merge_*`` switch is on by default, then the blocks, ``"blocks 5+"``
            counting from 0 in each stack (every block but the first 5).
    """

    family: str
    title: str
    classes: tuple[str, ...]
    video: bool
    summary: str
    default_blocks: str
    context_parallel: bool
    comfyui: str
    merges: str


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


def _default_parts() -> str:
    """The parts of a block that merge under ``ToMAConfig()``'s switches, in words."""
    from toma.config import ToMAConfig

    config = ToMAConfig()
    return ", ".join(word for switch, word in _PARTS if getattr(config, switch)) or "nothing"


def _unet_levels() -> tuple[str, str]:
    """``(words, short words)`` for the UNet attention levels merged under ``ToMAConfig()``."""
    from toma.config import ToMAConfig

    levels = ToMAConfig().levels
    if levels == 1:
        return "highest-resolution attention level", "highest-res level"
    return f"the {levels} highest-resolution attention levels", f"{levels} highest-res levels"


def _default_blocks(spec: object) -> tuple[str, str]:
    """``(words, short words)`` for the spec's default blocks, read off ``default_blocks``
    on a 40-block stack, and on shorter ones for a rule that skips at most half a stack."""
    n = 40
    rules = {}  # stack -> (words, short words, capped)
    for stack in spec.stacks:
        chosen = tuple(spec.default_blocks(stack, n))
        skipped = n - len(chosen)
        if chosen == tuple(range(skipped, n)):
            # skip_first's cap: a stack shorter than twice the skip keeps its second half
            capped = skipped > 0 and all(
                tuple(spec.default_blocks(stack, m)) == tuple(range(m // 2, m)) for m in range(1, 2 * skipped)
            )
            if skipped == 0:
                rules[stack] = ("every block", "all blocks", False)
            else:
                rules[stack] = (f"every block but the first {skipped}", f"blocks {skipped}+", capped)
        else:
            listed = f"{', '.join(map(str, chosen))} (of 40)"
            rules[stack] = (listed, listed, False)
    if len(set(rules.values())) == 1:
        words, short, capped = next(iter(rules.values()))
        several = len(rules) > 1
        if several:
            words += " of each stack"
        if capped:
            words += f" (at most half {'its' if several else 'the'} blocks)"
        return words, short
    # stacks with rules of their own: each named
    words = "; ".join(f"{stack}: {w}{' (at most half)' if c else ''}" for stack, (w, _, c) in rules.items())
    return words, "; ".join(f"{stack}: {short}" for stack, (_, short, _) in rules.items())


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
    parts = _default_parts()
    levels, levels_short = _unet_levels()
    out = [
        FamilySupport(
            video=False,
            default_blocks=levels,
            context_parallel="unet" in CONTEXT_PARALLEL,
            comfyui=comfyui.get("unet", ""),
            merges=f"{parts}, {levels_short}",
            **_UNET,
        )
    ]
    for family, (module_name, classes) in FAMILIES.items():
        module = importlib.import_module(module_name)
        spec = getattr(getattr(module, "ADAPTER", module), "spec", None) or getattr(module, "SPEC", None)
        if spec is None:
            raise RuntimeError(f"family {family!r}: {module_name} has no spec (ADAPTER.spec or SPEC)")
        title, summary = _docstring_head(module)
        blocks, blocks_short = _default_blocks(spec)
        out.append(
            FamilySupport(
                family=family,
                title=title,
                classes=tuple(classes),
                video=bool(spec.video),
                summary=summary,
                default_blocks=blocks,
                context_parallel=family in CONTEXT_PARALLEL,
                comfyui=comfyui.get(family, ""),
                merges=f"{parts}, {blocks_short}",
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
