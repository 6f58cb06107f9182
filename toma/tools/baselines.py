"""Reference methods for ``toma bench``: the ideal merge, ToDo and the tomesd peer.

* **ideal**: ToMA's own placement (the same hooked modules, the same number ``K`` of tokens
  kept per token grid) with a merge that costs nothing: every ``N/K``-th token is kept and
  each output is repeated back over the tokens it stands for. Any token-merging method
  that removes ``N - K`` tokens at these places is at best as fast as this; it is the
  ceiling that a method's efficiency is measured against. It reuses ToMA's adapters with a
  plan cache that hands out these trivial plans, so every hook and processor is identical
  and only the merge itself differs.
* **todo** (token downsampling, UNet only): self-attention keeps all queries and attends
  to spatially average-pooled keys/values; there is nothing to unmerge. A pool of
  ``a x b`` tokens with ``a * b = round(1 / (1 - ratio))`` removes about ``ratio`` of the
  keys (ratio 0.5: 1x2, ratio 0.75: 2x2).
* **tomesd**: the ToMeSD package (optional extra), applied with the same ratio at the
  UNet levels ToMA merges.

Every function takes the denoiser module (not a pipeline) and is undone by
:func:`remove_baseline`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator

import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry, ModelHook

from toma.adapters import adapter_for
from toma.adapters.unet import UNetStepHook
from toma.adapters.base import Patched, remove_hook
from toma.adapters.ledger import Ledger
from toma.api import get_toma
from toma.config import ToMAConfig, make_config
from toma.core.plan import Memo, profiled
from toma.adapters.state import PlanCache

_ATTR = "_toma_baseline"
_TODO_HOOK = "toma_todo"


@dataclass
class BaselinePatch:
    """What one baseline did to a denoiser (kept on it until :func:`remove_baseline`).

    Attributes:
        method: ``"ideal"``, ``"todo"`` or ``"tomesd"``.
        ratio: fraction of tokens removed.
        patched: the modules whose tokens are reduced.
        settings: method-specific settings, for reports.
    """

    method: str
    ratio: float
    patched: list[Patched]
    settings: dict[str, Any] = field(default_factory=dict)
    _hooked: list[tuple[torch.nn.Module, str]] = field(default_factory=list, repr=False)
    _ledger: Ledger | None = None  # the ideal's changes, made through toma's adapters


def get_baseline(model: torch.nn.Module) -> BaselinePatch | None:
    """The baseline applied to ``model``, or None."""
    return getattr(model, _ATTR, None)


def remove_baseline(model: torch.nn.Module) -> bool:
    """Undo any baseline applied to ``model``; returns whether one was applied."""
    patch = get_baseline(model)
    if patch is None:
        return False
    if patch.method == "tomesd":
        import tomesd

        tomesd.remove_patch(model)
    for module, name in patch._hooked:
        remove_hook(module, name)
    if patch._ledger is not None:
        patch._ledger.close()
    delattr(model, _ATTR)
    return True


# ---------------------------------------------------------------------------- ideal


class IdealPlan(Memo):
    """A zero-cost stand-in for :class:`toma.core.plan.Plan`: keep every ``N/K``-th token.

    Args:
        num_tokens: ``N``, tokens of the grid.
        num_merged: ``K``, tokens kept (the same count ToMA keeps on this grid).
        device: where the index tensors live.
    """

    def __init__(self, num_tokens: int, num_merged: int, device: torch.device) -> None:
        if not 1 <= num_merged <= num_tokens:
            raise ValueError(f"num_merged must be in [1, {num_tokens}]; got {num_merged}")
        self.num_tokens = num_tokens
        self.num_merged = num_merged
        # a whole stride is a view on the way in and an expand on the way out
        self.stride = num_tokens // num_merged if num_tokens % num_merged == 0 else None
        self.keep = (torch.arange(num_merged, device=device) * num_tokens) // num_merged
        # every token takes the output of the last kept token at or before it: the largest
        # i with keep[i] <= j, i.e. i = ceil((j + 1) * K / N) - 1
        j = torch.arange(num_tokens, device=device)
        self.owner = ((j + 1) * num_merged + num_tokens - 1) // num_tokens - 1

    @property
    def dest_tokens(self) -> torch.Tensor:
        """Raster index of each kept token: ``(1, K)`` int64 (for rotary positions)."""
        return self.keep[None]

    def merge(self, x: torch.Tensor, tiled: bool = False) -> torch.Tensor:
        """``(B, N, C)`` to the kept tokens ``(B, K, C)`` (``tiled`` is never set for the ideal)."""
        with profiled("ideal::merge"):
            if self.stride is not None:
                return x.unflatten(1, (self.num_merged, self.stride))[:, :, 0]
            return x.index_select(1, self.keep)

    def unmerge(self, y: torch.Tensor, tiled: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, K, C)`` back to ``(B, N, C)``, each output repeated over its tokens; with
        ``residual`` ``(B, N, C)``, ``residual`` plus that (the repeat is then a broadcast
        inside the add, so the ideal's unmerge costs no kernel where ToMA's fuses too)."""
        with profiled("ideal::unmerge"):
            if self.stride is not None:
                b, k, c = y.shape
                if residual is not None:
                    return (residual.reshape(b, k, self.stride, c) + y.unsqueeze(2)).view(b, self.num_tokens, c)
                return y.unsqueeze(2).expand(b, k, self.stride, c).reshape(b, self.num_tokens, c)
            out = y.index_select(1, self.owner)
            return out if residual is None else out + residual


class IdealPlanCache(PlanCache):
    """A :class:`PlanCache` whose plans are :class:`IdealPlan`: same ``K``, no selection."""

    def __init__(self, config: ToMAConfig, tile_frames: int = 1, reference: int | None = None) -> None:
        super().__init__(config, tile_frames, reference)
        self._ideal: dict[Hashable, IdealPlan] = {}

    def tile_order_layout(self, grid: tuple[int, ...], device: torch.device | None = None) -> None:  # type: ignore[override]
        """Never: the ideal keeps tokens in raster order (reordering would cost it copies)."""
        return None

    def get(
        self,
        x: torch.Tensor,
        grid: tuple[int, ...],
        group: Hashable,
        tiled: bool = False,  # type: ignore[override]
        ratio: float | None = None,
    ) -> IdealPlan | None:
        """The ideal plan for tokens ``x`` ``(B, N, C)`` on ``grid`` at ``ratio`` (default: the
        config's), or None (see PlanCache.get)."""
        ratio = self.config.ratio if ratio is None else ratio
        n = math.prod(grid)
        if ratio == 0 or x.shape[1] != n or n == 0:
            return None
        key = (grid, ratio, x.device)
        if key not in self._ideal:
            self._ideal[key] = IdealPlan(n, self.layout(*grid, ratio=ratio).num_merged, x.device)
        return self._ideal[key]


def apply_ideal(model: torch.nn.Module, ratio: float = 0.5, **options: Any) -> BaselinePatch:
    """Remove the tokens ToMA would remove, at the same modules, at zero merge cost.

    Args:
        model: a UNet or Flux denoiser that :func:`toma.apply_toma` supports.
        ratio: fraction of tokens removed, as for ToMA.
        **options: any :class:`toma.ToMAConfig` placement option (``levels``,
            ``merge_mlp``, ``tile_size`` (it sets ``K``), ``flux_double_blocks``, ...).
    """
    # the ideal removes tokens at zero cost: no attention bias either
    config = make_config(ratio=ratio, **{**options, "proportional_attention": False})
    found = adapter_for(model)
    if found is None:
        raise ValueError(f"{type(model).__name__} is not a denoiser ToMA supports, so it has no ideal placement")
    _check_clean(model)
    name, adapter = found
    targets, _ = adapter.find_targets(model, config)
    if not targets:
        raise ValueError(f"no blocks of {type(model).__name__} would be merged with these settings")
    cache = IdealPlanCache(config, adapter.tile_frames(config), getattr(adapter, "reference_tokens", None))
    ledger = Ledger()
    try:
        adapter.attach(model, targets, cache, ledger)
    except BaseException:
        ledger.close()
        raise
    patch = BaselinePatch("ideal", ratio, targets, {"placement": _placement(config, name)}, _ledger=ledger)
    setattr(model, _ATTR, patch)
    return patch


# ---------------------------------------------------------------------------- todo


def todo_pool(ratio: float) -> tuple[int, int]:
    """Key/value pooling window ``(rows, cols)`` that removes about ``ratio`` of the tokens."""
    if not 0 <= ratio < 1:
        raise ValueError(f"ratio must be in [0, 1); got {ratio}")
    factor = max(1, round(1 / (1 - ratio)))
    rows = max(d for d in range(1, math.isqrt(factor) + 1) if factor % d == 0)
    return rows, factor // rows


def apply_todo(model: torch.nn.Module, ratio: float = 0.5, **options: Any) -> BaselinePatch:
    """ToDo: self-attention at ToMA's UNet placement attends to pooled keys/values.

    Args:
        model: a diffusers UNet with ``BasicTransformerBlock`` attention.
        ratio: fraction of keys/values removed (rounded to a pooling window, see :func:`todo_pool`).
        **options: ToMA placement options; only ``levels`` matters (self-attention only).
    """
    found = adapter_for(model)
    if found is None or found[0] != "unet":
        raise ValueError(f"todo supports UNets only; got {type(model).__name__}")
    _check_clean(model)
    config = make_config(ratio=ratio, **{**options, "merge_attn": True, "merge_crossattn": False, "merge_mlp": False})
    targets, _ = found[1].find_targets(model, config)
    pool = todo_pool(ratio)
    cache = PlanCache(config)  # only its record of the latent grid is used
    hooked: list[tuple[torch.nn.Module, str]] = []
    HookRegistry.check_if_exists_or_initialize(model).register_hook(UNetStepHook(cache), _TODO_HOOK)
    hooked.append((model, _TODO_HOOK))
    for target in targets:
        HookRegistry.check_if_exists_or_initialize(target.module).register_hook(
            _ToDoHook(cache, target.downsample, pool), _TODO_HOOK
        )
        hooked.append((target.module, _TODO_HOOK))
    patch = BaselinePatch("todo", ratio, targets, {"pool": pool, "placement": _placement(config, "unet")})
    patch._hooked = hooked
    setattr(model, _ATTR, patch)
    return patch


class _ToDoHook(ModelHook):
    """Gives a self-attention pooled keys/values through ``encoder_hidden_states``."""

    def __init__(self, cache: PlanCache, downsample: int, pool: tuple[int, int]) -> None:
        super().__init__()
        self.cache = cache
        self.downsample = downsample
        self.pool = pool

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        x = args[0] if args else kwargs.get("hidden_states")
        grid = self.cache.grid_at(self.downsample)
        if grid is None or self.pool == (1, 1) or x is None or x.ndim != 3:
            return args, kwargs
        if kwargs.get("encoder_hidden_states") is not None or kwargs.get("attention_mask") is not None:
            return args, kwargs  # cross-attention, or a mask sized for the full sequence
        h, w = grid
        if x.shape[1] != h * w:
            return args, kwargs
        with profiled("todo::merge"):
            grid = x.transpose(1, 2).unflatten(2, (h, w))
            pooled = F.avg_pool2d(grid, self.pool, ceil_mode=True).flatten(2).transpose(1, 2)
        return args, {**kwargs, "encoder_hidden_states": pooled}


# ---------------------------------------------------------------------------- tomesd


def tomesd_available() -> bool:
    """Whether the optional ``tomesd`` package is installed."""
    return importlib.util.find_spec("tomesd") is not None


def tomesd_max_downsample(model: torch.nn.Module, **options: Any) -> int:
    """tomesd's ``max_downsample`` that merges the UNet levels ToMA merges with ``options``."""
    found = adapter_for(model)
    if found is None or found[0] != "unet":
        raise ValueError(f"tomesd supports UNets only; got {type(model).__name__}")
    targets, _ = found[1].find_targets(model, make_config(**options))
    return max(t.downsample for t in targets)


def apply_tomesd(
    model: torch.nn.Module, ratio: float = 0.5, max_downsample: int | None = None, **options: Any
) -> BaselinePatch:
    """Apply ToMeSD with ``ratio``; ``max_downsample`` defaults to ToMA's merged UNet levels.

    Raises:
        ModuleNotFoundError: tomesd is not installed (``pip install toma-diffusion[peers]``).
    """
    if not tomesd_available():
        raise ModuleNotFoundError("tomesd is not installed; pip install 'toma-diffusion[peers]'", name="tomesd")
    import tomesd

    _check_clean(model)
    if max_downsample is None:
        max_downsample = tomesd_max_downsample(model, **options)
    merge_mlp = bool(options.get("merge_mlp", False))
    tomesd.apply_patch(
        model, ratio=ratio, max_downsample=max_downsample, merge_attn=True, merge_crossattn=False, merge_mlp=merge_mlp
    )
    patch = BaselinePatch("tomesd", ratio, [], {"max_downsample": max_downsample, "merge_mlp": merge_mlp})
    setattr(model, _ATTR, patch)
    return patch


@contextlib.contextmanager
def tomesd_profiled() -> Iterator[None]:
    """Label tomesd's work for the profiler while the block is active.

    ``tomesd::select`` covers its matching (similarities, argsort, index bookkeeping);
    ``tomesd::merge`` / ``tomesd::unmerge`` its gather/scatter functions. This swaps the
    module-level ``tomesd.patch.compute_merge`` and puts it back on exit, so use it only
    around a profiling pass, never while another thread runs tomesd.
    """
    if not tomesd_available():
        yield
        return
    import tomesd.merge
    import tomesd.patch

    original = tomesd.patch.compute_merge

    def labelled(fn: Any, name: str) -> Any:
        if fn is tomesd.merge.do_nothing:
            return fn

        def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            with profiled(name):
                return fn(x, *args, **kwargs)

        return run

    def compute_merge(x: torch.Tensor, info: dict[str, Any]) -> tuple:
        with profiled("tomesd::select"):
            fns = original(x, info)
        names = ["tomesd::merge"] * 3 + ["tomesd::unmerge"] * 3
        return tuple(labelled(fn, name) for fn, name in zip(fns, names))

    tomesd.patch.compute_merge = compute_merge
    try:
        yield
    finally:
        tomesd.patch.compute_merge = original


# ---------------------------------------------------------------------------- helpers


def _check_clean(model: torch.nn.Module) -> None:
    if get_toma(model) is not None or get_baseline(model) is not None:
        raise RuntimeError("the model already has ToMA or a baseline applied; remove it first")


def _placement(config: ToMAConfig, adapter: str) -> dict[str, Any]:
    if adapter == "flux":
        return {"flux_double_blocks": config.flux_double_blocks, "flux_single_blocks": config.flux_single_blocks}
    return {"levels": config.levels, "merge_attn": config.merge_attn, "merge_mlp": config.merge_mlp}
