"""The built-in pretrained models as diffusers pipelines, to try toma offline.

``toma.builtin.pipeline("builtin-unet")`` returns a :class:`BuiltinPipeline`: a diffusers
``DiffusionPipeline`` holding one of the tiny models the package ships (trained on
scikit-learn's digits), which ``toma.apply_toma`` patches as it would any pipeline. Nothing
is downloaded. The models draw digits of the classes asked for, not images from a prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from diffusers import DiffusionPipeline
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput

from toma.tools.builtin import BUILTIN_MODELS


class BuiltinPipeline(DiffusionPipeline):
    """A built-in model as a diffusers pipeline: its denoiser is ``unet`` (the digits UNet)
    or ``transformer`` (the digits DiT, the moving-digits video DiT)."""

    def __init__(self, name: str, sampler: Any, transformer_model: bool) -> None:
        super().__init__()
        if transformer_model:
            self.register_modules(transformer=sampler.denoiser)
        else:
            self.register_modules(unet=sampler.denoiser)
        # the sampler draws with the same denoiser module, so whatever patches it applies
        self._builtin_name = name
        self._builtin_sampler = sampler

    @torch.no_grad()
    def __call__(
        self,
        labels: Sequence[int] = tuple(range(10)),
        num_inference_steps: int = 20,
        seed: int = 0,
        guidance_scale: float | None = None,
        progress: bool = False,
    ) -> ImagePipelineOutput:
        """Draw one image (or clip) per label.

        Args:
            labels: digit classes, each in ``0..9``.
            num_inference_steps: denoising steps, at least 1.
            seed: the first image's seed; image ``i`` uses ``seed + i``.
            guidance_scale: classifier-free guidance scale; None: the model's recommended one.
            progress: show a progress bar over the steps.

        Returns:
            ``ImagePipelineOutput`` whose ``images`` are PIL images, or for the video model
            lists of PIL frames, one per label.
        """
        from PIL import Image

        labels = [int(label) for label in labels]
        bad = [label for label in labels if not 0 <= label <= 9]
        if not labels or bad:
            raise ValueError(f"labels must be digit classes in 0..9, at least one; got {list(labels)}")
        if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, int) or num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be a whole number >= 1; got {num_inference_steps!r}")
        seeds = [seed + i for i in range(len(labels))]
        out = self._builtin_sampler.draw(labels, seeds, num_inference_steps, guidance_scale, progress)

        def to_pil(image: torch.Tensor) -> Image.Image:
            return Image.fromarray((image[0].clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy())

        if out.ndim == 5:  # clips (B, T, 1, H, W)
            return ImagePipelineOutput(images=[[to_pil(frame) for frame in clip] for clip in out])
        return ImagePipelineOutput(images=[to_pil(image) for image in out])


def pipeline(name: str = "builtin-unet", path: str | Path | None = None) -> BuiltinPipeline:
    """A built-in model as a diffusers pipeline, loaded from the package (no download).

    Args:
        name: ``"builtin-unet"`` (the digits UNet, as SD's), ``"builtin-dit"`` (the digits
            Flux transformer) or ``"builtin-video"`` (the moving-digits Wan transformer).
        path: a folder with the model's files instead of the package's copy.

    Returns:
        A :class:`BuiltinPipeline` on the CPU, in float32; ``toma.apply_toma(pipe, ...)``
        patches it, and ``pipe(labels=[3, 7]).images`` draws.
    """
    names = [n for n in BUILTIN_MODELS if n != "builtin"]
    entry = BUILTIN_MODELS.get(name)
    if entry is None:
        raise ValueError(f"name must be one of {', '.join(map(repr, names))}; got {name!r}")
    sampler = entry.load(None if path is None else Path(path))
    return BuiltinPipeline(name, sampler, entry.transformer)
