"""Model adapters: one per model family.

A family is matched by the class names of the denoiser, so that finding the adapter
imports only that family's module (and the diffusers model code it needs), never the
others. A family module declares a ``SPEC`` (:class:`toma.adapters.spec.FamilySpec`) and,
where data cannot say it all, ``QUIRKS`` (:class:`toma.adapters.spec.Quirks`); the
registry builds the engine's adapter (:class:`toma.adapters.engine.EngineAdapter`) from
them, so that no family imports the engine.
"""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path
from typing import Any

import torch

FAMILY_PACKAGE = "toma.adapters.families"


def _declared(path: Path) -> tuple[str, tuple[str, ...]] | None:
    """The ``name`` and ``classes`` a family module's ``SPEC = ...(name=..., classes=...)``
    states as literals, read from its source without importing it; None where it has none."""
    for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        if any(getattr(target, "id", None) == "SPEC" for target in node.targets):
            named = {k.arg: k.value for k in node.value.keywords if k.arg}
            if "name" in named and "classes" in named:
                return ast.literal_eval(named["name"]), tuple(ast.literal_eval(named["classes"]))
    return None


@functools.cache
def _registry() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every family module under ``toma/adapters/families/``, by the name its spec declares:
    ``family -> (module, denoiser class names)``. A family lands by adding its file: the
    registry reads each file's declaration (``tests/test_imports.py`` checks it against the
    imported spec), so that matching a model imports only its own family's module."""
    package = Path(__file__).parent / "families"
    found: dict[str, tuple[str, tuple[str, ...]]] = {}
    for path in sorted(package.glob("*.py")):
        declared = None if path.stem == "__init__" else _declared(path)
        if declared is not None:
            name, classes = declared
            found[name] = (f"{FAMILY_PACKAGE}.{path.stem}", classes)
    return found


def __getattr__(name: str) -> Any:
    # FAMILIES is read from the family files on first use, not when toma is imported
    if name == "FAMILIES":
        return _registry()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# denoiser classes toma knows and does not merge (yet), with why
_SANA = "its attention is linear and its MLP a convolution on the token grid, so merging saves little (out of scope)"
_KV_CACHE = (
    "it generates chunk after chunk with causal attention to a cache of earlier chunks' keys and values, "
    "which merging the current chunk's tokens would have to write and read in step (out of scope)"
)
_AUDIO = "it denoises audio, not an image or video token grid, and ToMA merges only such grids"
UNSUPPORTED: dict[str, str] = {
    "SanaTransformer2DModel": _SANA,
    "SanaVideoTransformer3DModel": _SANA,
    "SanaWMTransformer3DModel": "its attention is gated-DeltaNet linear attention and its MLP a convolution on the "
    "token grid, so merging saves little (out of scope)",
    "Cosmos3OmniTransformer": "it is a packed mixture of transformers: one ragged sequence of text, image, video and "
    "audio tokens through pathway-specific weights, with causal attention for its understanding tokens, so no "
    "block sees an image grid of its own to merge (out of scope)",
    "Kandinsky6SRTransformer3DModel": "its attention is masked to local windows of the token grid (flex block "
    "masks), which merged tokens, drawn from across a tile, cannot keep (out of scope)",
    "AnyFlowFARTransformer3DModel": _KV_CACHE,
    "WanAnimate2Transformer3DModel": "its generation pass attends to a cache of the reference pass's keys and "
    "values, packed with its own tokens under a flex block mask laid out over the unmerged tokens (out of scope)",
    "JoyImageEditPlusTransformer3DModel": "its latents come as patches packed per sample up to max_num_patches, "
    "the target and reference items each of their own size (shape_list) with per-sample rotary tables, so the "
    "target's token grid is not the input's shape and differs from sample to sample (not supported yet; "
    "JoyImageEditTransformer3DModel merges)",
    "AceStepTransformer1DModel": _AUDIO,
    "StableAudioDiTModel": _AUDIO,
    "StableAudio3DiTModel": _AUDIO,
    "LongCatAudioDiTTransformer": _AUDIO,
    "MiniMaxMusic3Transformer1DModel": _AUDIO,
}


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model``'s family is not merged, if toma knows it."""
    for cls in type(model).__mro__:
        if cls.__name__ in UNSUPPORTED:
            return f"{cls.__name__}: {UNSUPPORTED[cls.__name__]}"
    return None


# options that say where merging happens, each meaningful for some families only: the
# value that leaves it unset, and who takes it
PLACEMENT_OPTIONS: dict[str, tuple[Any, str]] = {
    "mlp_levels": (None, "UNets"),
    "levels": (1, "UNets"),
    "blocks": (None, "transformer families"),
    "flux_double_blocks": (None, "Flux.1"),
    "flux_single_blocks": (None, "Flux.1"),
    "tile_frames": (None, "video families"),
}


def check_placement(name: str, adapter: Any, config: Any) -> None:
    """Refuse a placement option that family ``name``'s adapter does not take.

    An accepted setting must do something: ``blocks`` on a UNet, ``levels`` on a
    transformer or ``tile_frames`` on an image family would otherwise be ignored. Each
    adapter's ``placement()`` names the options it takes and how they place merging.
    """
    taken, hint = adapter.placement()
    for option, (unset, owners) in PLACEMENT_OPTIONS.items():
        value = getattr(config, option)
        if option not in taken and value != unset and not (option == "tile_frames" and value == 1):
            raise ValueError(f"{option} applies to {owners} only; {name} places merging with {hint}")


def adapter_for(model: torch.nn.Module) -> tuple[str, Any] | None:
    """The adapter of ``model``'s family as ``(name, adapter)``, or None.

    An adapter has ``placement()``, ``find_targets(model, config)``,
    ``attach(model, targets, cache)``, ``detach(targets)`` and ``tile_frames(config)``.
    """
    by_class = {cls: (name, module) for name, (module, classes) in _registry().items() for cls in classes}
    for cls in type(model).__mro__:  # the most derived class a family names
        if cls.__name__ in by_class:
            name, module = by_class[cls.__name__]
            family = importlib.import_module(module)
            # the engine loads with the first family found, not with the registry
            from toma.adapters.engine import EngineAdapter

            return name, EngineAdapter(family.SPEC, getattr(family, "QUIRKS", None))
    unet = importlib.import_module("toma.adapters.unet")
    return ("unet", unet) if unet.matches(model) else None
