"""The ComfyUI node: ``ToMA Token Merging``, MODEL in, patched MODEL out.

ComfyUI finds nodes through ``NODE_CLASS_MAPPINGS``; the thin folder ``comfyui_toma`` that
goes into ``custom_nodes/`` re-exports the two mappings below. Importing this module
imports nothing of ComfyUI: the work happens in :func:`toma.comfyui.patch.patch_model`.
"""

from __future__ import annotations

from typing import Any

from toma.comfyui.patch import MLP_CHOICES, patch_model


class ToMAModel:
    """ComfyUI node class: merge image tokens of a MODEL with ToMA (a patched clone)."""

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:  # noqa: N802  (ComfyUI's name)
        """The node's inputs, in ComfyUI's schema."""
        return {
            "required": {
                "model": (
                    "MODEL",
                    {"tooltip": "The model to merge; a patched clone comes out, the input is unchanged."},
                ),
                "ratio": (
                    "FLOAT",
                    {
                        "default": 0.5,
                        "min": 0.0,
                        "max": 0.95,
                        "step": 0.05,
                        "tooltip": "Fraction of image tokens merged away before each merged block.",
                    },
                ),
            },
            "optional": {
                "tile_size": (
                    "INT",
                    {
                        "default": 0,
                        "min": 0,
                        "max": 64,
                        "tooltip": "Tile side in tokens; 0 = auto (scaled to the grid).",
                    },
                ),
                "start_percent": (
                    "FLOAT",
                    {
                        "default": 0.0,
                        "min": 0.0,
                        "max": 1.0,
                        "step": 0.001,
                        "tooltip": "Merging starts at this point of the schedule (0 = the first step).",
                    },
                ),
                "end_percent": (
                    "FLOAT",
                    {
                        "default": 1.0,
                        "min": 0.0,
                        "max": 1.0,
                        "step": 0.001,
                        "tooltip": "Merging stops at this point of the schedule (1 = the last step).",
                    },
                ),
                "blocks": (
                    "STRING",
                    {
                        "default": "",
                        "tooltip": "Empty: the family's default. Else e.g. 'double:5-18 single:all' (Flux), "
                        "'layers:5-29' (Z-Image) or 'levels:1,2' (SD/SDXL UNet attention levels, "
                        "1 = highest resolution).",
                    },
                ),
                "merge_mlp": (
                    list(MLP_CHOICES),
                    {
                        "default": "auto",
                        "tooltip": "Merge the MLP's tokens too: auto = the family's way; on or off is refused "
                        "where the family's hook cannot honour it.",
                    },
                ),
                "proportional_attention": (
                    "BOOLEAN",
                    {"default": True, "tooltip": "Weigh each merged key by the number of tokens it stands for."},
                ),
            },
        }

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "advanced/model"
    DESCRIPTION = "ToMA token merging: fewer image tokens through attention (and the MLP where the hook allows)."

    def patch(self, model: Any, ratio: float, **optional: Any) -> tuple[Any]:
        """The node's function: the patched clone of ``model``."""
        return (patch_model(model, ratio, **optional),)


NODE_CLASS_MAPPINGS = {"ToMAModel": ToMAModel}
NODE_DISPLAY_NAME_MAPPINGS = {"ToMAModel": "ToMA Token Merging"}
