"""LTX-Video and LTX-2: refused for now; their blocks have ComfyUI's block replacement."""

from toma.comfyui.family import ComfyFamily

FAMILY = ComfyFamily(
    "ltx",
    ("comfy.ldm.lightricks.model:LTXVModel", "comfy.ldm.lightricks.av_model:LTXAVModel"),
    reason="LTX-Video has ComfyUI's block replacement (patches_replace['dit']), but toma's ComfyUI node does not "
    "merge it yet; only Flux, Chroma, SD3, Wan, HunyuanVideo, Qwen-Image, Z-Image and the SD/SDXL UNet merge "
    "in this version",
)
