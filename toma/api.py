"""Public entry points: :func:`apply_toma`, :func:`remove_toma` and :func:`get_toma`."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from toma import adapters
from toma.adapters import adapter_for, check_placement, unsupported_reason
from toma.adapters.base import Patched, Skipped
from toma.adapters.caches import guard as guard_forward
from toma.adapters.ledger import Ledger
from toma.adapters.parallel import cp_config, refusal
from toma.config import ToMAConfig, make_config
from toma.adapters.state import PlanCache
from toma.tuned import warn_if_measured_slower

_ATTR = "_toma_patch"
_DENOISER_ATTRS = ("unet", "transformer")


@dataclass
class ToMAPatch:
    """What :func:`apply_toma` did to one denoiser; ``print()`` it for a summary.

    Attributes:
        config: the settings in force.
        adapter: the name of the model family whose adapter merges it (``"unet"``, ``"flux"``,
            ``"wan"``, ...; :func:`toma.supported` lists every family).
        patched: the merged sub-modules.
        skipped: blocks left unmerged, with why.
        cache: the plan cache shared by the merged sub-modules.
    """

    config: ToMAConfig
    adapter: str
    patched: list[Patched]
    skipped: list[Skipped]
    cache: PlanCache = field(repr=False)
    ledger: Ledger = field(default_factory=Ledger, repr=False)
    _hooked: list[torch.nn.Module] = field(default_factory=list, repr=False)
    _adapter: Any = field(default=None, repr=False)

    def new_run(self) -> None:
        """Start a new denoising run at the next forward (see :meth:`PlanCache.new_run`).

        Pipelines patched through :func:`apply_toma` do this by themselves; call it when
        driving a bare denoiser with ``recompute_every > 1`` or a step window
        (``start_step``/``stop_step``) through a run that may start at
        a lower timestep than where the previous one stopped (img2img after a stopped run).
        """
        self.cache.new_run()

    def summary(self) -> str:
        """A readable list of merged and skipped blocks and the settings."""
        settings = ", ".join(f"{k}={v}" for k, v in self.config.to_dict().items())
        lines = [
            f"ToMA ({self.adapter} adapter): {len(self.patched)} merged, {len(self.skipped)} skipped",
            f"  settings: {settings}",
        ]
        if self.config.windowed:
            stop = "the last" if self.config.stop_step is None else f"{self.config.stop_step - 1}"
            lines.append(
                f"  steps: merging on denoising steps {self.config.start_step} to {stop} (0 = first); the "
                "others run unmerged"
            )
        lines += [f"  merged  {p.name}  [{p.where}]" for p in self.patched]
        lines += [f"  skipped {s.name}  ({s.reason})" for s in self.skipped]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def apply_toma(
    pipe_or_model: Any,
    ratio: float | ToMAConfig | None = None,
    *,
    config: ToMAConfig | None = None,
    warn_slower: bool = True,
    **options: Any,
) -> ToMAPatch:
    """Make a diffusers pipeline or denoiser merge tokens with ToMA.

    Args:
        pipe_or_model: a pipeline with a ``unet`` or ``transformer``, or the denoiser itself
            (a ``UNet2DConditionModel``-like UNet or a ``FluxTransformer2DModel``).
        ratio: fraction of image tokens merged away, in [0, 1); default 0.5. A
            :class:`ToMAConfig` may be passed here instead of ``config``.
        config: all settings at once; ``ratio`` and ``options`` override its fields
            (``toma.load_config(path)`` reads one from a file, e.g. ``toma tune --out``).
        warn_slower: warn (a ``toma.tuned.SlowerSettingWarning``, once per process per
            setting) when ``toma tune`` measured these settings on this kind of denoiser, device
            and dtype as slower than unpatched on this machine (its records:
            ``$TOMA_CACHE_DIR/tune.json``, default ``~/.cache/toma/tune.json``).
        **options: any other :class:`ToMAConfig` field (``tile_size``, ``selection``, ...).

    Returns:
        The :class:`ToMAPatch` describing what was merged (also kept on the denoiser).

    Raises:
        TypeError, ValueError: bad settings or an unsupported model. Checks run before
            anything is patched, so on error the model is left exactly as it was.

    Applying again replaces the previous settings. Undo with :func:`remove_toma`.
    """
    if isinstance(ratio, ToMAConfig):
        if config is not None:
            raise TypeError("pass the ToMAConfig either as ratio's position or as config=, not both")
        ratio, config = None, ratio
    if ratio is not None:
        options["ratio"] = ratio
    cfg = make_config(config, **options)
    model = denoiser_of(pipe_or_model)
    found = adapter_for(model)
    reason = unsupported_reason(model) if found is None else None
    if reason is not None:
        raise ValueError(f"ToMA does not merge {reason}")
    if found is None:
        raise ValueError(
            f"{type(model).__name__} has no blocks ToMA supports: expected a diffusers UNet with "
            "BasicTransformerBlock attention (SD 1.x/2.x, SDXL) or one of "
            f"{', '.join(sorted(c for _, classes in adapters.FAMILIES.values() for c in classes))}"
        )
    name, adapter = found
    refused = refusal(name, cp_config(model), cfg)
    if refused is not None:
        raise ValueError(refused)
    check_placement(name, adapter, cfg)
    targets, skipped = adapter.find_targets(model, cfg)
    if not targets:
        reasons = "; ".join(f"{s.name}: {s.reason}" for s in skipped[:4]) or "no candidate blocks"
        raise ValueError(f"no blocks of {type(model).__name__} would be merged with these settings ({reasons})")
    remove_toma(model)
    cache = PlanCache(cfg, adapter.tile_frames(cfg), getattr(adapter, "reference_tokens", None))
    patch = ToMAPatch(cfg, name, targets, skipped, cache, _adapter=adapter)
    ledger = patch.ledger  # every change below is recorded as it is made, and undone from it
    try:
        ledger.record("the plan cache", patch.cache.reset)
        ledger.set_attr(model, _ATTR, patch)
        # copy.deepcopy looks __deepcopy__ up on the instance: see _deepcopy_patched
        ledger.set_item(model.__dict__, "__deepcopy__", functools.partial(_deepcopy_patched, model), model)
        patch._hooked = adapter.attach(model, targets, patch.cache, ledger)
        guard = guard_forward(model)  # toma's model hook, through a later forward replacement
        if guard is not None:
            ledger.record("forward guard on the denoiser", guard.remove)
        if model is not pipe_or_model:
            _watch_run_start(pipe_or_model, patch)
    except BaseException:
        ledger.close()
        raise
    if warn_slower:
        warn_if_measured_slower(model, [p.name for p in targets], cfg.to_dict())
    return patch


def remove_toma(pipe_or_model: Any) -> bool:
    """Undo :func:`apply_toma` exactly; returns whether anything was patched.

    After removal the denoiser computes bitwise what it computed before patching.
    """
    model = denoiser_of(pipe_or_model)
    patch = getattr(model, _ATTR, None)
    if patch is None:
        return False
    patch.ledger.close()
    return True


def get_toma(pipe_or_model: Any) -> ToMAPatch | None:
    """The :class:`ToMAPatch` in force on a pipeline or denoiser, or None."""
    return getattr(denoiser_of(pipe_or_model), _ATTR, None)


def denoiser_of(pipe_or_model: Any) -> torch.nn.Module:
    """The denoiser module of a pipeline (its ``unet`` or ``transformer``), or the module itself."""
    if isinstance(pipe_or_model, torch.nn.Module):
        return pipe_or_model
    for attr in _DENOISER_ATTRS:
        module = getattr(pipe_or_model, attr, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise TypeError(
        f"pipe_or_model must be a diffusers pipeline with a unet or transformer, or a torch.nn.Module; "
        f"got {type(pipe_or_model).__name__}"
    )


class _RunStart:
    """Stands in for a pipeline scheduler's ``set_timesteps``: every pipeline call sets its
    timesteps once before denoising, the one run boundary the denoiser cannot see itself."""

    def __init__(self, scheduler: Any, patch: ToMAPatch) -> None:
        self.call = scheduler.set_timesteps
        self.patch = patch
        # pipelines inspect set_timesteps' signature (custom sigmas, timesteps): show the original's
        self.__wrapped__ = self.call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.patch.new_run()
        return self.call(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        # a copied pipeline's scheduler must not start runs of this pipeline's denoiser:
        # it gets the wrapped method, bound to the copy
        return copy.deepcopy(self.call, memo)


def _watch_run_start(pipe: Any, patch: ToMAPatch) -> None:
    scheduler = getattr(pipe, "scheduler", None)
    if scheduler is None or not callable(getattr(scheduler, "set_timesteps", None)):
        return
    patch.ledger.set_item(scheduler.__dict__, "set_timesteps", _RunStart(scheduler, patch), scheduler)


def _deepcopy_patched(model: torch.nn.Module, memo: dict) -> torch.nn.Module:
    """``copy.deepcopy`` of a patched denoiser: an independent copy with its own ToMA.

    diffusers' hooks live in closures over the original module, which a plain deep copy
    shares, so that the copy would run the original's weights and fill its plan cache.
    Instead the model is copied unpatched and both are patched again with the same settings.
    """
    patch = getattr(model, _ATTR)
    patch.ledger.close()
    try:
        clone = copy.deepcopy(model, memo)
    finally:
        apply_toma(model, config=patch.config, warn_slower=False)
    apply_toma(clone, config=patch.config, warn_slower=False)
    return clone
