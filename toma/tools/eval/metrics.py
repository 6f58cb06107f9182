"""Image-quality metrics for comparing merged generations against unmerged ones.

Pure tensor functions (no weights): :func:`psnr`, :func:`ssim`, :func:`frechet_distance`,
:func:`feature_stats`, :func:`accuracy`,
:func:`temporal_difference_error` (videos).

Model-based metrics for real pipelines load their weights lazily, only from the local
Hugging Face cache (``local_files_only=True``); when the weights are absent they raise
:class:`MissingWeightsError` saying how to fetch them:

- :class:`ClipScorer`: CLIP-T, cosine similarity of image and prompt embeddings;
- :class:`DinoFeatures`: DINOv2 image features, for the DINO similarity of a merged image to
  its unmerged counterpart and for the Frechet distance to a folder of reference images.

Images are float tensors ``(B, C, H, W)`` with values in ``[0, data_range]`` unless stated.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from toma.tools.eval.constants import DEFAULT_CLIP_MODEL, DEFAULT_DINO_MODEL


class MissingWeightsError(RuntimeError):
    """Weights needed for a metric or a pipeline are not available offline."""


def _check_pair(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"images must have the same shape; got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dim() != 4:
        raise ValueError(f"images must be (B, C, H, W); got shape {tuple(a.shape)}")


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Peak signal-to-noise ratio per image, in dB.

    ``PSNR = 10 log10(data_range^2 / MSE)`` with the MSE over all pixels and channels of
    each image. Identical images give ``inf``.

    Args:
        a, b: images ``(B, C, H, W)``.
        data_range: the value span of a pixel (1.0 for ``[0, 1]``, 255 for 8-bit).

    Returns:
        ``(B,)`` float64 tensor.
    """
    _check_pair(a, b)
    mse = (a.double() - b.double()).pow(2).flatten(1).mean(dim=1)
    return 10.0 * torch.log10(data_range**2 / mse)


def temporal_difference_error(clips: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Temporal consistency of clips against reference clips: the mean absolute change of
    their frame-to-frame differences.

    ``E = mean_{t,c,h,w} |(x[t+1] - x[t]) - (y[t+1] - y[t])|`` for clips ``x`` and references
    ``y``. An error that is the same in every frame (a static offset, a blurred stroke that
    stays put) cancels, so ``E`` isolates what PSNR and SSIM per frame cannot separate:
    flicker between frames and motion that differs from the reference's. ``E = 0`` means
    every pixel changes from frame to frame exactly as in the reference. Absolute rather
    than squared differences keep it in pixel units (for ``[0, 1]`` pixels it lies in
    ``[0, 2]``) and count a pixel that flickers once as much as one small steady drift.

    Args:
        clips, reference: videos ``(B, T, C, H, W)`` with ``T >= 2``, same shape.

    Returns:
        ``(B,)`` float64 tensor, one value per clip.

    Raises:
        ValueError: the shapes differ, are not 5-D, or have fewer than 2 frames.
    """
    if clips.shape != reference.shape:
        raise ValueError(
            f"clips and reference must have the same shape; got {tuple(clips.shape)} and {tuple(reference.shape)}"
        )
    if clips.dim() != 5 or clips.shape[1] < 2:
        raise ValueError(f"clips must be (B, T, C, H, W) with T >= 2 frames; got shape {tuple(clips.shape)}")
    x, y = clips.double(), reference.double()
    return ((x[:, 1:] - x[:, :-1]) - (y[:, 1:] - y[:, :-1])).abs().flatten(1).mean(dim=1)


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    coords = torch.arange(size, dtype=torch.float64) - (size - 1) / 2.0
    g = torch.exp(-(coords**2) / (2.0 * sigma**2))
    g = g / g.sum()
    return torch.outer(g, g)


def ssim(
    a: torch.Tensor,
    b: torch.Tensor,
    data_range: float = 1.0,
    window_size: int = 11,
    sigma: float = 1.5,
    k1: float = 0.01,
    k2: float = 0.03,
) -> torch.Tensor:
    """Structural similarity per image (Wang et al., 2004), Gaussian-window variant.

    Local means, variances and the covariance are taken under a normalised
    ``window_size x window_size`` Gaussian window of std ``sigma`` (population statistics,
    no padding: only windows fully inside the image count). With
    ``C1 = (k1 * data_range)^2`` and ``C2 = (k2 * data_range)^2`` the SSIM map is

        (2 mu_a mu_b + C1) (2 cov_ab + C2) / ((mu_a^2 + mu_b^2 + C1) (var_a + var_b + C2))

    and the result is its mean over positions and channels. These are the defaults of
    the original paper and of scikit-image's ``structural_similarity(gaussian_weights=True,
    use_sample_covariance=False)``.

    Args:
        a, b: images ``(B, C, H, W)`` with ``H, W >= window_size``.

    Returns:
        ``(B,)`` float64 tensor, 1.0 for identical images.
    """
    _check_pair(a, b)
    if window_size < 1 or window_size % 2 == 0:
        raise ValueError(f"window_size must be a positive odd int; got {window_size}")
    if min(a.shape[-2:]) < window_size:
        raise ValueError(f"images of size {tuple(a.shape[-2:])} are smaller than window_size={window_size}")
    channels = a.shape[1]
    window = _gaussian_window(window_size, sigma).expand(channels, 1, window_size, window_size)
    a, b = a.double(), b.double()

    def blur(x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, window, groups=channels)

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a**2
    var_b = blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = (k1 * data_range) ** 2, (k2 * data_range) ** 2
    smap = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return smap.flatten(1).mean(dim=1)


def feature_stats(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``(D,)`` and covariance ``(D, D)`` (unbiased) of features ``(N, D)``, float64."""
    if features.dim() != 2 or features.shape[0] < 2:
        raise ValueError(f"features must be (N, D) with N >= 2; got shape {tuple(features.shape)}")
    features = features.double()
    return features.mean(dim=0), torch.cov(features.T).reshape(features.shape[1], features.shape[1])


def _sqrtm_psd(m: torch.Tensor) -> torch.Tensor:
    vals, vecs = torch.linalg.eigh((m + m.T) / 2)
    return (vecs * vals.clamp(min=0).sqrt()) @ vecs.T


def frechet_distance(mu1: torch.Tensor, sigma1: torch.Tensor, mu2: torch.Tensor, sigma2: torch.Tensor) -> float:
    """Frechet distance between two Gaussians ``N(mu1, sigma1)`` and ``N(mu2, sigma2)``.

    ``|mu1 - mu2|^2 + tr(sigma1 + sigma2 - 2 (sigma1 sigma2)^(1/2))``, the formula behind FID.
    The trace of the matrix square root is computed as the sum of square roots of the
    eigenvalues of ``sigma1^(1/2) sigma2 sigma1^(1/2)`` (symmetric, so no complex parts).

    Args:
        mu1, mu2: means ``(D,)``.
        sigma1, sigma2: covariances ``(D, D)``.
    """
    mu1, mu2, sigma1, sigma2 = (t.double() for t in (mu1, mu2, sigma1, sigma2))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape or sigma1.shape != (mu1.numel(),) * 2:
        raise ValueError(
            f"shape mismatch: mu {tuple(mu1.shape)}/{tuple(mu2.shape)}, sigma "
            f"{tuple(sigma1.shape)}/{tuple(sigma2.shape)}"
        )
    root1 = _sqrtm_psd(sigma1)
    cross = torch.linalg.eigvalsh(root1 @ sigma2 @ root1).clamp(min=0).sqrt().sum()
    value = (mu1 - mu2).pow(2).sum() + torch.trace(sigma1) + torch.trace(sigma2) - 2 * cross
    return max(float(value), 0.0)


def frechet_distance_features(features: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> float:
    """Frechet distance between features ``(N, D)`` and a reference ``N(mu, sigma)``."""
    mu1, sigma1 = feature_stats(features)
    return frechet_distance(mu1, sigma1, mu, sigma)


def accuracy(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of ``predictions`` ``(N,)`` equal to ``labels`` ``(N,)``."""
    if predictions.shape != labels.shape or predictions.numel() == 0:
        raise ValueError(
            f"predictions and labels must be non-empty and equally shaped; got {tuple(predictions.shape)} and "
            f"{tuple(labels.shape)}"
        )
    return (predictions == labels).double().mean().item()


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine similarity ``(B,)`` of embeddings ``(B, D)``."""
    return F.cosine_similarity(a.double(), b.double(), dim=-1)


def _missing(what: str, model_id: str, err: Exception) -> MissingWeightsError:
    return MissingWeightsError(
        f"the {what} weights {model_id!r} are not available offline ({type(err).__name__}). "
        f"Fetch them once with network access: `hf download {model_id}` (older huggingface_hub: "
        f"`huggingface-cli download {model_id}`), or pass a local folder instead of the model id."
    )


def _load_pretrained(loader: Any, model_id: str, what: str) -> Any:
    try:
        return loader.from_pretrained(model_id, local_files_only=True)
    except (OSError, ValueError) as err:  # transformers raises OSError for absent files
        raise _missing(what, model_id, err) from err


def _to_pil(images: torch.Tensor) -> list[Any]:
    from PIL import Image

    arr = (images.clamp(0, 1) * 255).round().to(torch.uint8)
    if arr.shape[1] == 1:
        arr = arr.expand(-1, 3, -1, -1)
    return [Image.fromarray(x.permute(1, 2, 0).numpy()) for x in arr]


class _LocalModel:
    """A transformers model and its processor, loaded on first use from local files only."""

    what = ""  # name used in the missing-weights message

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self._model: Any = None
        self._processor: Any = None

    def _classes(self) -> tuple[Any, Any]:
        """The processor and model classes (imported only when loading)."""
        raise NotImplementedError

    def load(self) -> None:
        """Load the weights now (otherwise on first call); raises :class:`MissingWeightsError`."""
        if self._model is None:
            processor_cls, model_cls = self._classes()
            self._processor = _load_pretrained(processor_cls, self.model_id, self.what)
            self._model = _load_pretrained(model_cls, self.model_id, self.what).eval()


class ClipScorer(_LocalModel):
    """CLIP-T: cosine similarity between an image and its prompt, with a local CLIP model.

    Weights load on first use from the local cache (or a local folder) only.
    """

    what = "CLIP"

    def __init__(self, model_id: str = DEFAULT_CLIP_MODEL) -> None:
        super().__init__(model_id)

    def _classes(self) -> tuple[Any, Any]:
        from transformers import CLIPModel, CLIPProcessor

        return CLIPProcessor, CLIPModel

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """CLIP-T ``(B,)`` for images ``(B, C, H, W)`` in ``[0, 1]`` and ``B`` prompts."""
        if len(prompts) != images.shape[0]:
            raise ValueError(f"got {len(prompts)} prompts for {images.shape[0]} images")
        self.load()
        inputs = self._processor(
            text=list(prompts), images=_to_pil(images), return_tensors="pt", padding=True, truncation=True
        )
        out = self._model(**inputs)
        return cosine_similarity(out.image_embeds, out.text_embeds)


class DinoFeatures(_LocalModel):
    """DINOv2 global image features (CLS token), loaded lazily from the local cache only.

    Used for the DINO similarity of a merged image to the unmerged one (the paper's DINO
    delta is ``1 - similarity``) and for a Frechet distance to reference images.
    """

    what = "DINO"

    def __init__(self, model_id: str = DEFAULT_DINO_MODEL) -> None:
        super().__init__(model_id)

    def _classes(self) -> tuple[Any, Any]:
        from transformers import AutoImageProcessor, AutoModel

        return AutoImageProcessor, AutoModel

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
        """Features ``(B, D)`` of images ``(B, C, H, W)`` in ``[0, 1]``."""
        self.load()
        feats = []
        for chunk in images.split(batch_size):
            inputs = self._processor(images=_to_pil(chunk), return_tensors="pt")
            feats.append(self._model(**inputs).last_hidden_state[:, 0].double())
        return torch.cat(feats)


def load_image_folder(folder: str, size: int | None = None, limit: int | None = None) -> torch.Tensor:
    """Load the images of a folder (png/jpg/jpeg/webp, sorted by name) as ``(N, 3, H, W)`` in ``[0, 1]``.

    ``size`` resizes every image to ``size x size`` (needed when sizes differ).
    """
    from pathlib import Path

    import numpy as np
    from PIL import Image

    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"reference folder {folder!r} does not exist")
    files = sorted(p for p in root.iterdir() if p.suffix.lower() in {".png", ".jpg", ".jpeg", ".webp"})
    if limit is not None:
        files = files[:limit]
    if len(files) < 2:
        raise ValueError(f"reference folder {folder!r} needs at least 2 images; found {len(files)}")
    out = []
    for p in files:
        img = Image.open(p).convert("RGB")
        if size is not None:
            img = img.resize((size, size), Image.BICUBIC)
        out.append(torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255.0)
    return torch.stack(out)


def mean_finite(values: torch.Tensor) -> float:
    """Mean of the finite entries (PSNR of identical images is ``inf``); ``inf`` if none are finite."""
    values = values.double()
    finite = values[torch.isfinite(values)]
    return float(finite.mean()) if finite.numel() else math.inf
