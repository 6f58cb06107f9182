"""What every arch family's module builds on: :class:`Arch`, one call's setting
(:class:`Call`), the frame counts of video archs and the common timestep rules. Imports
nothing of the families (:func:`toma.tools.archs.latent_frames` looks a family's own count up)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Arch:
    """One benchmarkable denoiser.

    Attributes:
        name: the ``--arch`` value.
        family: ``"unet"`` or a family name of :data:`toma.adapters.FAMILIES` (``"flux"``,
            ``"wan"``, ...; :func:`toma.supported` lists them).
        config: constructor keyword arguments of the diffusers model class.
        resolution: default image resolution in pixels.
        text_tokens: prompt length the pipeline feeds the denoiser.
        text_dim: width of the prompt embeddings (``cross_attention_dim`` / ``joint_attention_dim``).
        pooled_dim: width of the pooled prompt embedding (SDXL text_embeds, Flux pooled), or 0.
        vae_scale: pixels per latent pixel.
        description: one line for the report.
        aspect: width over height of the default frame (Wan's 480p is 832 x 480).
        frames: video: default frames in pixels; 0 for images.
        time_scale: video: frames per latent frame after the first (the VAE keeps the first).
        patch: latent pixels per token side (1 for UNets and LTX, 2 for the other transformers).
        references: reference images (of the generated image's size) whose tokens follow the
            image's in the call, as in editing (Flux Kontext); 0 for plain generation.
    """

    name: str
    family: str
    config: dict[str, Any] = field(repr=False)
    resolution: int
    text_tokens: int
    text_dim: int
    pooled_dim: int
    vae_scale: int
    description: str
    aspect: float = 1.0
    frames: int = 0
    time_scale: int = 4
    patch: int = 2
    references: int = 0

    def size(self, resolution: int) -> tuple[int, int]:
        """``(height, width)`` in pixels for ``resolution`` (the height), a whole number of
        tokens on each side."""
        step = self.patch * self.vae_scale
        return resolution, max(step, round(resolution * self.aspect / step) * step)


@dataclass
class Call:
    """One denoiser call's setting, as :func:`toma.tools.archs.make_inputs` makes it: the
    arch, batch, dtype and device, the pixel frames asked for (None: the arch's), the
    seeded generator and the frame's size in pixels. The prompt embeddings ``text`` are
    drawn first, at construction, as every family's call takes them: the random draws come
    in the same order for every family."""

    arch: Arch
    batch: int
    dtype: torch.dtype
    device: torch.device | str
    frames: int | None
    g: torch.Generator
    height: int
    width: int
    text: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.text = self.rand(self.batch, self.arch.text_tokens, self.arch.text_dim)

    def rand(self, *shape: int) -> torch.Tensor:
        """Standard normal draws of ``shape`` from the call's generator, on its device and dtype."""
        import torch

        return torch.randn(*shape, generator=self.g).to(device=self.device, dtype=self.dtype)

    @property
    def lh(self) -> int:
        """Latent rows."""
        return self.height // self.arch.vae_scale

    @property
    def lw(self) -> int:
        """Latent columns."""
        return self.width // self.arch.vae_scale

    @property
    def th(self) -> int:
        """Token rows where 2x2 latent patches pack into one token (Flux, Flux.2, Qwen-Image)."""
        return self.lh // 2

    @property
    def tw(self) -> int:
        """Token columns where 2x2 latent patches pack into one token."""
        return self.lw // 2

    @property
    def channels(self) -> int:
        """The denoiser's input channels (``in_channels``)."""
        return self.arch.config["in_channels"]

    @property
    def timestep(self) -> torch.Tensor:
        """A placeholder timestep per sample (999): :func:`toma.tools.archs.set_timestep` sets each step's."""
        import torch

        return torch.full((self.batch,), 999.0, device=self.device, dtype=self.dtype)


def flow_timestep(frac: float) -> float:
    """A flow-matching transformer's timestep at ``frac`` of the noise left: sigma, in [0, 1]
    (kept off 0). A family module's ``timestep_at``, see :func:`toma.tools.archs.set_timestep`."""
    return max(frac, 1e-3)


def rising_timestep(frac: float) -> float:
    """A model time of 1 - sigma (0 is noise, rising over a run) at ``frac`` of the noise
    left. A family module's ``timestep_at``, see :func:`toma.tools.archs.set_timestep`."""
    return 1.0 - frac


def latent_frames(arch: Arch, frames: int | None = None) -> int:
    """Latent frames of a video arch for ``frames`` pixel frames (its default if None): the
    VAE keeps the first frame and compresses the rest ``time_scale`` times. 1 for images.
    A family whose VAE counts otherwise says so in its module's ``count_latent_frames``,
    which :func:`toma.tools.archs.latent_frames` asks first."""
    if not arch.frames:
        if frames not in (None, 0, 1):
            raise ValueError(f"frames applies to video archs; {arch.name} draws images")
        return 1
    frames = arch.frames if frames is None else frames
    k = arch.time_scale
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1 or (frames - 1) % k:
        raise ValueError(
            f"frames must be 1 + {k}k (the video VAE keeps the first frame and compresses {k} into 1); got {frames!r}"
        )
    return (frames - 1) // k + 1
