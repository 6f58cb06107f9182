"""The built-in pretrained model: a tiny class-conditional pixel-space diffusion UNet.

The model ships inside the package (``toma/tools/builtin/``) so that ``toma generate`` and
``toma eval`` work offline with no download. It was trained by
``scripts/train_builtin.py`` on scikit-learn's handwritten digits, upsampled to
32 x 32 grey-scale images. Its first UNet level runs self-attention over
32 x 32 = 1024 tokens, so token merging has something to remove.

Files under ``toma/tools/builtin/``:

- ``digits-unet/``: the :class:`diffusers.UNet2DConditionModel` (``save_pretrained`` layout);
- ``scheduler/``: the DDIM scheduler config used for sampling;
- ``class_embeddings.safetensors``: the learned conditioning tokens, one sequence per
  class plus one "null" sequence for classifier-free guidance;
- ``classifier.safetensors``: a small CNN digit classifier trained on the same data, used
  for accuracy and for the Frechet distance on its penultimate features;
- ``reference_stats.safetensors``: mean and covariance of those features on the real digits;
- ``metadata.json``: training settings and measured metrics;
- ``digits-dit/``: a second built-in model, a class-conditional image DiT on
  :class:`diffusers.FluxTransformer2DModel` (see :mod:`toma.tools.builtin.dit`);
- ``digits-video/``: a built-in video DiT on moving digits, on
  :class:`diffusers.WanTransformer3DModel` (see :mod:`toma.tools.builtin.video`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

BUILTIN_DIR = Path(__file__).resolve().parent
NUM_CLASSES = 10
NULL_CLASS = NUM_CLASSES  # index of the unconditional embedding used by guidance
IMAGE_SIZE = 32
FEATURE_DIM = 64

# Architecture of the built-in UNet; the training script builds it from this dict so the
# shipped config and the code cannot drift apart.
UNET_CONFIG: dict[str, Any] = {
    "sample_size": IMAGE_SIZE,
    "in_channels": 1,
    "out_channels": 1,
    "layers_per_block": 1,
    "block_out_channels": (32, 64, 128),
    "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    # diffusers names the head count "attention_head_dim" for this class
    "attention_head_dim": (1, 2, 4),
    "cross_attention_dim": 64,
    "norm_num_groups": 8,
}
COND_TOKENS = 4  # conditioning sequence length per class

SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_schedule": "squaredcos_cap_v2",
    "prediction_type": "epsilon",
    "clip_sample": True,
    # "trailing" starts sampling at t=999 even with few steps
    "timestep_spacing": "trailing",
}


class DigitClassifier(nn.Module):
    """Small CNN labelling 32 x 32 grey-scale digits.

    Input: ``(B, 1, 32, 32)`` images in ``[0, 1]``. :meth:`features` returns the
    ``(B, 64)`` penultimate activations (used for the Frechet distance); ``forward``
    returns ``(B, 10)`` logits.
    """

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, FEATURE_DIM),
            nn.ReLU(),
        )
        self.head = nn.Linear(FEATURE_DIM, NUM_CLASSES)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Penultimate features ``(B, 64)`` of images ``(B, 1, 32, 32)`` in ``[0, 1]``."""
        return self.body(images * 2.0 - 1.0)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits ``(B, 10)`` of images ``(B, 1, 32, 32)`` in ``[0, 1]``."""
        return self.head(self.features(images))


@dataclass
class BuiltinModel:
    """Everything needed to sample from and score the built-in model.

    Attributes:
        unet: the diffusion UNet (pixel space, 1 x 32 x 32, epsilon prediction).
        scheduler_config: config dict of the DDIM scheduler used for sampling.
        class_embeddings: ``(11, 4, 64)`` conditioning tokens; row 10 is the null class.
        classifier: digit classifier for accuracy and features.
        reference_mu: ``(64,)`` mean classifier feature on the real digits.
        reference_sigma: ``(64, 64)`` covariance of those features.
        metadata: training settings and metrics recorded by the training script.
    """

    unet: Any
    scheduler_config: dict[str, Any]
    class_embeddings: torch.Tensor
    classifier: DigitClassifier
    reference_mu: torch.Tensor
    reference_sigma: torch.Tensor
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def guidance_scale(self) -> float:
        """Classifier-free guidance scale recommended by the training run."""
        return float(self.metadata.get("guidance_scale", 2.0))


def builtin_available(path: Path | str = BUILTIN_DIR) -> bool:
    """Whether the trained built-in model files are present under ``path``."""
    path = Path(path)
    return (path / "digits-unet" / "config.json").is_file() and (path / "class_embeddings.safetensors").is_file()


def load_builtin(path: Path | str = BUILTIN_DIR) -> BuiltinModel:
    """Load the built-in model from ``path`` (default: the copy inside the package).

    Returns a :class:`BuiltinModel` in float32, eval mode, on CPU.
    Raises ``FileNotFoundError`` when the files are missing (e.g. a source checkout where
    ``scripts/train_builtin.py`` has not been run).
    """
    from diffusers import UNet2DConditionModel
    from safetensors.torch import load_file

    path = Path(path)
    if not builtin_available(path):
        raise FileNotFoundError(
            f"built-in model files not found under {path}; reinstall toma-diffusion or "
            "recreate them with `python scripts/train_builtin.py`"
        )
    unet = UNet2DConditionModel.from_pretrained(path / "digits-unet", torch_dtype=torch.float32)
    unet.eval().requires_grad_(False)
    with open(path / "scheduler" / "scheduler_config.json", encoding="utf-8") as fh:
        scheduler_config = json.load(fh)
    embeddings = load_file(str(path / "class_embeddings.safetensors"))["class_embeddings"].float()
    classifier = DigitClassifier()
    classifier.load_state_dict(load_file(str(path / "classifier.safetensors")))
    classifier.eval().requires_grad_(False)
    stats = load_file(str(path / "reference_stats.safetensors"))
    metadata: dict[str, Any] = {}
    if (path / "metadata.json").is_file():
        with open(path / "metadata.json", encoding="utf-8") as fh:
            metadata = json.load(fh)
    return BuiltinModel(
        unet=unet,
        scheduler_config=scheduler_config,
        class_embeddings=embeddings,
        classifier=classifier,
        reference_mu=stats["mu"].double(),
        reference_sigma=stats["sigma"].double(),
        metadata=metadata,
    )


def make_scheduler(config: dict[str, Any]) -> Any:
    """A fresh DDIM scheduler from ``config`` (schedulers are stateful, so never share one)."""
    from diffusers import DDIMScheduler

    return DDIMScheduler.from_config(config)


def initial_noise(seeds: Sequence[int], size: int = IMAGE_SIZE) -> torch.Tensor:
    """Starting noise ``(B, 1, size, size)``, one independent generator per seed.

    Per-image seeds make every image reproducible regardless of batch size or of how
    images are split across processes.
    """
    noise = [torch.randn(1, size, size, generator=torch.Generator().manual_seed(int(s))) for s in seeds]
    return torch.stack(noise)


@torch.no_grad()
def sampling_arguments(labels: Any, seeds: int | Sequence[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Checked sampler arguments of the built-in models: labels as a ``(B,)`` long tensor
    and one seed per image.

    Raises:
        ValueError: empty or out-of-range labels, ``steps < 1``, or a seed count that does
            not match the labels.
    """
    labels = torch.as_tensor(labels, dtype=torch.long).reshape(-1)
    if labels.numel() == 0:
        raise ValueError("labels must not be empty")
    if labels.min() < 0 or labels.max() >= NUM_CLASSES:
        raise ValueError(f"labels must be in 0..{NUM_CLASSES - 1}, got {labels.tolist()}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    seeds = [seeds + i for i in range(labels.numel())] if isinstance(seeds, int) else list(seeds)
    if len(seeds) != labels.numel():
        raise ValueError(f"got {len(seeds)} seeds for {labels.numel()} labels; give one per image")
    return labels, seeds


def sample(
    model: BuiltinModel,
    labels: Sequence[int] | torch.Tensor,
    seeds: Sequence[int] | int,
    steps: int = 20,
    guidance_scale: float | None = None,
    progress: bool | str = True,
    unet: Any = None,
) -> torch.Tensor:
    """Generate digits with DDIM (deterministic, eta = 0).

    Args:
        model: the loaded built-in model.
        labels: ``B`` class labels in ``0..9``.
        seeds: one seed per image, or a single int ``s`` meaning seeds ``s, s+1, ...``.
        steps: number of denoising steps (>= 1).
        guidance_scale: classifier-free guidance scale; ``None`` uses the model's
            recommended value; ``1.0`` disables guidance (half the UNet batch).
        progress: show a tqdm progress bar over the denoising steps, labelled "denoising"
            or, given a string, with that string (which run it is).
        unet: the UNet to call instead of ``model.unet`` (e.g. a patched copy).

    Returns:
        Images ``(B, 1, 32, 32)`` in ``[0, 1]``, float32.
    """
    from tqdm.auto import tqdm

    labels, seeds = sampling_arguments(labels, seeds, steps)
    unet = model.unet if unet is None else unet
    scale = model.guidance_scale if guidance_scale is None else float(guidance_scale)
    guided = scale != 1.0

    cond = model.class_embeddings[labels]
    if guided:
        uncond = model.class_embeddings[torch.full_like(labels, NULL_CLASS)]
        cond = torch.cat([uncond, cond])
    scheduler = make_scheduler(model.scheduler_config)
    scheduler.set_timesteps(steps)
    x = initial_noise(seeds) * scheduler.init_noise_sigma
    desc = progress if isinstance(progress, str) else "denoising"
    for t in tqdm(scheduler.timesteps, desc=desc, disable=not progress, leave=False):
        inp = torch.cat([x, x]) if guided else x
        eps = unet(inp, t, encoder_hidden_states=cond).sample
        if guided:
            eps_u, eps_c = eps.chunk(2)
            eps = eps_u + scale * (eps_c - eps_u)
        x = scheduler.step(eps, t, x).prev_sample
    return ((x + 1.0) / 2.0).clamp(0.0, 1.0)


@torch.no_grad()
def classify(
    classifier: DigitClassifier, images: torch.Tensor, batch_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predicted labels ``(B,)`` and features ``(B, 64)`` for images ``(B, 1, 32, 32)`` in ``[0, 1]``."""
    if images.shape[0] == 0:
        return torch.empty(0, dtype=torch.long), torch.empty(0, FEATURE_DIM)
    preds, feats = [], []
    for chunk in images.split(batch_size):
        f = classifier.features(chunk.float())
        feats.append(f)
        preds.append(classifier.head(f).argmax(dim=1))
    return torch.cat(preds), torch.cat(feats)
