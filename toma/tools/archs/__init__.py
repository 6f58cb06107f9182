"""Denoiser architectures for benchmarking, built from config with random weights.

Speed does not depend on the weights, so a full-size SDXL, SD 1.5 or Flux.1-dev denoiser
built from its published config times like the real one, and nothing is downloaded. The
``tiny-*`` architectures exist for tests. :func:`make_inputs` builds one denoiser call's
keyword arguments at a given image resolution.

Each arch family has a module under :mod:`toma.tools.archs.families` with its published
and tiny configs, the config keys ``--depth`` divides and its ``inputs`` builder; this
package holds the table of archs (:data:`ARCHS`) and dispatches to them. Like the
modules, it imports no torch until a model or a call is built.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
# torch loads inside the functions that build models and inputs: ``toma bench --help``
# reads ARCHS without paying for it

from toma.tools.archs.arch import Arch, Call, latent_frames
from toma.tools.archs.arch import ltx2_audio_frames as ltx2_audio_frames  # for the bench's users
from toma.tools.archs.families import (
    unet,
    flux,
    flux2,
    qwenimage,
    sd3,
    wan,
    pixart,
    ltx,
    ltx2,
    hunyuanvideo,
    cogvideox,
    krea2,
    bria_fibo,
    zimage,
    hidream,
    chroma,
    wan_vace,
    hunyuanvideo15,
    cosmos,
    minimax_h3,
    ideogram4,
    kandinsky5,
    ernie_image,
    lumina2,
    qwenimage21,
    flux3,
    helios,
    chronoedit,
    cogview4,
    mochi,
)
from toma.tools.archs.families.unet import SDXL_UNET, SD15_UNET, TINY_UNET
from toma.tools.archs.families.flux import FLUX_DEV, TINY_FLUX
from toma.tools.archs.families.flux2 import FLUX2_DEV, TINY_FLUX2
from toma.tools.archs.families.qwenimage import QWEN_IMAGE, TINY_QWEN_IMAGE
from toma.tools.archs.families.sd3 import SD35_MEDIUM, TINY_SD3
from toma.tools.archs.families.wan import WAN21_1_3B, TINY_WAN
from toma.tools.archs.families.pixart import PIXART_SIGMA
from toma.tools.archs.families.ltx import LTX_VIDEO
from toma.tools.archs.families.ltx2 import LTX2_VIDEO
from toma.tools.archs.families.hunyuanvideo import HUNYUAN_VIDEO, TINY_HUNYUAN_VIDEO
from toma.tools.archs.families.cogvideox import COGVIDEOX_5B, TINY_COGVIDEOX
from toma.tools.archs.families.krea2 import KREA2
from toma.tools.archs.families.bria_fibo import BRIA_FIBO
from toma.tools.archs.families.zimage import ZIMAGE
from toma.tools.archs.families.hidream import HIDREAM
from toma.tools.archs.families.chroma import CHROMA
from toma.tools.archs.families.wan_vace import WAN_VACE_14B
from toma.tools.archs.families.hunyuanvideo15 import HUNYUAN_VIDEO15
from toma.tools.archs.families.cosmos import COSMOS_PREDICT2_2B
from toma.tools.archs.families.minimax_h3 import MINIMAX_H3
from toma.tools.archs.families.ideogram4 import IDEOGRAM4
from toma.tools.archs.families.kandinsky5 import KANDINSKY5_LITE
from toma.tools.archs.families.ernie_image import ERNIE_IMAGE
from toma.tools.archs.families.lumina2 import LUMINA2
from toma.tools.archs.families.qwenimage21 import QWEN_IMAGE_21
from toma.tools.archs.families.flux3 import FLUX3
from toma.tools.archs.families.helios import HELIOS
from toma.tools.archs.families.chronoedit import CHRONOEDIT_14B, TINY_CHRONOEDIT
from toma.tools.archs.families.cogview4 import COGVIEW4_6B, TINY_COGVIEW4
from toma.tools.archs.families.mochi import MOCHI_1, TINY_MOCHI


# each arch family's module: its configs, DEPTH_KEYS and inputs builder (torch loads in the builder)
FAMILY_MODULES: dict[str, Any] = {
    "unet": unet,
    "flux": flux,
    "flux2": flux2,
    "qwenimage": qwenimage,
    "sd3": sd3,
    "wan": wan,
    "pixart": pixart,
    "ltx": ltx,
    "ltx2": ltx2,
    "hunyuanvideo": hunyuanvideo,
    "cogvideox": cogvideox,
    "krea2": krea2,
    "bria-fibo": bria_fibo,
    "zimage": zimage,
    "hidream": hidream,
    "chroma": chroma,
    "wan-vace": wan_vace,
    "hunyuanvideo15": hunyuanvideo15,
    "cosmos": cosmos,
    "minimax-h3": minimax_h3,
    "ideogram4": ideogram4,
    "kandinsky5": kandinsky5,
    "ernie-image": ernie_image,
    "lumina2": lumina2,
    "qwenimage21": qwenimage21,
    "flux3": flux3,
    "helios": helios,
    "chronoedit": chronoedit,
    "cogview4": cogview4,
    "mochi": mochi,
}

# the config keys that count blocks, per transformer family (what --depth divides)
DEPTH_KEYS: dict[str, tuple[str, ...]] = {
    family: module.DEPTH_KEYS for family, module in FAMILY_MODULES.items() if hasattr(module, "DEPTH_KEYS")
}


class _Stacks(Mapping):
    """The block stacks of each transformer family, in call order, which is the order of its
    DEPTH_KEYS: its spec's (:mod:`toma.adapters`), read at the first look-up of a family, as
    the spec's import needs torch. The families are DEPTH_KEYS's."""

    def __getitem__(self, family: str) -> tuple[str, ...]:
        if family not in DEPTH_KEYS:
            raise KeyError(family)
        return _spec(family).stacks

    def __contains__(self, family: object) -> bool:
        return family in DEPTH_KEYS

    def __iter__(self) -> Iterator[str]:
        return iter(DEPTH_KEYS)

    def __len__(self) -> int:
        return len(DEPTH_KEYS)


STACKS: Mapping[str, tuple[str, ...]] = _Stacks()


def _spec(family: str) -> Any:
    """The :class:`~toma.adapters.spec.FamilySpec` of a transformer family."""
    import importlib

    from toma.adapters import FAMILIES

    return importlib.import_module(FAMILIES[family][0]).SPEC


def denoiser_class(family: str) -> str:
    """The diffusers class name of a family's denoiser: the UNets', or the first its spec names."""
    return "UNet2DConditionModel" if family == "unet" else _spec(family).classes[0]


ARCHS: dict[str, Arch] = {
    "sdxl": Arch("sdxl", "unet", SDXL_UNET, 1024, 77, 2048, 1280, 8, "SDXL-base UNet", patch=1),
    "sd15": Arch("sd15", "unet", SD15_UNET, 512, 77, 768, 0, 8, "Stable Diffusion 1.5 UNet", patch=1),
    "flux": Arch("flux", "flux", FLUX_DEV, 1024, 512, 4096, 768, 8, "Flux.1-dev transformer"),
    "flux-kontext": Arch(
        "flux-kontext",
        "flux",
        FLUX_DEV,
        1024,
        512,
        4096,
        768,
        8,
        "Flux.1 Kontext transformer, editing one reference image",
        references=1,
    ),
    "tiny-unet": Arch("tiny-unet", "unet", TINY_UNET, 128, 8, 32, 0, 8, "tiny SD-like UNet (tests)", patch=1),
    "tiny-flux": Arch("tiny-flux", "flux", TINY_FLUX, 128, 8, 32, 16, 8, "tiny Flux-like transformer (tests)"),
    "tiny-flux-kontext": Arch(
        "tiny-flux-kontext",
        "flux",
        TINY_FLUX,
        128,
        8,
        32,
        16,
        8,
        "tiny Flux-like transformer with a reference image (tests)",
        references=1,
    ),
    "sd35": Arch("sd35", "sd3", SD35_MEDIUM, 1024, 333, 4096, 2048, 8, "SD3.5-Medium transformer"),
    "wan": Arch("wan", "wan", WAN21_1_3B, 480, 512, 4096, 0, 8, "Wan 2.1 T2V 1.3B transformer", 832 / 480, 81),
    "tiny-sd3": Arch("tiny-sd3", "sd3", TINY_SD3, 128, 8, 32, 16, 8, "tiny SD3-like transformer (tests)"),
    "tiny-wan": Arch("tiny-wan", "wan", TINY_WAN, 64, 8, 32, 0, 8, "tiny Wan-like transformer (tests)", 1.0, 5),
    "pixart": Arch("pixart", "pixart", PIXART_SIGMA, 1024, 300, 4096, 0, 8, "PixArt-Sigma XL 1024 transformer"),
    "ltx": Arch("ltx", "ltx", LTX_VIDEO, 512, 128, 4096, 0, 32, "LTX-Video 0.9 transformer", 768 / 512, 121, 8, 1),
    # LTX2Pipeline's defaults: 768x512, 121 frames at 24 fps, prompts padded to 1024 tokens
    "ltx2": Arch(
        "ltx2",
        "ltx2",
        LTX2_VIDEO,
        512,
        1024,
        3840,
        0,
        32,
        "LTX-2 19B transformer (video + audio)",
        768 / 512,
        121,
        8,
        1,
    ),
    "hunyuanvideo": Arch(
        "hunyuanvideo",
        "hunyuanvideo",
        HUNYUAN_VIDEO,
        720,
        256,
        4096,
        768,
        8,
        "HunyuanVideo 13B transformer",
        1280 / 720,
        129,
    ),
    "cogvideox": Arch(
        "cogvideox", "cogvideox", COGVIDEOX_5B, 480, 226, 4096, 0, 8, "CogVideoX-5B transformer", 720 / 480, 49
    ),
    "tiny-hunyuanvideo": Arch(
        "tiny-hunyuanvideo",
        "hunyuanvideo",
        TINY_HUNYUAN_VIDEO,
        64,
        8,
        32,
        16,
        8,
        "tiny HunyuanVideo-like transformer (tests)",
        1.0,
        5,
    ),
    "tiny-cogvideox": Arch(
        "tiny-cogvideox",
        "cogvideox",
        TINY_COGVIDEOX,
        64,
        8,
        32,
        0,
        8,
        "tiny CogVideoX-like transformer (tests)",
        1.0,
        5,
    ),
    # Qwen-Image's prompt embeddings are as long as the prompt (its pipeline trims the
    # padding); 128 tokens stands for a prompt of a few sentences. FLUX.2 pads to 512.
    "qwenimage": Arch("qwenimage", "qwenimage", QWEN_IMAGE, 1024, 128, 3584, 0, 8, "Qwen-Image transformer"),
    "flux3": Arch("flux3", "flux3", FLUX3, 1024, 512, 20480, 0, 8, "FLUX.3 transformer"),
    # a step after the first: the target's tokens, decoding from a cache of a 128-token prompt
    "qwenimage21": Arch(
        "qwenimage21", "qwenimage21", QWEN_IMAGE_21, 1024, 128, 4096, 0, 8, "Qwen-Image 2.1 transformer, a cached step"
    ),
    "flux2": Arch("flux2", "flux2", FLUX2_DEV, 1024, 512, 15360, 0, 8, "FLUX.2-dev transformer"),
    "tiny-qwenimage": Arch(
        "tiny-qwenimage", "qwenimage", TINY_QWEN_IMAGE, 64, 8, 32, 0, 8, "tiny Qwen-Image-like transformer (tests)"
    ),
    "tiny-flux2": Arch("tiny-flux2", "flux2", TINY_FLUX2, 64, 8, 32, 0, 8, "tiny FLUX.2-like transformer (tests)"),
    # Krea 2's pipeline pads the prompt to 512 tokens (and masks the padding); each token
    # carries 12 tapped text-encoder layers of 2560
    "krea2": Arch("krea2", "krea2", KREA2, 1024, 512, 2560, 0, 8, "Krea 2 transformer (12.9B)"),
    # FIBO's prompt is a structured JSON caption of up to 1000+ words, as long as it is:
    # 1024 tokens stands for one
    "bria-fibo": Arch("bria-fibo", "bria-fibo", BRIA_FIBO, 1024, 1024, 4096, 0, 16, "Bria FIBO transformer", patch=1),
    # the pipeline passes each prompt's own tokens (up to 512), padded to a multiple of 32: 512 stands for one
    "zimage": Arch("zimage", "zimage", ZIMAGE, 1024, 512, 2560, 0, 8, "Z-Image-Turbo transformer (6B)"),
    "lumina2": Arch("lumina2", "lumina2", LUMINA2, 1024, 256, 2304, 0, 8, "Lumina-Image 2.0 transformer (2.6B)"),
    # Chroma's pipeline pads the T5 prompt to 512 tokens, as Flux's
    "chroma": Arch("chroma", "chroma", CHROMA, 1024, 512, 4096, 0, 8, "Chroma1-HD transformer (8.9B)"),
    # the pipeline's 384x640 and chunks of 9 latent frames (33 frames), after its histories
    "helios": Arch("helios", "helios", HELIOS, 384, 512, 4096, 0, 8, "Helios transformer, a chunk", 640 / 384, 33),
    "wan-vace": Arch(
        "wan-vace", "wan-vace", WAN_VACE_14B, 480, 512, 4096, 0, 8, "Wan 2.1 VACE 14B transformer", 832 / 480, 81
    ),
    # 480p (848x480, the pipeline's 16:9), 16x VAE, 1000 MLLM + 256 ByT5 prompt tokens as padded
    # by the pipeline, text to video (its image embedding of zeros)
    "hunyuanvideo15": Arch(
        "hunyuanvideo15",
        "hunyuanvideo15",
        HUNYUAN_VIDEO15,
        480,
        1000,
        3584,
        0,
        16,
        "HunyuanVideo 1.5 480p transformer (8.3B)",
        848 / 480,
        121,
        patch=1,
    ),
    # the pipeline's 768x1360 image (Wan's 8x VAE) and T5 prompt of 512
    "cosmos": Arch(
        "cosmos", "cosmos", COSMOS_PREDICT2_2B, 768, 512, 1024, 0, 8, "Cosmos-Predict2 2B text-to-image", 1360 / 768
    ),
    # the pipeline's T5 and Llama prompts, 128 tokens each
    "hidream": Arch("hidream", "hidream", HIDREAM, 1024, 128, 4096, 2048, 8, "HiDream-I1-Full transformer (17B)"),
    # the modular pipeline's default canvas (768x1344, 16x VAE) and shortest clip (5 s at 24 fps:
    # 124 frames, 37 latent frames); the prompt is as long as it is (no padding): 256 tokens
    # stand for one
    "minimax-h3": Arch(
        "minimax-h3",
        "minimax-h3",
        MINIMAX_H3,
        768,
        256,
        5120,
        0,
        16,
        "MiniMax H3 transformer (33B, video + audio)",
        1344 / 768,
        124,
    ),
    # the pipeline's 2048px default; its conditional transformer always takes 2048 text slots
    # (max_sequence_length), a prompt's tokens left-padded to it
    "ideogram4": Arch("ideogram4", "ideogram4", IDEOGRAM4, 2048, 2048, 53248, 0, 8, "Ideogram 4 transformer (9.3B)"),
    # the T2V pipeline's 512x768 x 121 frames; its Qwen2.5-VL prompt embeddings are as long as
    # the longest prompt (up to 256 tokens): 128 stands for one of a few sentences
    "kandinsky5": Arch(
        "kandinsky5",
        "kandinsky5",
        KANDINSKY5_LITE,
        512,
        128,
        3584,
        768,
        8,
        "Kandinsky 5.0 T2V Lite transformer (2B)",
        768 / 512,
        121,
    ),
    # 1024px: the pipeline's 16x latents (the VAE's 8x, patchified 2x2 by the pipeline), one
    # token each; its Mistral3 prompt embeddings are as long as the prompt (padded to the
    # longest of a CFG batch): 128 stands for one of a few sentences
    "ernie-image": Arch(
        "ernie-image", "ernie-image", ERNIE_IMAGE, 1024, 128, 3072, 0, 16, "ERNIE-Image transformer (8B)", patch=1
    ),
    # the pipeline's 480x832 and its edit without temporal reasoning: 5 frames (2 latent: the
    # input image and the edited one); the T5 prompt padded to 512
    "chronoedit": Arch(
        "chronoedit", "chronoedit", CHRONOEDIT_14B, 480, 512, 4096, 0, 8, "ChronoEdit-14B transformer", 832 / 480, 5
    ),
    "tiny-chronoedit": Arch(
        "tiny-chronoedit",
        "chronoedit",
        TINY_CHRONOEDIT,
        64,
        512,
        32,
        0,
        8,
        "tiny ChronoEdit-like transformer (tests)",
        1.0,
        5,
    ),
    # the pipeline's 1024px; its GLM-4 prompt embeddings are as long as the prompt, padded to a
    # multiple of 16: 128 stands for one of a few sentences
    "cogview4": Arch("cogview4", "cogview4", COGVIEW4_6B, 1024, 128, 4096, 0, 8, "CogView4-6B transformer"),
    "tiny-cogview4": Arch(
        "tiny-cogview4", "cogview4", TINY_COGVIEW4, 64, 16, 32, 0, 8, "tiny CogView4-like transformer (tests)"
    ),
    # the pipeline's 480x848 x 19 frames (4 latent: its VAE keeps the first and compresses 6
    # into 1) and T5 prompt padded to 256
    "mochi": Arch(
        "mochi", "mochi", MOCHI_1, 480, 256, 4096, 0, 8, "Mochi 1 preview transformer (10B)", 848 / 480, 19, 6
    ),
    "tiny-mochi": Arch(
        "tiny-mochi", "mochi", TINY_MOCHI, 64, 8, 32, 0, 8, "tiny Mochi-like transformer (tests)", 1.0, 13, 6
    ),
}


def get_arch(name: str) -> Arch:
    """The architecture called ``name``; raises ValueError listing the known ones."""
    if name not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {name!r}")
    return ARCHS[name]


def reduced_config(family: str, config: dict[str, Any], depth: int) -> dict[str, Any]:
    """A transformer config with ``depth`` times fewer blocks in every stack (at least one each).

    Width (heads, head size, MLP) is unchanged, so every block costs what a full one costs.
    SD3.5's image-only second attention stays on the same share of the first blocks.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be an int >= 1 (1 = full depth); got {depth!r}")
    if family not in DEPTH_KEYS:
        raise ValueError(f"depth applies to transformers ({', '.join(DEPTH_KEYS)}); got depth={depth} for a {family}")
    counts = [key for key in DEPTH_KEYS[family] if not isinstance(config[key], (list, tuple))]
    out = {**config, **{key: max(1, round(config[key] / depth)) for key in counts}}
    if family == "wan-vace":  # the control blocks that join the blocks built, at the same share
        every = max(1, round(config["num_layers"] / len(config["vace_layers"])))
        out["vace_layers"] = list(range(0, out["num_layers"], every))
    if family == "hidream":  # one Llama layer's features per block built
        out["llama_layers"] = config["llama_layers"][: out["num_layers"] + out["num_single_layers"]]
    if config.get("dual_attention_layers"):
        dual = round(len(config["dual_attention_layers"]) / depth)
        out["dual_attention_layers"] = tuple(range(min(dual, out["num_layers"])))
    return out


def build_model(
    arch: Arch,
    depth: int = 1,
    model_path: str | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> torch.nn.Module:
    """Build the denoiser of ``arch`` in eval mode.

    Args:
        arch: the architecture.
        depth: transformers: build ``depth`` times fewer blocks (see :func:`reduced_config`).
        model_path: a local directory or an already-cached hub id with real weights (looked up
            without network access, in ``unet/`` or ``transformer/`` or at the top level).
            None builds random weights from ``arch.config``.
        dtype, device: where the weights live (dtype None: float32).
        seed: seed of the random weights.
    """
    import diffusers
    import torch

    dtype = torch.float32 if dtype is None else dtype

    cls = getattr(diffusers, denoiser_class(arch.family))
    if model_path is not None:
        sub = "unet" if arch.family == "unet" else "transformer"
        errors = []
        for subfolder in (sub, None):
            try:
                model = cls.from_pretrained(model_path, subfolder=subfolder, torch_dtype=dtype, local_files_only=True)
                break
            except (OSError, ValueError, EnvironmentError) as err:
                errors.append(f"{subfolder or '.'}: {err}")
        else:
            raise FileNotFoundError(
                f"no {cls.__name__} weights found at --model {model_path!r} (no download is tried): {errors}"
            )
        return model.to(device).eval()
    config = dict(arch.config)
    if depth != 1 or arch.family in DEPTH_KEYS:
        config = reduced_config(arch.family, config, depth)
    device = torch.device(device)
    forked = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked), device:
        torch.manual_seed(seed)
        # initialise where the model will run: a 12B-parameter init on the CPU alone
        # takes minutes, on a GPU seconds
        model = cls(**config)
    if dtype != torch.float32 and getattr(model, "_keep_in_fp32_modules", None):
        return model.to(dtype=dtype).eval()  # its warning is then true: those modules are cast too
    # diffusers' ModelMixin.to warns "should be kept in float32: []" at any dtype cast, even
    # when no module is to be kept or the dtype is float32; nn.Module.to casts alike, silently
    return torch.nn.Module.to(model, dtype=dtype).eval()


def make_inputs(
    arch: Arch,
    resolution: int,
    batch: int = 1,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    frames: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of one denoiser call at ``resolution`` pixels high (see :meth:`Arch.size`).

    UNet: ``sample (B, 4, R/8, R/8)``, ``encoder_hidden_states (B, L, text_dim)``, plus SDXL's
    ``added_cond_kwargs``. Flux: packed latents ``hidden_states (B, (R/16)^2, 64)``, text
    ``(B, 512, 4096)``, ``pooled_projections (B, 768)``, ``img_ids``, ``txt_ids``, ``guidance``.
    SD3: latents ``(B, 16, R/8, R/8)``, text, pooled. Wan: latents ``(B, 16, F', H/8, W/8)``
    with ``F' = (frames - 1) / 4 + 1`` latent frames (``frames`` defaults to the arch's), text.
    HunyuanVideo: the same latents, text with its (all-ones) mask, pooled, guidance.
    CogVideoX: latents ``(B, F', 16, H/8, W/8)``, text, the pipeline's rotary tables.
    Kandinsky 5: channel-last latents ``(B, F', H/8, W/8, C)``, text, pooled, rotary positions.
    ERNIE-Image: latents ``(B, 128, R/16, R/16)``, text ``text_bth`` with its ``text_lens``.
    Qwen-Image: packed latents ``(B, (R/16)^2, 64)``, text, ``img_shapes``. Flux.2: packed
    latents ``(B, (R/16)^2, 128)``, text ``(B, 512, 15360)``, 4-column ``img_ids``, ``txt_ids``.
    The timestep is a placeholder; :func:`set_timestep` changes it per step. ``dtype`` None
    means float32.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    height, width = arch.size(resolution)
    step = arch.patch * arch.vae_scale
    if height // arch.vae_scale < 2 or resolution % step:
        raise ValueError(f"resolution must be a multiple of {step} pixels; got {resolution}")
    call = Call(arch, batch, dtype, device, frames, torch.Generator().manual_seed(seed), height, width)
    return FAMILY_MODULES[arch.family].inputs(call)


def set_timestep(arch: Arch, inputs: dict[str, Any], step: int, steps: int) -> dict[str, Any]:
    """``inputs`` at denoising step ``step`` of ``steps`` (timesteps decrease, as in a sampler)."""
    import torch

    frac = 1.0 - step / max(steps, 1)
    if arch.family == "zimage":  # t = 1 - sigma: rises over a run
        return {**inputs, "t": torch.full_like(inputs["t"], 1.0 - frac)}
    if arch.family == "hidream":
        return {**inputs, "timesteps": torch.full_like(inputs["timesteps"], 999.0 * frac)}
    if arch.family == "mochi":  # its scheduler inverts the sigmas: t = 1000 (1 - sigma) rises over a run
        return {**inputs, "timestep": torch.full_like(inputs["timestep"], 1000.0 * (1.0 - frac))}
    if arch.family in ("ideogram4", "lumina2"):  # model time 1 - sigma (0 is noise): rises over a run
        return {**inputs, "timestep": torch.full_like(inputs["timestep"], 1.0 - frac)}
    t = inputs["timestep"]
    # the flow-matching transformers take the timestep in [0, 1]
    flow = ("flux", "flux2", "flux3", "qwenimage", "qwenimage21", "krea2", "chroma", "cosmos", "minimax-h3")  # [0, 1]
    value = max(frac, 1e-3) if arch.family in flow else 999.0 * frac
    return {**inputs, "timestep": torch.full_like(t, value)}


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


def token_grid(arch: Arch, resolution: int, frames: int | None = None) -> tuple[int, ...]:
    """Token grid of the first attention level: ``(h, w)`` for images (UNet at downsample 1,
    transformer image tokens), ``(t, h, w)`` for video."""
    height, width = arch.size(resolution)
    h, w = height // arch.vae_scale // arch.patch, width // arch.vae_scale // arch.patch
    return (latent_frames(arch, frames), h, w) if arch.frames else (h, w)


def block_count(config: dict[str, Any], key: str) -> int:
    """The blocks a ``DEPTH_KEYS`` entry of ``config`` counts: its value, or the length of a
    list of the blocks they join (Wan VACE's ``vace_layers``)."""
    value = config[key]
    return len(value) if isinstance(value, (list, tuple)) else value


def merged_blocks(count: int, full_count: int, skip: int = 5) -> tuple[int, ...]:
    """Merged block indices when ``count`` of ``full_count`` blocks are built: the default
    skip of the first ``skip`` blocks, scaled by ``count / full_count`` (at least one merged)."""
    skip = min(skip, full_count // 2)  # as the families' skip_first rule: at most half a stack
    scaled = min(count - 1, math.floor(skip * count / full_count + 0.5))
    return tuple(range(max(scaled, 0), count))


def default_placement(arch: Arch, model: torch.nn.Module) -> dict[str, Any]:
    """ToMA's default placement on a (possibly reduced-depth) transformer, as ``blocks``:
    the full model's skip of the first 5 blocks per stack, scaled to the blocks built."""
    if arch.family not in STACKS:
        return {}
    full = dict(zip(STACKS[arch.family], (block_count(arch.config, k) for k in DEPTH_KEYS[arch.family])))
    return {"blocks": {s: merged_blocks(len(model.get_submodule(s)), full[s]) for s in STACKS[arch.family]}}


def call_denoiser(arch: Arch, model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
    """One denoiser forward on :func:`make_inputs` arguments.

    UNets get ``sample`` and ``timestep`` positionally, as diffusers pipelines pass them
    (tomesd's hook reads the latent size from the first positional argument).
    """
    if arch.family == "unet":
        rest = {k: v for k, v in inputs.items() if k not in ("sample", "timestep")}
        return model(inputs["sample"], inputs["timestep"], return_dict=False, **rest)
    if arch.family == "bria-fibo":  # one text-encoder layer per block the model has (at --depth, fewer)
        inputs = {**inputs, "text_encoder_layers": inputs["text_encoder_layers"][: len(model.caption_projection)]}
    return model(**inputs)
