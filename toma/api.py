"""Public entry points: :func:`apply_toma`, :func:`remove_toma` and :func:`get_toma`."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from toma.adapters import FAMILIES, adapter_for, check_placement, unsupported_reason
from toma.adapters.base import HOOK_NAME, HOOK_NAMES, Patched, Skipped, remove_hook
from toma.adapters.caches import guard as guard_forward, unlink
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
    _hooked: list[torch.nn.Module] = field(default_factory=list, repr=False)
    _adapter: Any = field(default=None, repr=False)
    _scheduler: Any = field(default=None, repr=False)
    _guard: Any = field(default=None, repr=False)

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
            f"{', '.join(sorted(c for _, classes in FAMILIES.values() for c in classes))}"
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
    setattr(model, _ATTR, patch)
    # copy.deepcopy looks __deepcopy__ up on the instance: see _deepcopy_patched
    model.__dict__["__deepcopy__"] = functools.partial(_deepcopy_patched, model)
    try:
        patch._hooked = adapter.attach(model, targets, patch.cache)
        patch._guard = guard_forward(model)  # toma's model hook, through a later forward replacement
        if model is not pipe_or_model:
            _watch_run_start(pipe_or_model, patch)
    except BaseException:
        _detach(model, patch, everything=True)
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
    _detach(model, patch, everything=False)
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


def _detach(model: torch.nn.Module, patch: ToMAPatch, everything: bool) -> None:
    modules = [m for _, m in model.named_modules()] if everything else [model, *patch._hooked]
    if patch._guard is not None:
        patch._guard.remove()
        patch._guard = None
    registry = getattr(model, "_diffusers_hook", None)
    own = registry.get_hook(HOOK_NAME) if registry is not None else None
    for module in modules:
        for name in HOOK_NAMES:
            remove_hook(module, name)
    if getattr(own, "fn_ref", None) is not None:
        unlink(model, own.fn_ref)
    patch._adapter.detach(patch.patched)
    patch.cache.reset()
    _unwatch_run_start(patch)
    if getattr(model, _ATTR, None) is patch:
        delattr(model, _ATTR)
        model.__dict__.pop("__deepcopy__", None)


class _RunStart:
    """Stands in for a pipeline scheduler's ``set_timesteps``: every pipeline call sets its
    timesteps once before denoising, the one run boundary the denoiser cannot see itself."""

    def __init__(self, scheduler: Any, patch: ToMAPatch) -> None:
        self.own = scheduler.__dict__.get("set_timesteps")  # someone else's wrapper, kept
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
    scheduler.__dict__["set_timesteps"] = _RunStart(scheduler, patch)
    patch._scheduler = scheduler


def _unwatch_run_start(patch: ToMAPatch) -> None:
    scheduler, patch._scheduler = patch._scheduler, None
    hook = getattr(scheduler, "__dict__", {}).get("set_timesteps")
    if isinstance(hook, _RunStart) and hook.patch is patch:
        if hook.own is None:
            del scheduler.__dict__["set_timesteps"]
        else:
            scheduler.__dict__["set_timesteps"] = hook.own


def _deepcopy_patched(model: torch.nn.Module, memo: dict) -> torch.nn.Module:
    """``copy.deepcopy`` of a patched denoiser: an independent copy with its own ToMA.

    diffusers' hooks live in closures over the original module, which a plain deep copy
    shares, so that the copy would run the original's weights and fill its plan cache.
    Instead the model is copied unpatched and both are patched again with the same settings.
    """
    patch = getattr(model, _ATTR)
    _detach(model, patch, everything=False)
    try:
        clone = copy.deepcopy(model, memo)
    finally:
        apply_toma(model, config=patch.config, warn_slower=False)
    apply_toma(clone, config=patch.config, warn_slower=False)
    return clone
