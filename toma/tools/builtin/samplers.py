"""One interface over the built-in models for ``toma eval`` and ``toma generate``.

``--model builtin`` (the default, the digits UNet) and ``--model builtin-dit`` (the digits
Flux transformer) both draw 32 x 32 digits of a given class from per-image seeds and are
scored by the same digit classifier against the same reference statistics;
``--model builtin-video`` (the moving-digits Wan transformer) draws clips of 8 frames,
scored frame by frame by its own frame classifier (it has no reference statistics). Each is wrapped
in a :class:`BuiltinSampler`: the module that merging methods patch, a sampling function,
and (in :data:`toma.tools.builtin.BUILTIN_MODELS`) the methods that apply to it. The eval
and generate code only sees this interface, so a further built-in model is one more
loader here and one more entry in :data:`toma.tools.builtin.BUILTIN_MODELS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    import torch
# the models' modules, and torch with them, load in the loaders: the torch-free registry in
# toma.tools.builtin imports this module to name them


@dataclass
class BuiltinSampler:
    """A built-in model as ``toma eval`` / ``toma generate`` use it.

    Attributes:
        name: the ``--model`` value, e.g. ``"builtin-dit"``.
        denoiser: the module merging methods patch (the UNet, the transformer).
        draw: ``draw(labels, seeds, steps, guidance_scale, progress)`` returns images
            ``(B, 1, 32, 32)`` in ``[0, 1]`` for ``B`` labels in ``0..9`` and ``B`` seeds, or
            clips ``(B, T, 1, H, W)`` for a video model; ``guidance_scale=None`` means the
            model's recommended one.
        classifier: the digit classifier (:class:`toma.tools.builtin.unet.DigitClassifier`);
            a video model's reads frames through :attr:`classify`.
        reference_mu: ``(64,)`` mean classifier feature on the real digits (None: no
            reference statistics, no Frechet distance to real digits).
        reference_sigma: ``(64, 64)`` covariance of those features.
        guidance_scale: the model's recommended classifier-free guidance scale.
        classify: ``classify(classifier, samples)`` -> labels and ``(.., 64)`` features, one
            per image, or ``(B, T)`` and ``(B, T, 64)`` per frame of clips.
    """

    name: str
    denoiser: Any
    draw: Callable[[Sequence[int], Sequence[int], int, float | None, bool], torch.Tensor]
    classifier: Any
    reference_mu: torch.Tensor | None
    reference_sigma: torch.Tensor | None
    guidance_scale: float
    classify: Callable[[Any, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None


def load_reference_stats(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mu (64,), sigma (64, 64))`` in float64 from ``folder/reference_stats.safetensors``."""
    from safetensors.torch import load_file

    stats = load_file(str(folder / "reference_stats.safetensors"))
    return stats["mu"].double(), stats["sigma"].double()


def unet_sampler(path: Path | None) -> BuiltinSampler:
    """The digits UNet (``--model builtin``) from ``path``, or the package's copy when None."""
    from toma.tools.builtin.unet import load_builtin, sample

    model = load_builtin() if path is None else load_builtin(path)

    def draw(
        labels: Sequence[int], seeds: Sequence[int], steps: int, guidance: float | None, progress: bool | str
    ) -> torch.Tensor:
        return sample(model, labels, seeds, steps=steps, guidance_scale=guidance, progress=progress)

    return BuiltinSampler(
        name="builtin",
        denoiser=model.unet,
        draw=draw,
        classifier=model.classifier,
        reference_mu=model.reference_mu,
        reference_sigma=model.reference_sigma,
        guidance_scale=model.guidance_scale,
    )


def dit_sampler(path: Path | None) -> BuiltinSampler:
    """The digits Flux DiT (``--model builtin-dit``) from ``path``, or the package's copy when None."""
    from toma.tools.builtin.unet import BUILTIN_DIR
    from toma.tools.builtin.dit import DIT_DIR, load_dit, sample

    folder = DIT_DIR if path is None else Path(path)
    model = load_dit(folder)
    # the reference statistics sit next to the classifier, as for the classifier itself
    stats_dir = folder.parent if (folder.parent / "reference_stats.safetensors").is_file() else BUILTIN_DIR
    mu, sigma = load_reference_stats(stats_dir)

    def draw(
        labels: Sequence[int], seeds: Sequence[int], steps: int, guidance: float | None, progress: bool | str
    ) -> torch.Tensor:
        return sample(model, labels, seeds, steps=steps, guidance_scale=guidance, progress=progress)

    return BuiltinSampler(
        name="builtin-dit",
        denoiser=model.transformer,
        draw=draw,
        classifier=model.classifier,
        reference_mu=mu,
        reference_sigma=sigma,
        guidance_scale=model.guidance_scale,
    )


def video_sampler(path: Path | None) -> BuiltinSampler:
    """The moving-digits Wan video DiT (``--model builtin-video``) from ``path``, or the package's copy when None."""
    from toma.tools.builtin.video import VIDEO_DIR, classify_frames, load_video_dit, sample_video

    model = load_video_dit(VIDEO_DIR if path is None else Path(path))

    def draw(
        labels: Sequence[int], seeds: Sequence[int], steps: int, guidance: float | None, progress: bool | str
    ) -> torch.Tensor:
        return sample_video(model, labels, seeds, steps=steps, guidance_scale=guidance, progress=bool(progress))

    return BuiltinSampler(
        name="builtin-video",
        denoiser=model.transformer,
        draw=draw,
        classifier=model.classifier,
        reference_mu=None,
        reference_sigma=None,
        guidance_scale=model.guidance_scale,
        classify=classify_frames,
    )
