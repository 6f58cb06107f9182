"""The built-in pretrained image DiT: a tiny class-conditional Flux transformer on digits.

A diffusers :class:`~diffusers.FluxTransformer2DModel` (dual-stream then single-stream
blocks with rotary positions: toma's Flux merge path) trained by
``scripts/train_builtin_dit.py`` on the same 32 x 32 grey-scale digits as the built-in UNet,
in pixel space with patch size 1, so every block attends over 32 x 32 = 1024 image tokens.

* Tokens: pixel ``(r, c)`` is image token ``32 r + c``; its input features are the 3 x 3
  neighbourhood of the pixel (``F.unfold``, zero padding), its output is the pixel's
  velocity. The neighbourhood is a stride-1 "patch" that gives the first block local
  structure to work with; the token count and layout stay those of patch size 1.
* Positions: Flux image ids ``(0, r, c)``; the class tokens have ids ``(0, 0, 0)``.
* Class conditioning, no text encoder: each class (and a "null" class used by
  classifier-free guidance) owns a learned sequence of ``COND_TOKENS`` "text" tokens
  (``encoder_hidden_states``) and a learned vector (``pooled_projections``, which
  modulates every block through the time embedding).
* Objective: rectified flow as in Flux. ``x_t = (1 - t) x_0 + t eps`` with images
  ``x_0`` in ``[-1, 1]``; the transformer predicts the velocity ``eps - x_0`` from ``x_t`` and
  ``t`` in ``[0, 1]`` (Flux scales the timestep by 1000 inside). Sampling integrates from
  ``t = 1`` to ``t = 0`` with Euler steps on a uniform grid.

Files under ``toma/tools/builtin/digits-dit/``:

- ``transformer/``: the Flux transformer (``save_pretrained`` layout, float16 weights,
  loaded as float32);
- ``class_embeddings.safetensors``: ``tokens`` ``(11, COND_TOKENS, COND_DIM)`` and
  ``pooled`` ``(11, COND_DIM)``; row 10 is the null class;
- ``metadata.json``: training settings and measured metrics.

The digit classifier used to score samples is the UNet's (``../classifier.safetensors``).

Usage::

    from toma.tools.builtin.dit import load_dit, sample
    model = load_dit()
    images = sample(model, labels=[0, 1, 2], seeds=[0, 1, 2], steps=20)  # (3, 1, 32, 32)
    toma.apply_toma(model.transformer, ratio=0.5)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from toma.tools.builtin.unet import (
    BUILTIN_DIR,
    IMAGE_SIZE,
    NULL_CLASS,
    DigitClassifier,
    initial_noise,
    sampling_arguments,
)

DIT_DIR = BUILTIN_DIR / "digits-dit"
COND_TOKENS = 4  # class "text" tokens per class
COND_DIM = 64  # width of the class tokens and of the pooled class vector
STEM_KERNEL = 3  # each pixel token sees its STEM_KERNEL x STEM_KERNEL neighbourhood

# Architecture of the built-in DiT; the training script builds it from this dict so the
# shipped config and the code cannot drift apart.
TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": STEM_KERNEL * STEM_KERNEL,
    "out_channels": 1,
    "num_layers": 2,  # dual-stream (MMDiT) blocks
    "num_single_layers": 4,
    "attention_head_dim": 64,
    "num_attention_heads": 2,
    "joint_attention_dim": COND_DIM,
    "pooled_projection_dim": COND_DIM,
    "guidance_embeds": False,
    # rotary dims per id axis (unused, row, column); they must sum to attention_head_dim
    "axes_dims_rope": (16, 24, 24),
}


@dataclass
class BuiltinDiT:
    """Everything needed to sample from and score the built-in DiT.

    Attributes:
        transformer: the :class:`~diffusers.FluxTransformer2DModel` (float32, eval mode).
        class_tokens: ``(11, COND_TOKENS, COND_DIM)`` class "text" tokens; row 10 is null.
        class_pooled: ``(11, COND_DIM)`` pooled class vectors; row 10 is null.
        classifier: the built-in digit classifier, for accuracy.
        metadata: training settings and metrics recorded by the training script.
    """

    transformer: Any
    class_tokens: torch.Tensor
    class_pooled: torch.Tensor
    classifier: DigitClassifier
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def guidance_scale(self) -> float:
        """Classifier-free guidance scale recommended by the training run."""
        return float(self.metadata.get("guidance_scale", 2.0))


def dit_available(path: Path | str = DIT_DIR) -> bool:
    """Whether the trained DiT files are present under ``path``."""
    path = Path(path)
    return (path / "transformer" / "config.json").is_file() and (path / "class_embeddings.safetensors").is_file()


def load_dit(path: Path | str = DIT_DIR, classifier_path: Path | str | None = None) -> BuiltinDiT:
    """Load the built-in DiT from ``path`` (default: the copy inside the package).

    ``classifier_path`` defaults to ``classifier.safetensors`` in the folder above ``path``
    (where the package keeps it), falling back to the package's copy.
    Returns a :class:`BuiltinDiT` in float32, eval mode, on CPU. Raises
    ``FileNotFoundError`` when the files are missing.
    """
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file

    path = Path(path)
    if not dit_available(path):
        raise FileNotFoundError(
            f"built-in DiT files not found under {path}; reinstall toma-diffusion or "
            "recreate them with `python scripts/train_builtin_dit.py`"
        )
    transformer = FluxTransformer2DModel.from_pretrained(path / "transformer", torch_dtype=torch.float32)
    transformer.eval().requires_grad_(False)
    embeddings = load_file(str(path / "class_embeddings.safetensors"))
    if classifier_path is None:
        classifier_path = path.parent / "classifier.safetensors"
        if not Path(classifier_path).is_file():
            classifier_path = BUILTIN_DIR / "classifier.safetensors"
    classifier = DigitClassifier()
    classifier.load_state_dict(load_file(str(classifier_path)))
    classifier.eval().requires_grad_(False)
    metadata: dict[str, Any] = {}
    if (path / "metadata.json").is_file():
        with open(path / "metadata.json", encoding="utf-8") as fh:
            metadata = json.load(fh)
    return BuiltinDiT(
        transformer=transformer,
        class_tokens=embeddings["tokens"].float(),
        class_pooled=embeddings["pooled"].float(),
        classifier=classifier,
        metadata=metadata,
    )


def image_ids(size: int = IMAGE_SIZE) -> torch.Tensor:
    """Flux position ids ``(size * size, 3)`` of the raster-ordered pixel tokens: ``(0, row, col)``."""
    rows, cols = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()


def text_ids(count: int = COND_TOKENS) -> torch.Tensor:
    """Flux position ids ``(count, 3)`` of the class tokens: all zero, as for Flux's text."""
    return torch.zeros(count, 3)


def pack(images: torch.Tensor) -> torch.Tensor:
    """Pixel tokens ``(B, H * W, STEM_KERNEL**2)`` of images ``(B, 1, H, W)``, raster order.

    Token ``r * W + c`` holds the neighbourhood of pixel ``(r, c)`` (zero outside the image).
    """
    b, _, h, w = images.shape
    cols = F.unfold(images, STEM_KERNEL, padding=STEM_KERNEL // 2)  # (B, k*k, H*W)
    return cols.transpose(1, 2).reshape(b, h * w, STEM_KERNEL * STEM_KERNEL)


def unpack(tokens: torch.Tensor, size: int = IMAGE_SIZE) -> torch.Tensor:
    """Images ``(B, 1, size, size)`` from raster-ordered one-channel tokens ``(B, size * size, 1)``."""
    return tokens.transpose(1, 2).reshape(tokens.shape[0], 1, size, size)


def velocity(
    transformer: Any,
    x: torch.Tensor,
    t: torch.Tensor,
    tokens: torch.Tensor,
    pooled: torch.Tensor,
) -> torch.Tensor:
    """Predicted velocity ``(B, 1, S, S)`` at noisy images ``x`` ``(B, 1, S, S)`` and times ``t`` ``(B,)``.

    ``tokens`` ``(B, COND_TOKENS, COND_DIM)`` and ``pooled`` ``(B, COND_DIM)`` are the rows of
    the class embeddings for each image. Shared by training and sampling so both feed the
    transformer identically.
    """
    size = x.shape[-1]
    out = transformer(
        hidden_states=pack(x),
        encoder_hidden_states=tokens,
        pooled_projections=pooled,
        timestep=t,
        img_ids=image_ids(size).to(x.device),
        txt_ids=text_ids(tokens.shape[1]).to(x.device),
    ).sample
    return unpack(out.to(x.dtype), size)


def time_grid(steps: int) -> torch.Tensor:
    """Euler integration times ``(steps + 1,)``: uniform from 1 (noise) down to 0 (image)."""
    return torch.linspace(1.0, 0.0, steps + 1)


@torch.no_grad()
def sample(
    model: BuiltinDiT,
    labels: Sequence[int] | torch.Tensor,
    seeds: Sequence[int] | int,
    steps: int = 20,
    progress: bool | str = True,
    guidance_scale: float | None = None,
    transformer: Any = None,
) -> torch.Tensor:
    """Generate digits with Euler steps on the rectified flow (deterministic).

    Args:
        model: the loaded built-in DiT.
        labels: ``B`` class labels in ``0..9``.
        seeds: one seed per image, or a single int ``s`` meaning seeds ``s, s+1, ...``; the
            starting noise is the UNet's (:func:`toma.tools.builtin.unet.initial_noise`).
        steps: number of Euler steps (>= 1), one transformer call each.
        progress: show a tqdm progress bar over the steps, labelled "denoising" or, given a
            string, with that label (``toma generate`` names the run it times).
        guidance_scale: classifier-free guidance scale; ``None`` uses the model's
            recommended value; ``1.0`` disables guidance (half the transformer batch).
        transformer: the transformer to call instead of ``model.transformer``.

    Returns:
        Images ``(B, 1, 32, 32)`` in ``[0, 1]``, float32.
    """
    from tqdm.auto import tqdm

    labels, seeds = sampling_arguments(labels, seeds, steps)
    transformer = model.transformer if transformer is None else transformer
    scale = model.guidance_scale if guidance_scale is None else float(guidance_scale)
    guided = scale != 1.0

    rows = torch.cat([torch.full_like(labels, NULL_CLASS), labels]) if guided else labels
    tokens, pooled = model.class_tokens[rows], model.class_pooled[rows]
    times = time_grid(steps)
    x = initial_noise(seeds)
    label = progress if isinstance(progress, str) else "denoising"
    for i in tqdm(range(steps), desc=label, disable=not progress, leave=False):
        inp = torch.cat([x, x]) if guided else x
        v = velocity(transformer, inp, times[i].expand(inp.shape[0]), tokens, pooled)
        if guided:
            v_u, v_c = v.chunk(2)
            v = v_u + scale * (v_c - v_u)
        x = x + (times[i + 1] - times[i]) * v
    return ((x + 1.0) / 2.0).clamp(0.0, 1.0)
