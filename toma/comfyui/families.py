"""ComfyUI model families, one short record each: which denoiser class, how toma merges
there, or why it does not.

A family is found from the class of ``model.model.diffusion_model``, compared by name
(module and qualified name), so that importing this module imports nothing of ComfyUI and
a subclass (another architecture built on a family's class) is never taken for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toma.comfyui import hooks


@dataclass(frozen=True)
class ComfyFamily:
    """One ComfyUI denoiser family.

    Attributes:
        name: short name, shown in logs and errors.
        classes: the denoiser classes, ``"module:QualName"``.
        hook: how toma merges: ``"flux_blocks"`` / ``"hunyuan_blocks"`` / ``"qwen_blocks"``
            (block replacement around Flux's, HunyuanVideo's or Qwen-Image's joint blocks),
            ``"wan_blocks"``
            (block replacement around Wan's blocks), ``"nextdit_layers"`` (object patches
            on NextDiT's main layers) or ``"unet_attn1"`` (attn1 patches in the UNet's
            transformer blocks); None where it is refused.
        reason: why the family is refused (one line naming the missing hook), or None.
        needs: the ComfyUI hooks the family's merging needs (:mod:`toma.comfyui.hooks`).
        patch: latent pixels per token side (the denoiser's patchify).
        reference: image tokens of the family's reference frame, which ``tile_size`` "auto"
            scales tiles to (None: 4x4 tiles always).
        stacks: the block stacks the ``blocks`` input may name, with what each indexes.
        label: the family's name in messages (default: ``name``).
    """

    name: str
    classes: tuple[str, ...]
    hook: str | None = None
    reason: str | None = None
    needs: tuple[hooks.Need, ...] = ()
    patch: int = 1
    reference: int | None = None
    stacks: dict[str, str] = field(default_factory=dict)
    label: str = ""

    @property
    def title(self) -> str:
        """The family's name in messages."""
        return self.label or self.name

    @property
    def merges(self) -> bool:
        """Whether toma merges this family in ComfyUI."""
        return self.hook is not None


_BLOCK_REPLACE_TODO = (
    "has ComfyUI's block replacement (patches_replace['dit']), but toma's ComfyUI node does not "
    "merge it yet; only Flux, Chroma, SD3, Wan, HunyuanVideo, Qwen-Image, Z-Image and the SD/SDXL UNet merge "
    "in this version"
)

FAMILIES: tuple[ComfyFamily, ...] = (
    ComfyFamily(
        "flux",
        (hooks.FLUX,),  # Flux.1 dev/schnell/Kontext and Flux.2 share this class
        hook="flux_blocks",
        needs=hooks.FLUX_NEEDS,
        patch=2,
        reference=64 * 64,  # 1024x1024 pixels
        stacks={"double": "double-stream blocks", "single": "single-stream blocks"},
        label="Flux",
    ),
    ComfyFamily(
        "unet",
        (hooks.UNET,),  # SD 1.x, 2.x and SDXL
        hook="unet_attn1",
        needs=hooks.UNET_NEEDS,
        stacks={"levels": "attention levels, 1 = the highest resolution with self-attention"},
        label="the SD/SDXL UNet",
    ),
    ComfyFamily(
        "chroma",
        (hooks.CHROMA,),
        hook="flux_blocks",  # Flux's blocks and block replacement, its own modulation
        needs=hooks.CHROMA_NEEDS,
        patch=2,
        reference=64 * 64,  # 1024x1024 pixels
        stacks={"double": "double-stream blocks", "single": "single-stream blocks"},
        label="Chroma",
    ),
    ComfyFamily(
        "sd3",
        (hooks.SD3,),  # SD3 and SD3.5
        hook="sd3_blocks",
        needs=hooks.SD3_NEEDS,
        patch=2,
        reference=64 * 64,  # 1024x1024 pixels
        stacks={"blocks": "joint blocks"},
        label="SD3",
    ),
    ComfyFamily(
        "wan",
        (hooks.WAN,),  # Wan 2.1 / 2.2 T2V and I2V; subclasses (VACE, Camera, ...) are not taken for it
        hook="wan_blocks",
        needs=hooks.WAN_NEEDS,
        patch=2,
        reference=30 * 52,  # 480x832 pixels
        stacks={"blocks": "transformer blocks"},
        label="Wan",
    ),
    ComfyFamily(
        "hunyuanvideo",
        (hooks.HUNYUAN_VIDEO,),  # HunyuanVideo (T2V; I2V's guiding frame runs unmerged) and 1.5
        hook="hunyuan_blocks",
        needs=hooks.HUNYUAN_NEEDS,
        patch=2,
        reference=45 * 80,  # 720x1280 pixels
        stacks={"double": "double-stream blocks", "single": "single-stream blocks"},
        label="HunyuanVideo",
    ),
    ComfyFamily(
        "qwenimage",
        (hooks.QWEN_IMAGE,),  # Qwen-Image and Edit (references pass whole)
        hook="qwen_blocks",
        needs=hooks.QWEN_NEEDS,
        patch=2,
        reference=64 * 64,  # 1024x1024 pixels
        stacks={"blocks": "transformer blocks"},
        label="Qwen-Image",
    ),
    ComfyFamily(
        "ltx",
        ("comfy.ldm.lightricks.model:LTXVModel", "comfy.ldm.lightricks.av_model:LTXAVModel"),
        reason=f"LTX-Video {_BLOCK_REPLACE_TODO}",
    ),
    ComfyFamily(
        "zimage",
        (hooks.NEXTDIT,),  # Z-Image and Lumina 2; the pixel-space subclass is not taken for it
        hook="nextdit_layers",  # object patches on the main layers: NextDiT has no block replacement
        needs=hooks.NEXTDIT_NEEDS,
        patch=2,
        reference=64 * 64,  # 1024x1024 pixels
        stacks={"layers": "main layers (the refiners never merge)"},
        label="Z-Image",
    ),
)


def class_name(cls: type) -> str:
    """``"module:QualName"`` of a class."""
    return f"{cls.__module__}:{cls.__qualname__}"


def family_of(diffusion_model: object) -> ComfyFamily | None:
    """The family of a ComfyUI denoiser (``model.model.diffusion_model``), or None for a
    class toma does not know."""
    name = class_name(type(diffusion_model))
    for family in FAMILIES:
        if name in family.classes:
            return family
    return None


def supported() -> list[dict[str, object]]:
    """Every ComfyUI family toma knows: ``name``, ``classes``, ``merges`` and, where it does
    not merge, ``reason``."""
    return [{"name": f.name, "classes": list(f.classes), "merges": f.merges, "reason": f.reason} for f in FAMILIES]
