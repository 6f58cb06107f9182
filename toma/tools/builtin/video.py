"""The built-in pretrained video DiT: a tiny class-conditional Wan transformer on moving digits.

A diffusers :class:`~diffusers.WanTransformer3DModel` (self-attention over the video with
3-D rotary positions, then cross-attention to "text": toma's Wan merge path) trained by
``scripts/train_builtin_video.py`` on short clips of one digit moving across a small
canvas, built from the same bundled scikit-learn digits as the other built-in models.

* Data (:func:`moving_digit_clips`): a digit shrunk to ``DIGIT_SIZE`` x ``DIGIT_SIZE``
  pixels moves over a ``FRAME_SIZE`` x ``FRAME_SIZE`` black canvas for ``FRAMES`` frames:
  random integer start, random velocity in ``{-1, 0, 1}`` pixels per frame on each axis
  (never both zero), bouncing off the edges. Integer positions keep every frame an exact
  copy of the digit, so frames differ only by where it is.
* Tokens: pixel space, patch size ``(1, 1, 1)``: every block self-attends over
  ``FRAMES x FRAME_SIZE x FRAME_SIZE = 8 x 16 x 16 = 2048`` tokens. A token's input
  features are the 3 x 3 neighbourhood of its pixel within its frame, or within its frame
  and the two next to it (``stem_frames`` 1 or 3, read off the transformer's
  ``in_channels``; :func:`pack`); its output is the pixel's velocity.
* Class conditioning, no text encoder: each class (and a "null" class used by
  classifier-free guidance) owns a learned sequence of ``COND_TOKENS`` "text" tokens of
  width ``COND_DIM`` (``encoder_hidden_states``); Wan has no pooled text vector, so the
  class reaches the video through cross-attention only.
* Objective: rectified flow, as the image DiT (:mod:`toma.tools.builtin.dit`):
  ``x_t = (1 - t) x_0 + t eps`` with clips ``x_0`` in ``[-1, 1]``; the transformer
  predicts ``eps - x_0`` from ``x_t`` and the timestep ``1000 t`` (Wan's scale). Sampling
  integrates from ``t = 1`` to ``t = 0`` with Euler steps on a uniform grid.
* Per-frame accuracy: the UNet's classifier expects digits filling a 32 x 32 frame, so
  this model ships its own frame classifier (:class:`~toma.tools.builtin.unet.DigitClassifier`
  architecture, trained by the same script on frames of real-digit clips, seeded), which
  reads a 16 x 16 frame upsampled bilinearly to 32 x 32 (:func:`classify_frames`).

Files under ``toma/tools/builtin/digits-video/``:

- ``transformer/``: the Wan transformer (``save_pretrained`` layout, float16 weights,
  loaded as float32);
- ``class_embeddings.safetensors``: ``tokens`` ``(11, COND_TOKENS, COND_DIM)``; row 10 is
  the null class;
- ``frame_classifier.safetensors``: the frame classifier;
- ``metadata.json``: training settings and measured metrics.

Usage::

    from toma.tools.builtin.video import load_video_dit, sample_video, classify_frames
    model = load_video_dit()
    clips = sample_video(model, labels=[0, 1], seeds=[0, 1], steps=20)  # (2, 8, 1, 16, 16)
    preds, _ = classify_frames(model.classifier, clips)                  # (2, 8)
    toma.apply_toma(model.transformer, ratio=0.5)                         # 2-D tiles; tile_frames=2 spans 2 frames
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
    FEATURE_DIM,
    IMAGE_SIZE,
    NULL_CLASS,
    DigitClassifier,
    classify,
    sampling_arguments,
)

VIDEO_DIR = BUILTIN_DIR / "digits-video"
FRAMES = 8
FRAME_SIZE = 16
DIGIT_SIZE = 10  # side of the moving digit; it has FRAME_SIZE - DIGIT_SIZE + 1 positions per axis
COND_TOKENS = 4
COND_DIM = 64
STEM_KERNEL = 3  # each token sees the STEM_KERNEL x STEM_KERNEL pixels around it in a frame ...
STEM_FRAMES_CHOICES = (1, 3)  # ... of its own frame only (1) or also of the frames before and after (3)

# Architecture of the built-in video DiT; the training script builds it with
# transformer_config(stem_frames) so the shipped config and the code cannot drift apart.
TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": (1, 1, 1),
    "num_attention_heads": 2,
    # width 128: at width 64 (0.44 M parameters) 900 steps left samples at chance and the
    # class all but ignored; rotary: 24 dims for the frame, 20 each for row and column
    "attention_head_dim": 64,
    "in_channels": STEM_KERNEL * STEM_KERNEL,
    "out_channels": 1,
    "text_dim": COND_DIM,
    "freq_dim": 64,
    "ffn_dim": 512,
    "num_layers": 4,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 64,
}


def transformer_config(stem_frames: int = 1) -> dict[str, Any]:
    """:data:`TRANSFORMER_CONFIG` with the input width of a ``stem_frames``-frame neighbourhood."""
    if stem_frames not in STEM_FRAMES_CHOICES:
        raise ValueError(f"stem_frames must be one of {STEM_FRAMES_CHOICES}; got {stem_frames!r}")
    return {**TRANSFORMER_CONFIG, "in_channels": stem_frames * STEM_KERNEL * STEM_KERNEL}


@dataclass
class BuiltinVideoDiT:
    """Everything needed to sample from and score the built-in video DiT.

    Attributes:
        transformer: the :class:`~diffusers.WanTransformer3DModel` (float32, eval mode).
        class_tokens: ``(11, COND_TOKENS, COND_DIM)`` class "text" tokens; row 10 is null.
        classifier: the frame classifier (reads frames through :func:`classify_frames`).
        metadata: training settings and metrics recorded by the training script.
    """

    transformer: Any
    class_tokens: torch.Tensor
    classifier: DigitClassifier
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def guidance_scale(self) -> float:
        """Classifier-free guidance scale recommended by the training run."""
        return float(self.metadata.get("guidance_scale", 2.0))

    @property
    def time_shift(self) -> float:
        """Time shift the model was trained with (:func:`shift_times`); 1.0 for none."""
        return float(self.metadata.get("time_shift", 1.0))


def video_available(path: Path | str = VIDEO_DIR) -> bool:
    """Whether the trained video DiT files are present under ``path``."""
    path = Path(path)
    return all(
        (path / name).is_file()
        for name in ("transformer/config.json", "class_embeddings.safetensors", "frame_classifier.safetensors")
    )


def load_video_dit(path: Path | str = VIDEO_DIR) -> BuiltinVideoDiT:
    """Load the built-in video DiT from ``path`` (default: the copy inside the package).

    Returns a :class:`BuiltinVideoDiT` in float32, eval mode, on CPU. Raises
    ``FileNotFoundError`` when the files are missing.
    """
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    path = Path(path)
    if not video_available(path):
        raise FileNotFoundError(
            f"built-in video DiT files not found under {path}; reinstall toma-diffusion or "
            "recreate them with `python scripts/train_builtin_video.py`"
        )
    transformer = WanTransformer3DModel.from_pretrained(path / "transformer", torch_dtype=torch.float32)
    transformer.eval().requires_grad_(False)
    classifier = DigitClassifier()
    classifier.load_state_dict(load_file(str(path / "frame_classifier.safetensors")))
    classifier.eval().requires_grad_(False)
    metadata: dict[str, Any] = {}
    if (path / "metadata.json").is_file():
        with open(path / "metadata.json", encoding="utf-8") as fh:
            metadata = json.load(fh)
    return BuiltinVideoDiT(
        transformer=transformer,
        class_tokens=load_file(str(path / "class_embeddings.safetensors"))["tokens"].float(),
        classifier=classifier,
        metadata=metadata,
    )


def shrink_digits(images: torch.Tensor, size: int = DIGIT_SIZE) -> torch.Tensor:
    """Digits ``(N, 1, size, size)`` in ``[0, 1]`` from the bundled ``(N, 1, 32, 32)`` ones (area average)."""
    return F.interpolate(images, size=(size, size), mode="area").clamp(0.0, 1.0)


def trajectories(
    count: int,
    generator: torch.Generator,
    frames: int = FRAMES,
    span: int = FRAME_SIZE - DIGIT_SIZE,
) -> torch.Tensor:
    """Top-left corners ``(count, frames, 2)`` (row, column) of bouncing digits, integers in ``[0, span]``.

    Starts are uniform over ``[0, span]^2``; velocities are uniform over ``{-1, 0, 1}^2``
    without ``(0, 0)``, so every digit moves. A step that would leave ``[0, span]``
    reverses that axis' velocity first (a bounce).
    """
    if span < 1:
        raise ValueError(f"span must be >= 1 so a digit can move; got {span}")
    pos = torch.randint(0, span + 1, (count, 2), generator=generator)
    moves = torch.tensor([(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if (dy, dx) != (0, 0)])
    vel = moves[torch.randint(0, len(moves), (count,), generator=generator)]
    out = [pos]
    for _ in range(frames - 1):
        nxt = pos + vel
        vel = torch.where((nxt < 0) | (nxt > span), -vel, vel)
        pos = pos + vel
        out.append(pos)
    return torch.stack(out, dim=1)


def render_clips(digits: torch.Tensor, corners: torch.Tensor, size: int = FRAME_SIZE) -> torch.Tensor:
    """Clips ``(N, T, 1, size, size)``: digit ``n`` ``(d x d)`` pasted at ``corners[n, t]`` on black.

    ``digits`` is ``(N, 1, d, d)`` in ``[0, 1]``; ``corners`` ``(N, T, 2)`` integer
    (row, column) top-left corners, each in ``[0, size - d]``.
    """
    n, t = corners.shape[:2]
    d = digits.shape[-1]
    if corners.min() < 0 or corners.max() > size - d:
        raise ValueError(f"corners must lie in [0, {size - d}] for a {d}-pixel digit on a {size}-pixel frame")
    clips = torch.zeros(n, t, 1, size, size, dtype=digits.dtype)
    for i in range(n):
        for j in range(t):
            r, c = corners[i, j].tolist()
            clips[i, j, :, r : r + d, c : c + d] = digits[i]
    return clips


def moving_digit_clips(
    digits: torch.Tensor, generator: torch.Generator, frames: int = FRAMES, size: int = FRAME_SIZE
) -> torch.Tensor:
    """Clips ``(N, frames, 1, size, size)`` in ``[0, 1]`` of each digit ``(N, 1, d, d)`` moving
    along a random bouncing trajectory (:func:`trajectories`) drawn from ``generator``."""
    corners = trajectories(digits.shape[0], generator, frames, size - digits.shape[-1])
    return render_clips(digits, corners, size)


def pack(clips: torch.Tensor, stem_frames: int = 1) -> torch.Tensor:
    """Wan input ``(B, stem_frames * STEM_KERNEL**2, T, H, W)`` of clips ``(B, T, 1, H, W)``.

    Channel ``j * STEM_KERNEL**2 + k`` at ``(t, r, c)`` is pixel ``k`` of the 3 x 3
    neighbourhood of ``(r, c)`` in frame ``t + j - stem_frames // 2``, zero outside the
    frame or the clip. With ``stem_frames=1`` a token sees its own frame only; with 3 it
    also sees where a digit moving 1 pixel per frame came from and goes to.
    """
    if stem_frames not in STEM_FRAMES_CHOICES:
        raise ValueError(f"stem_frames must be one of {STEM_FRAMES_CHOICES}; got {stem_frames!r}")
    b, t, _, h, w = clips.shape
    k2 = STEM_KERNEL * STEM_KERNEL
    cols = F.unfold(clips.reshape(b * t, 1, h, w), STEM_KERNEL, padding=STEM_KERNEL // 2)  # (B*T, k*k, H*W)
    cols = cols.reshape(b, t, k2, h, w)
    if stem_frames > 1:
        half = stem_frames // 2
        padded = F.pad(cols, (0, 0, 0, 0, 0, 0, half, half))  # zero frames before and after the clip
        cols = torch.cat([padded[:, j : j + t] for j in range(stem_frames)], dim=2)  # (B, T, frames*k*k, H, W)
    return cols.transpose(1, 2)


def unpack(output: torch.Tensor) -> torch.Tensor:
    """Clips ``(B, T, 1, H, W)`` from the transformer's one-channel output ``(B, 1, T, H, W)``."""
    return output.transpose(1, 2)


def velocity(transformer: Any, x: torch.Tensor, t: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Predicted velocity ``(B, T, 1, H, W)`` at noisy clips ``x`` ``(B, T, 1, H, W)``, times ``t`` ``(B,)``.

    ``tokens`` ``(B, COND_TOKENS, COND_DIM)`` are the class tokens of each clip. Shared by
    training and sampling so both feed the transformer identically.
    """
    # the input width says which neighbourhood the transformer was trained on
    stem_frames = transformer.config.in_channels // (STEM_KERNEL * STEM_KERNEL)
    out = transformer(hidden_states=pack(x, stem_frames), timestep=t * 1000.0, encoder_hidden_states=tokens).sample
    return unpack(out.to(x.dtype))


def shift_times(t: torch.Tensor, shift: float) -> torch.Tensor:
    """Times ``t`` in ``[0, 1]`` (any shape) moved towards noise: ``s t / (1 + (s - 1) t)``.

    SD3's and Wan's flow shift: ``shift > 1`` spends more training (and more sampling
    steps) at high noise, where a clip's digit and its frame-to-frame identity are decided;
    it keeps 0 at 0 and 1 at 1. ``shift`` must be positive; 1 leaves ``t`` unchanged.
    """
    if not shift > 0:
        raise ValueError(f"shift must be > 0; got {shift!r}")
    return shift * t / (1.0 + (shift - 1.0) * t)


def time_grid(steps: int, shift: float = 1.0) -> torch.Tensor:
    """Euler times ``(steps + 1,)`` from 1 (noise) down to 0 (clip): uniform, then :func:`shift_times`."""
    return shift_times(torch.linspace(1.0, 0.0, steps + 1), shift)


def clip_noise(seeds: Sequence[int], frames: int = FRAMES, size: int = FRAME_SIZE) -> torch.Tensor:
    """Starting noise ``(B, frames, 1, size, size)``, one independent generator per seed."""
    return torch.stack(
        [torch.randn(frames, 1, size, size, generator=torch.Generator().manual_seed(int(s))) for s in seeds]
    )


@torch.no_grad()
def sample_video(
    model: BuiltinVideoDiT,
    labels: Sequence[int] | torch.Tensor,
    seeds: Sequence[int] | int,
    steps: int = 20,
    guidance_scale: float | None = None,
    progress: bool = True,
    transformer: Any = None,
) -> torch.Tensor:
    """Generate moving-digit clips with Euler steps on the rectified flow (deterministic).

    Args:
        model: the loaded built-in video DiT.
        labels: ``B`` class labels in ``0..9``.
        seeds: one seed per clip, or a single int ``s`` meaning seeds ``s, s+1, ...``.
        steps: number of Euler steps (>= 1), one transformer call each.
        guidance_scale: classifier-free guidance scale; ``None`` uses the model's
            recommended value; ``1.0`` disables guidance (half the transformer batch).
        progress: show a tqdm progress bar over the steps.
        transformer: the transformer to call instead of ``model.transformer``.

    The Euler times are :func:`time_grid` with the model's :attr:`~BuiltinVideoDiT.time_shift`.

    Returns:
        Clips ``(B, FRAMES, 1, FRAME_SIZE, FRAME_SIZE)`` in ``[0, 1]``, float32.
    """
    from tqdm.auto import tqdm

    labels, seeds = sampling_arguments(labels, seeds, steps)
    transformer = model.transformer if transformer is None else transformer
    scale = model.guidance_scale if guidance_scale is None else float(guidance_scale)
    guided = scale != 1.0
    rows = torch.cat([torch.full_like(labels, NULL_CLASS), labels]) if guided else labels
    tokens = model.class_tokens[rows]
    times = time_grid(steps, model.time_shift)
    x = clip_noise(seeds)
    for i in tqdm(range(steps), desc="denoising", disable=not progress, leave=False):
        inp = torch.cat([x, x]) if guided else x
        v = velocity(transformer, inp, times[i].expand(inp.shape[0]), tokens)
        if guided:
            v_u, v_c = v.chunk(2)
            v = v_u + scale * (v_c - v_u)
        x = x + (times[i + 1] - times[i]) * v
    return ((x + 1.0) / 2.0).clamp(0.0, 1.0)


def frames_for_classifier(clips: torch.Tensor) -> torch.Tensor:
    """Frames ``(B * T, 1, 32, 32)`` of clips ``(B, T, 1, H, W)``, upsampled bilinearly for the classifier."""
    b, t, c, h, w = clips.shape
    frames = clips.reshape(b * t, c, h, w).float()
    return F.interpolate(frames, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)


@torch.no_grad()
def classify_frames(classifier: DigitClassifier, clips: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-frame labels ``(B, T)`` and features ``(B, T, 64)`` of clips ``(B, T, 1, H, W)`` in ``[0, 1]``."""
    b, t = clips.shape[:2]
    preds, feats = classify(classifier, frames_for_classifier(clips))
    return preds.reshape(b, t), feats.reshape(b, t, FEATURE_DIM)
