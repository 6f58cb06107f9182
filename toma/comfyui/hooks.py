"""Every ComfyUI internal that toma's ComfyUI node relies on, in one place, and their detection.

ComfyUI has no stable plugin API for what toma does: the node uses its public patch API
(``ModelPatcher`` patches, wrappers, ``transformer_options``), whose names and calling
conventions change between releases. They are all named here, so that a ComfyUI that moved
one of them is caught in one place, and checked by feature (is the method there, does it
take these parameters, does the forward read this patch) rather than by version number:
forks and nightlies carry version strings that say little about their hooks.

Tested against ComfyUI 0.33.0. Nothing here imports ComfyUI until a check runs.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

TESTED_VERSION = "0.33.0"

# classes, as "module:qualified.name"
MODEL_PATCHER = "comfy.model_patcher:ModelPatcher"
WRAPPERS = "comfy.patcher_extension:WrappersMP"
FLUX = "comfy.ldm.flux.model:Flux"
FLUX_DOUBLE_BLOCK = "comfy.ldm.flux.layers:DoubleStreamBlock"
FLUX_SINGLE_BLOCK = "comfy.ldm.flux.layers:SingleStreamBlock"
FLUX_MODULATION_OUT = "comfy.ldm.flux.layers:ModulationOut"
WAN = "comfy.ldm.wan.model:WanModel"
WAN_BLOCK = "comfy.ldm.wan.model:WanAttentionBlock"
CHROMA = "comfy.ldm.chroma.model:Chroma"
SD3 = "comfy.ldm.modules.diffusionmodules.mmdit:OpenAISignatureMMDITWrapper"
HUNYUAN_VIDEO = "comfy.ldm.hunyuan_video.model:HunyuanVideo"
QWEN_IMAGE = "comfy.ldm.qwen_image.model:QwenImageTransformer2DModel"
NEXTDIT = "comfy.ldm.lumina.model:NextDiT"  # Z-Image and Lumina 2
NEXTDIT_BLOCK = "comfy.ldm.lumina.model:JointTransformerBlock"
NEXTDIT_ATTENTION = "comfy.ldm.lumina.model:JointAttention"
LTXV = "comfy.ldm.lightricks.model:LTXVModel"  # LTX-Video
LTXV_BLOCK = "comfy.ldm.lightricks.model:BasicTransformerBlock"
LTXAV = "comfy.ldm.lightricks.av_model:LTXAVModel"  # LTX-2 (audio and video)
UNET = "comfy.ldm.modules.diffusionmodules.openaimodel:UNetModel"
UNET_DOWNSAMPLE = "comfy.ldm.modules.diffusionmodules.openaimodel:Downsample"
SPATIAL_TRANSFORMER = "comfy.ldm.modules.attention:SpatialTransformer"
TRANSFORMER_BLOCK = "comfy.ldm.modules.attention:BasicTransformerBlock"
WRAP_ATTN = "comfy.ldm.modules.attention:wrap_attn"
BASE_MODEL = "comfy.model_base:BaseModel"
CFG_GUIDER = "comfy.samplers:CFGGuider"

# ModelPatcher's methods toma calls, with the parameters it passes them
PATCHER_METHODS: dict[str, tuple[str, ...]] = {
    "clone": (),
    "get_model_object": ("name",),
    "set_model_patch_replace": ("patch", "name", "block_name", "number"),
    "set_model_attn1_patch": ("patch",),
    "set_model_attn1_output_patch": ("patch",),
    "add_wrapper_with_key": ("wrapper_type", "key", "wrapper"),
}
OBJECT_PATCH = "add_object_patch"  # (name, obj): Z-Image's layers only
# ModelPatcher attributes read, and the model object toma asks it for
PATCHER_MODEL = "model"  # the BaseModel, whose .diffusion_model is the denoiser
DIFFUSION_MODEL = "diffusion_model"
MODEL_SAMPLING = "model_sampling"  # get_model_object name; has percent_to_sigma(percent)
PERCENT_TO_SIGMA = "percent_to_sigma"
MODEL_OPTIONS = "model_options"
PATCHER_WRAPPERS = "wrappers"  # {wrapper kind: {key: [wrapper, ...]}}, as add_wrapper_with_key fills it

# denoiser attributes read
UNET_INPUT_BLOCKS = "input_blocks"
DOUBLE_BLOCKS = "double_blocks"  # Flux, HunyuanVideo
SINGLE_BLOCKS = "single_blocks"
WAN_BLOCKS = "blocks"
QWEN_BLOCKS = "transformer_blocks"
SD3_BLOCKS = "joint_blocks"
LTX_BLOCKS = "transformer_blocks"
LTX_PATCHIFIER = "patchifier"  # its patch_size: (frames, height, width) latent pixels per token
NEXTDIT_LAYERS = "layers"  # the main layers; object patches replace them under this path
NEXTDIT_PAD_MULTIPLE = "pad_tokens_multiple"  # None (Lumina 2) or 32 (Z-Image)
PATCH_SIZE = "patch_size"
MODULATION_SHIFT = "shift"  # a field of Flux's ModulationOut records

# the args a block replacement gets (and passes to "original_block")
ARG_IMG = "img"
ARG_TXT = "txt"
ARG_PE = "pe"
ARG_VEC = "vec"
ARG_FLUX_MASK = "attn_mask"
ARG_HUNYUAN_MASK = "attention_mask"
ARG_HUNYUAN_SPANS = ("modulation_dims_img", "modulation_dims")  # modulation addressed by position
ARG_LTX_SELF_MASK = "self_attention_mask"  # LTX's guide attenuation: a mask over the video's tokens

# keyword arguments of ComfyUI's attention functions, as an override receives them
ATTN_MASK = "mask"
ATTN_SKIP_RESHAPE = "skip_reshape"

# what an OUTER_SAMPLE wrapper reads of the run it wraps: the executor's class_obj is the
# guider, whose model_patcher is the model being sampled (with every node's object patches)
EXECUTOR_CLASS_OBJ = "class_obj"
GUIDER_PATCHER = "model_patcher"
WRAPPER_EXECUTOR = "comfy.patcher_extension:WrapperExecutor"

# wrapper kinds (attributes of WrappersMP)
OUTER_SAMPLE = "OUTER_SAMPLE"  # once per sampling run: toma resets and logs there
APPLY_MODEL = "APPLY_MODEL"  # once per denoiser call: x (latent), t (sigma), ... transformer_options

# transformer_options keys
TO_PATCHES = "patches"
TO_PATCHES_REPLACE = "patches_replace"
TO_IMG_SLICE = "img_slice"  # Flux single blocks: [text tokens, all tokens]
TO_ATTENTION_OVERRIDE = "optimized_attention_override"
TO_MULTIGPU_DEVICE = "multigpu_thread_device"  # set on each device's share of a multi-GPU CFG split
TO_TRANSFORMER_OPTIONS = "transformer_options"  # the model_options key that holds them

# patch names
DIT_REPLACE = "dit"
DOUBLE_BLOCK = "double_block"
SINGLE_BLOCK = "single_block"
ORIGINAL_BLOCK = "original_block"
ATTN1_PATCH = "attn1_patch"
ATTN1_OUTPUT_PATCH = "attn1_output_patch"

# ComfyUI's own token merging node (comfy_extras/nodes_tomesd.py): its patches are closures
# of this method, whatever module name ComfyUI loaded the file under
TOME_PATCH_QUALNAME = "TomePatchModel.execute.<locals>."

# wrapper keys toma registers under (ModelPatcher.add_wrapper_with_key)
WRAPPER_KEY = "toma"


@dataclass(frozen=True)
class Need:
    """One thing a hook needs from ComfyUI.

    Attributes:
        target: ``"module:qualname"`` of a class or function (``qualname`` may be dotted:
            ``Class.method``).
        params: parameter names the callable must accept (empty: only that it exists).
        source: strings the callable's source must contain: how a forward is seen to read
            a patch (``patches_replace.get("dit"``) or to call it with the arguments toma
            expects.
        what: the hook, in words, for the refusal message.
    """

    target: str
    what: str
    params: tuple[str, ...] = ()
    source: tuple[str, ...] = ()


def resolve(target: str) -> Any:
    """The object named ``"module:qualname"``; raises ImportError or AttributeError."""
    module, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def problem(need: Need) -> str | None:
    """Why ``need`` is not met by the ComfyUI that is imported, or None where it is."""
    try:
        obj = resolve(need.target)
    except (ImportError, AttributeError) as e:
        return f"{need.what}: {need.target} is missing ({e})"
    if need.params:
        try:
            names = set(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            return f"{need.what}: the signature of {need.target} cannot be read"
        missing = [p for p in need.params if p not in names]
        if missing:
            return f"{need.what}: {need.target} takes no {', '.join(missing)} (signature changed)"
    if need.source:
        try:
            text = inspect.getsource(obj)
        except (OSError, TypeError):
            return f"{need.what}: the source of {need.target} cannot be read to check the hook"
        missing = [s for s in need.source if s not in text]
        if missing:
            return f"{need.what}: {need.target} no longer contains {missing[0]!r} (the hook changed)"
    return None


def first_problem(needs: tuple[Need, ...]) -> str | None:
    """The first unmet need's message, or None where every one is met."""
    for need in needs:
        found = problem(need)
        if found is not None:
            return found
    return None


# what every family needs: the patcher's methods, and the wrappers toma runs in
COMMON: tuple[Need, ...] = (
    *(
        Need(f"{MODEL_PATCHER}.{name}", f"ModelPatcher.{name}", params=("self", *params))
        for name, params in PATCHER_METHODS.items()
    ),
    Need(f"{WRAPPERS}.{OUTER_SAMPLE}", "the OUTER_SAMPLE wrapper"),
    Need(f"{WRAPPERS}.{APPLY_MODEL}", "the APPLY_MODEL wrapper"),
    # where ComfyUI runs them: apply_model(x, t, ...) with t the sigma, and the guider's sample
    Need(
        f"{BASE_MODEL}.apply_model",
        "the APPLY_MODEL wrapper's call",
        params=("x", "t", "transformer_options"),
        source=(f"WrappersMP.{APPLY_MODEL}",),
    ),
    Need(
        f"{CFG_GUIDER}.sample",
        "the OUTER_SAMPLE wrapper's call",
        source=(f"WrappersMP.{OUTER_SAMPLE}", f"self.{GUIDER_PATCHER}"),
    ),
    Need(f"{WRAPPER_EXECUTOR}.__init__", "the wrapped object of a wrapper", params=("self", EXECUTOR_CLASS_OBJ)),
    Need(f"{BASE_MODEL}._apply_model", "the sigma passed to apply_model", source=("sigma = t",)),
    # a patcher's wrappers reach transformer_options when sampling prepares the model
    Need(
        "comfy.sampler_helpers:prepare_model_patcher",
        "the patcher's wrappers in transformer_options",
        source=('setdefault("wrappers", {}), model.wrappers',),
    ),
)

# core's multi-GPU CFG split: each device's share of a batch runs in a thread of its own,
# marked in its transformer_options, through the same patched clone (toma steps aside there)
MULTIGPU_NEEDS: tuple[Need, ...] = (
    Need(
        "comfy.samplers:_calc_cond_batch_multigpu",
        "the multi-GPU CFG split's mark on each device's call",
        source=(f'transformer_options["{TO_MULTIGPU_DEVICE}"] = device',),
    ),
)

# Flux: block replacement around each double and single block, whose args carry pe and
# attn_mask through to the original block
FLUX_NEEDS: tuple[Need, ...] = (
    Need(
        f"{FLUX}.forward_orig",
        "Flux's block replacement (patches_replace['dit'])",
        params=("img", "img_ids", "txt", "txt_ids", "transformer_options"),
        source=(
            f'patches_replace.get("{DIT_REPLACE}"',
            f'("{DOUBLE_BLOCK}", i)',
            f'("{SINGLE_BLOCK}", i)',
            f'"{ORIGINAL_BLOCK}"',
            'args["pe"]',
            'args.get("attn_mask")',
            f'"{TO_IMG_SLICE}"',
        ),
    ),
    Need(f"{FLUX_DOUBLE_BLOCK}.forward", "Flux's double block", params=("img", "txt", "vec", "pe", "attn_mask")),
    Need(f"{FLUX_SINGLE_BLOCK}.forward", "Flux's single block", params=("x", "vec", "pe", "attn_mask")),
)

# Chroma: Flux's block replacement, args and [text; image] single blocks
CHROMA_NEEDS: tuple[Need, ...] = (
    Need(
        f"{CHROMA}.forward_orig",
        "Chroma's block replacement (patches_replace['dit'])",
        params=("img", "img_ids", "txt", "txt_ids", "transformer_options"),
        source=FLUX_NEEDS[0].source,
    ),
)

# SD3 / SD3.5: joint blocks replaced under ("double_block", i); no rotary table (positions
# are added before the blocks); joint attention over [context; x]
SD3_NEEDS: tuple[Need, ...] = (
    Need(
        "comfy.ldm.modules.diffusionmodules.mmdit:MMDiT.forward_core_with_concat",
        "SD3's block replacement (patches_replace['dit'])",
        source=(
            f'patches_replace.get("{DIT_REPLACE}"',
            f'("{DOUBLE_BLOCK}", i)',
            f'"{ORIGINAL_BLOCK}"',
            'args["txt"], args["img"], c=args["vec"]',
        ),
    ),
    Need(
        "comfy.ldm.modules.diffusionmodules.mmdit:_block_mixing",
        "SD3's joint attention",
        source=("torch.cat((context_qkv[t], x_qkv[t]), dim=1)", "transformer_options=transformer_options"),
    ),
)

# HunyuanVideo: block replacement as Flux's, its mask under "attention_mask"
HUNYUAN_NEEDS: tuple[Need, ...] = (
    Need(
        f"{HUNYUAN_VIDEO}.forward_orig",
        "HunyuanVideo's block replacement (patches_replace['dit'])",
        params=("img", "img_ids", "txt", "txt_ids", "transformer_options"),
        source=(
            f'patches_replace.get("{DIT_REPLACE}"',
            f'("{DOUBLE_BLOCK}", i)',
            f'("{SINGLE_BLOCK}", i)',
            f'"{ORIGINAL_BLOCK}"',
            'pe=args["pe"]',
            'attn_mask=args["attention_mask"]',
            f'"{TO_IMG_SLICE}"',
            "img = torch.cat((txt, img), 1)",
        ),
    ),
)

# Qwen-Image: joint blocks replaced under ("double_block", i), [text; image] in attention
QWEN_NEEDS: tuple[Need, ...] = (
    Need(
        f"{QWEN_IMAGE}._forward",
        "Qwen-Image's block replacement (patches_replace['dit'])",
        params=("x", "timesteps", "context", "transformer_options"),
        source=(
            f'patches_replace.get("{DIT_REPLACE}"',
            f'("{DOUBLE_BLOCK}", i)',
            f'"{ORIGINAL_BLOCK}"',
            'image_rotary_emb=args["pe"]',
            'temb=args["vec"]',
            "ids = torch.cat((txt_ids, img_ids), dim=1)",
        ),
    ),
    Need(
        "comfy.ldm.qwen_image.model:Attention.forward",
        "Qwen-Image's joint attention",
        source=("torch.cat([txt_query, img_query], dim=2)", "transformer_options=transformer_options"),
    ),
)

# Wan: block replacement under ("double_block", i), whose args carry the rotary table
WAN_NEEDS: tuple[Need, ...] = (
    Need(
        f"{WAN}.forward_orig",
        "Wan's block replacement (patches_replace['dit'])",
        params=("x", "t", "context", "freqs", "transformer_options"),
        source=(
            f'patches_replace.get("{DIT_REPLACE}"',
            f'("{DOUBLE_BLOCK}", i)',
            f'"{ORIGINAL_BLOCK}"',
            'freqs=args["pe"]',
            'e=args["vec"]',
            '"img": x',
        ),
    ),
    Need(f"{WAN_BLOCK}.forward", "Wan's block", params=("x", "e", "freqs", "context")),
)

# LTX-Video: block replacement under ("double_block", i) around each transformer block, whose
# args carry the rotary table (a (matrix, split) pair, tokens on the matrix's dim 1), the
# timestep embedding and the guides' self-attention mask; self-attention runs first
LTXV_NEEDS: tuple[Need, ...] = (
    Need(
        f"{LTXV}._process_transformer_blocks",
        "LTX-Video's block replacement (patches_replace['dit'])",
        params=("x", "context", "attention_mask", "timestep", "pe", "transformer_options", "self_attention_mask"),
        source=(
            f'patches_replace.get("{DIT_REPLACE}"',
            f'("{DOUBLE_BLOCK}", i)',
            f'"{ORIGINAL_BLOCK}"',
            '"img": x',
            '"vec": timestep',
            '"pe": pe',
            f'"{ARG_LTX_SELF_MASK}": self_attention_mask',
        ),
    ),
    Need(
        f"{LTXV_BLOCK}.forward",
        "LTX-Video's block",
        params=("x", "context", "attention_mask", "timestep", "pe", "transformer_options", ARG_LTX_SELF_MASK),
        source=("self.attn1(norm_x, pe=pe, mask=self_attention_mask",),
    ),
    Need(f"{LTXV}._init_output_components", "LTX-Video's patchifier", source=(f"self.{LTX_PATCHIFIER} = ",)),
)

# Z-Image / Lumina 2 (NextDiT): no block replacement. Each merged main layer is replaced,
# while the model is patched, by an object patch whose copy of the layer shares its
# submodules; the layers run on [caption (padded); image; image pad], the rotary table
# (tokens on dim 1) beside it, and the layer passes the mask to its attention
NEXTDIT_NEEDS: tuple[Need, ...] = (
    Need(f"{MODEL_PATCHER}.{OBJECT_PATCH}", f"ModelPatcher.{OBJECT_PATCH}", params=("self", "name", "obj")),
    Need(
        f"{NEXTDIT}._forward",
        "NextDiT's main layers",
        params=("x", "timesteps", "context", "num_tokens", "transformer_options"),
        source=(
            f"enumerate(self.{NEXTDIT_LAYERS})",
            "layer(img, mask, freqs_cis, adaln_input, timestep_zero_index=timestep_zero_index, "
            "transformer_options=transformer_options)",
        ),
    ),
    Need(
        f"{NEXTDIT}.patchify_and_embed",
        "NextDiT's [caption; image] sequence",
        source=("torch.cat(feats + (x,), dim=1)", "torch.cat(fc + (fc_x,), dim=1)"),
    ),
    Need(
        f"{NEXTDIT}.embed_all",
        "NextDiT's image padding (after the image)",
        source=(f"pad_zimage(x, self.x_pad_token, self.{NEXTDIT_PAD_MULTIPLE})",),
    ),
    Need(
        f"{NEXTDIT_BLOCK}.forward",
        "NextDiT's layer",
        params=("x", "x_mask", "freqs_cis", "adaln_input", "timestep_zero_index", "transformer_options"),
    ),
    Need(
        f"{NEXTDIT_ATTENTION}.forward",
        "NextDiT's attention",
        source=("optimized_attention_masked(", "x_mask", "transformer_options=transformer_options"),
    ),
    Need("comfy.utils:set_attr", "object patches (set and restored by ModelPatcher)", params=("obj", "attr", "value")),
)

# SD / SDXL: attn1_patch before self-attention's projections, attn1_output_patch after
UNET_NEEDS: tuple[Need, ...] = (
    Need(
        f"{TRANSFORMER_BLOCK}.forward",
        "the UNet's attn1_patch / attn1_output_patch",
        params=("x", "context", "transformer_options"),
        source=(
            f'"{ATTN1_PATCH}"',
            "p(n, context_attn1, value_attn1, extra_options)",
            f'"{ATTN1_OUTPUT_PATCH}"',
            "p(n, extra_options)",
        ),
    ),
    Need(f"{UNET}.forward", "the UNet", params=("x", "timesteps", "context", "transformer_options")),
    Need(SPATIAL_TRANSFORMER, "the UNet's SpatialTransformer"),
    Need(UNET_DOWNSAMPLE, "the UNet's Downsample"),
)

# proportional attention on the UNet: an attention override, chained with any found
ATTENTION_OVERRIDE_NEEDS: tuple[Need, ...] = (
    Need(WRAP_ATTN, "the attention override (optimized_attention_override)", source=(f'"{TO_ATTENTION_OVERRIDE}"',)),
)
