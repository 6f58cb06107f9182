"""Chroma: Flux's blocks and block replacement, with a modulation of its own."""

from dataclasses import replace

from toma.comfyui import hooks
from toma.comfyui.families.flux import FAMILY as FLUX

FAMILY = replace(FLUX, name="chroma", classes=(hooks.CHROMA,), needs=hooks.CHROMA_NEEDS, label="Chroma")
