"""Model adapters: one per model family.

A family is matched by the class names of the denoiser, so that finding the adapter
imports only that family's module (and the diffusers model code it needs), never the
others. A family module declares a ``SPEC`` (:class:`toma.adapters.spec.FamilySpec`) and,
where data cannot say it all, ``QUIRKS`` (:class:`toma.adapters.spec.Quirks`); the
registry builds the engine's adapter (:class:`toma.adapters.engine.EngineAdapter`) from
them, so that no family imports the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

# family -> (adapter module, denoiser class names)
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "flux": ("toma.adapters.families.flux", ("FluxTransformer2DModel",)),
    "sd3": ("toma.adapters.families.sd3", ("SD3Transformer2DModel",)),
    "wan": ("toma.adapters.families.wan", ("WanTransformer3DModel",)),
    "ltx": ("toma.adapters.families.ltx", ("LTXVideoTransformer3DModel",)),
    "ltx2": ("toma.adapters.families.ltx2", ("LTX2VideoTransformer3DModel",)),
    "pixart": ("toma.adapters.families.pixart", ("PixArtTransformer2DModel",)),
    "hunyuanvideo": ("toma.adapters.families.hunyuanvideo", ("HunyuanVideoTransformer3DModel",)),
    "cogvideox": ("toma.adapters.families.cogvideox", ("CogVideoXTransformer3DModel",)),
    "qwenimage": ("toma.adapters.families.qwenimage", ("QwenImageTransformer2DModel",)),
    "flux2": ("toma.adapters.families.flux2", ("Flux2Transformer2DModel",)),
    "hunyuanvideo15": ("toma.adapters.families.hunyuanvideo15", ("HunyuanVideo15Transformer3DModel",)),
    "wan-vace": ("toma.adapters.families.wan_vace", ("WanVACETransformer3DModel",)),
    "skyreels-v2": ("toma.adapters.families.skyreels_v2", ("SkyReelsV2Transformer3DModel",)),
    "wan-animate": ("toma.adapters.families.wan_animate", ("WanAnimateTransformer3DModel",)),
    "cosmos": ("toma.adapters.families.cosmos", ("CosmosTransformer3DModel",)),
    "longcat-image": ("toma.adapters.families.longcat_image", ("LongCatImageTransformer2DModel",)),
    "hunyuanimage": ("toma.adapters.families.hunyuanimage", ("HunyuanImageTransformer2DModel",)),
    "chroma": ("toma.adapters.families.chroma", ("ChromaTransformer2DModel",)),
    "joyimage": ("toma.adapters.families.joyimage", ("JoyImageEditTransformer3DModel",)),
    "krea2": ("toma.adapters.families.krea2", ("Krea2Transformer2DModel",)),
    "bria-fibo": ("toma.adapters.families.bria_fibo", ("BriaFiboTransformer2DModel",)),
    "zimage": ("toma.adapters.families.zimage", ("ZImageTransformer2DModel",)),
    "hidream": ("toma.adapters.families.hidream", ("HiDreamImageTransformer2DModel",)),
    "framepack": ("toma.adapters.families.framepack", ("HunyuanVideoFramepackTransformer3DModel",)),
    "helios": ("toma.adapters.families.helios", ("HeliosTransformer3DModel",)),
    "minimax-h3": ("toma.adapters.families.minimax_h3", ("MiniMaxH3Transformer3DModel",)),
    "ideogram4": ("toma.adapters.families.ideogram4", ("Ideogram4Transformer2DModel",)),
    "kandinsky5": ("toma.adapters.families.kandinsky5", ("Kandinsky5Transformer3DModel",)),
    "ernie-image": ("toma.adapters.families.ernie_image", ("ErnieImageTransformer2DModel",)),
    "lumina2": ("toma.adapters.families.lumina2", ("Lumina2Transformer2DModel",)),
    "qwenimage21": ("toma.adapters.families.qwenimage21", ("QwenImage21Transformer2DModel",)),
    "flux3": ("toma.adapters.families.flux3", ("Flux3Transformer2DModel",)),
    "chronoedit": ("toma.adapters.families.chronoedit", ("ChronoEditTransformer3DModel",)),
    "cogview4": ("toma.adapters.families.cogview4", ("CogView4Transformer2DModel",)),
    "mochi": ("toma.adapters.families.mochi", ("MochiTransformer3DModel",)),
}


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
    names = {cls.__name__ for cls in type(model).__mro__}
    for name, (module, classes) in FAMILIES.items():
        if names.intersection(classes):
            family = importlib.import_module(module)
            # the engine loads with the first family found, not with the registry
            from toma.adapters.engine import EngineAdapter

            return name, EngineAdapter(family.SPEC, getattr(family, "QUIRKS", None))
    unet = importlib.import_module("toma.adapters.unet")
    return ("unet", unet) if unet.matches(model) else None
