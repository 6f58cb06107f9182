"""Patching a ComfyUI MODEL with ToMA: validation, the hooks, and the per-run state.

:func:`patch_model` checks every input, finds the denoiser's family
(:mod:`toma.comfyui.families`), checks the hooks it needs (:mod:`toma.comfyui.hooks`) and
returns a patched clone of the ModelPatcher; the model it was given is never changed.

The maths is :mod:`toma.core`'s, through :class:`toma.adapters.state.PlanCache` (the same
plans as on the diffusers path): facility-location selection in tiles, merge and unmerge
as matmuls, one plan per sample (cond and uncond of a CFG batch get their own), built at
the first merged block of a denoiser call and reused by the rest of that call.

Where state lives: a :class:`ComfyRun` per patched clone holds the plans of the current
denoiser call (reset by the APPLY_MODEL wrapper at each call) and the counts of the current
sampling run (reset and logged by the OUTER_SAMPLE wrapper).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch

from toma.adapters.state import PlanCache
from toma.comfyui import hooks
from toma.comfyui.families import ComfyFamily, class_name, family_of
from toma.config import ToMAConfig
from toma.core.plan import Plan

log = logging.getLogger("toma.comfyui")

MLP_CHOICES = ("auto", "on", "off")


def _check_inputs(
    ratio: Any, tile_size: Any, start_percent: Any, end_percent: Any, merge_mlp: Any, proportional_attention: Any
) -> None:
    """Raise a ValueError or TypeError naming the first bad input (API prompts bypass the
    widgets' limits)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio must be a number in [0, 1) (the fraction of image tokens merged away); got {ratio!r}")
    if isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size < 0:
        raise ValueError(
            f"tile_size must be a positive integer (tokens per tile side), or 0 for auto; got {tile_size!r}"
        )
    for name, value in (("start_percent", start_percent), ("end_percent", end_percent)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be a number in [0, 1]; got {value!r}")
    if start_percent > end_percent:
        raise ValueError(
            f"start_percent ({start_percent}) is after end_percent ({end_percent}): the merging window would be empty"
        )
    if merge_mlp not in MLP_CHOICES:
        raise ValueError(f"merge_mlp must be one of {', '.join(MLP_CHOICES)}; got {merge_mlp!r}")
    if not isinstance(proportional_attention, bool):
        raise ValueError(f"proportional_attention must be true or false; got {proportional_attention!r}")


def parse_blocks(
    text: Any, stacks: dict[str, int], defaults: dict[str, tuple[int, ...]], first: int = 0
) -> dict[str, tuple[int, ...]]:
    """The blocks to merge, from the node's ``blocks`` input.

    ``text`` is empty or ``"auto"`` for the family's ``defaults``, else whitespace-separated
    ``stack:indices`` groups, indices being comma-separated ints and inclusive ranges
    (``double:5-18 single:0,2,4-37``), ``all`` or ``none``. ``stacks`` maps each stack name
    to its number of blocks. Stacks left out merge nothing. The text counts from ``first``
    (the UNet's levels from 1, as its docs and log line do); the result counts from 0.
    """
    if not isinstance(text, str):
        raise ValueError(f"blocks must be a string such as 'double:5-18 single:all'; got {text!r}")
    text = text.strip()
    if text in ("", "auto"):
        return dict(defaults)
    out: dict[str, tuple[int, ...]] = {}
    allowed = ", ".join(stacks)
    for group in text.split():
        stack, sep, spec = group.partition(":")
        if not sep or not spec:
            raise ValueError(f"blocks: {group!r} is not 'stack:indices' (stacks here: {allowed})")
        if stack not in stacks:
            raise ValueError(f"blocks: unknown block stack {stack!r} for this model; allowed: {allowed}")
        count = stacks[stack]
        if spec == "all":
            out[stack] = tuple(range(count))
            continue
        if spec == "none":
            out[stack] = ()
            continue
        picked: set[int] = set()
        for item in spec.split(","):
            lo, dash, hi = item.partition("-")
            try:
                lo_i, hi_i = int(lo), int(hi) if dash else int(lo)
            except ValueError:
                raise ValueError(f"blocks: {item!r} in {group!r} is not an index or a range a-b") from None
            if lo_i > hi_i or lo_i < first or hi_i >= count + first:
                raise ValueError(
                    f"blocks: {stack} {item!r} is outside {first}-{count - 1 + first} ({count} {stack} blocks here)"
                )
            picked.update(range(lo_i - first, hi_i - first + 1))
        out[stack] = tuple(sorted(picked))
    return out


def _ranges(indices: Any) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"``."""
    parts, run = [], []
    for i in sorted(indices):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


class ComfyRun:
    """The state of one patched model: settings, the current call's plans, the run's counts.

    Args:
        family: the model's family.
        config: the ToMA settings (ratio, tile size, proportional attention).
        blocks: the blocks to merge, ``{stack: indices}``.
        window: ``(sigma_start, sigma_end)``: calls whose sigma is outside merge nothing;
            read again from ``percents`` at the start of each sampling run (:meth:`read_window`).
        patch: latent pixels per token side, or ``(frames, height, width)`` for video.
        levels: UNet only: downsample factors whose self-attention merges.
        percents: ``(start_percent, end_percent)`` the window was read from.
    """

    def __init__(
        self,
        family: ComfyFamily,
        config: ToMAConfig,
        blocks: dict[str, tuple[int, ...]],
        window: tuple[float, float],
        patch: int | tuple[int, int, int] = 1,
        levels: tuple[int, ...] = (),
        percents: tuple[float, float] = (0.0, 1.0),
    ) -> None:
        self.family = family
        self.percents = percents
        self.config = config
        self.blocks = blocks
        self.window = window
        self.patch = patch
        self.levels = levels
        self.cache = PlanCache(config, reference=family.reference)
        self.latent_hw: tuple[int, int] | None = None
        self.grid: tuple[int, ...] | None = None  # the denoiser's token grid at this call
        self.merging = False
        self.pending: list[tuple[Plan, int]] = []  # UNet: plans whose attn1 output awaits unmerging
        # the key bias (log masses) the attention override hands the next merged attention call
        self.bias: torch.Tensor | None = None
        self.begin_run()

    # -- per run ---------------------------------------------------------------------------
    def begin_run(self) -> None:
        """Forget the counts of the previous sampling run."""
        self.calls = 0
        self.merged_calls = 0
        self.tokens: tuple[int, int] | None = None
        self.merged_blocks: dict[str, set] = {}
        self.window_calls = 0
        self.skipped: str | None = None
        self.warned: set[str] = set()

    def unmerged(self, reason: str) -> None:
        """Record that a call runs unmerged for ``reason``, warned once per sampling run
        (other calls of the run may still merge, so the run's report would not say it)."""
        self.skipped = reason
        if reason not in self.warned:
            self.warned.add(reason)
            log.warning("ToMA (%s): a layer runs unmerged: %s", self.family.name, reason)

    def report(self) -> None:
        """Log the run's one line: what merged, or a warning saying why nothing did."""
        name = self.family.name
        if self.merged_calls == 0:
            reason = self.skipped or self._why_nothing()
            log.warning("ToMA (%s): nothing merged in this run: %s", name, reason)
            return
        where = "; ".join(f"{stack} {_ranges(idx)}" for stack, idx in sorted(self.merged_blocks.items()))
        n, k = self.tokens or (0, 0)
        log.info(
            "ToMA (%s): merged %s in %d of %d denoiser calls; image tokens %d -> %d; ratio %g",
            name,
            where,
            self.merged_calls,
            self.calls,
            n,
            k,
            self.config.ratio,
        )

    def _why_nothing(self) -> str:
        if self.config.ratio == 0:
            return "ratio is 0"
        if not any(self.blocks.values()):
            return "no block selected (see the blocks input; the default skips the first blocks)"
        if self.calls and not self.window_calls:
            return "no step fell inside start_percent / end_percent"
        return "the selected blocks never ran with a grid that merges"

    def read_window(self, sampling: Any) -> None:
        """Read the window from the model sampling of the model being sampled: a node put
        after ToMA (ModelSamplingSD3, ModelSamplingFlux, ...) replaces the schedule, and
        ComfyUI's own nodes read their percents at sampling time too."""
        to_sigma = getattr(sampling, hooks.PERCENT_TO_SIGMA, None)
        if to_sigma is not None:
            self.window = (float(to_sigma(self.percents[0])), float(to_sigma(self.percents[1])))

    # -- per denoiser call -----------------------------------------------------------------
    def _in_window(self, sigma: float) -> bool:
        start, end = self.window
        return end <= sigma <= start

    def begin_call(self, x: torch.Tensor, sigma: torch.Tensor) -> None:
        """Start a denoiser call on latent ``x`` at ``sigma``: drop the last call's plans."""
        # one sigma per call (cond and uncond share it); max() reads it whatever the batch
        s = float(sigma.max()) if isinstance(sigma, torch.Tensor) else float(sigma)
        self.calls += 1
        inside = self._in_window(s)
        self.window_calls += inside
        self.latent_hw = (int(x.shape[-2]), int(x.shape[-1]))
        self.merging = self.config.ratio > 0 and inside
        self.pending.clear()
        self.bias = None
        # the denoisers pad the latent up to whole patches: tokens are ceil(size / patch)
        if isinstance(self.patch, tuple):
            self.grid = tuple(math.ceil(int(size) / p) for size, p in zip(x.shape[-3:], self.patch))
        else:
            self.grid = tuple(math.ceil(size / self.patch) for size in self.latent_hw)
        self.cache.begin_forward(self.grid, None)
        self._counted = False

    def plan(self, tokens: torch.Tensor, grid: tuple[int, int], group: Any) -> Plan | None:
        """The plan for image tokens ``(B, N, C)`` on ``grid``, or None where nothing merges
        (outside the window, ratio 0, or a grid too small to lose a token)."""
        if not self.merging:
            return None
        plan = self.cache.get(tokens, grid, group)
        if plan is None:
            return None
        if plan.num_merged >= tokens.shape[1]:
            self.skipped = f"the {grid[0]}x{grid[1]} token grid is too small to merge at ratio {self.config.ratio}"
            return None
        return plan

    def count(self, stack: str, index: int, n: int, k: int) -> None:
        """Record that block ``index`` of ``stack`` merged ``n`` image tokens into ``k``."""
        if not self._counted:
            self.merged_calls += 1
            self._counted = True
        if self.tokens is None:
            self.tokens = (n, k)
        self.merged_blocks.setdefault(stack, set()).add(index)


def tome_patch_in(options: dict) -> bool:
    """Whether ``transformer_options`` hold ComfyUI's TomePatchModel's attn1 patches."""
    patches = (options or {}).get(hooks.TO_PATCHES, {})
    found = [*patches.get(hooks.ATTN1_PATCH, ()), *patches.get(hooks.ATTN1_OUTPUT_PATCH, ())]
    return any(getattr(p, "__qualname__", "").startswith(hooks.TOME_PATCH_QUALNAME) for p in found)


_TOME = "ComfyUI's TomePatchModel is applied to this model too: two token mergings do not compose"
_MULTIGPU = (
    "ComfyUI's multi-GPU CFG split runs this model's calls from several threads at once, which toma's "
    "ComfyUI node does not support yet: its calls run unmerged"
)


# -- wrappers ---------------------------------------------------------------------------------
def _sampling_of(executor: Any) -> Any:
    """The model sampling of the ModelPatcher an OUTER_SAMPLE executor samples (its guider's),
    with the object patches of every node up to the sampler; None where it cannot be read."""
    guider = getattr(executor, hooks.EXECUTOR_CLASS_OBJ, None)
    get = getattr(getattr(guider, hooks.GUIDER_PATCHER, None), "get_model_object", None)
    return None if get is None else get(hooks.MODEL_SAMPLING)


def _outer_sample(run: ComfyRun) -> Callable:
    def wrapper(executor: Any, *args: Any, **kwargs: Any) -> Any:
        run.begin_run()
        sampling = _sampling_of(executor)
        if sampling is not None:
            run.read_window(sampling)
        out = executor(*args, **kwargs)
        run.report()
        return out

    return wrapper


def _apply_model(run: ComfyRun, override: Callable | None) -> Callable:
    def wrapper(executor: Any, x: torch.Tensor, t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        run.begin_call(x, t)
        options = kwargs.get(hooks.TO_TRANSFORMER_OPTIONS)
        if options is None:  # positional: (c_concat, c_crossattn, control, transformer_options)
            options = next((a for a in reversed(args) if isinstance(a, dict)), None)
        if options is not None and tome_patch_in(options):
            # TomePatchModel was put on after toma: toma steps aside, and says so
            run.merging = False
            run.skipped = _TOME
        if options is not None and options.get(hooks.TO_MULTIGPU_DEVICE) is not None:
            # the devices' shares run at once, from threads of their own, through this one
            # patched clone, whose per-call state (plans, the armed key bias) is one
            run.merging = False
            run.unmerged(_MULTIGPU)
        if override is not None and options is not None:
            _chain_override(options, override)
        try:
            return executor(x, t, *args, **kwargs)
        finally:
            run.pending.clear()
            run.bias = None

    return wrapper


def _chain_override(options: dict, ours: Callable) -> None:
    """Put ``ours`` in front of whatever attention override this call has: one slot, which
    other nodes fill too, so it is re-chained at every call rather than set once."""
    found = options.get(hooks.TO_ATTENTION_OVERRIDE)
    if getattr(found, "toma_run", None) is ours:
        return

    def chained(func: Callable, *args: Any, **kwargs: Any) -> Any:
        inner = func if found is None else (lambda *a, **k: found(func, *a, **k))
        return ours(inner, *args, **kwargs)

    chained.toma_inner = found  # type: ignore[attr-defined]
    chained.toma_run = ours  # type: ignore[attr-defined]
    options[hooks.TO_ATTENTION_OVERRIDE] = chained


# -- proportional attention through ComfyUI's attention override ---------------------------
class KeyBias:
    """The attention override of proportional attention: adds the armed key bias
    (``run.bias``, ``(Bp, K)`` log masses) to the first attention call whose keys are the
    ``K`` merged tokens, then disarms it, so no other attention call ever gets it."""

    def __init__(self, run: ComfyRun) -> None:
        self.run = run

    def __call__(self, func: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any):
        """As ComfyUI calls an override: the attention function, then its arguments
        ``(q, k, v, heads, mask=None, ...)``, the mask by keyword or by position."""
        bias = self.run.bias
        if bias is None or bias.shape[-1] != k.shape[-2]:  # keys on dim -2 flat or per head
            return func(q, k, v, *args, **kwargs)
        positional = len(args) > 1
        mask = args[1] if positional else kwargs.get(hooks.ATTN_MASK)
        bias = bias.to(q.dtype)[:, None, None, :]
        if mask is not None:
            # a key mask (the text's padding) composes by addition; any other mask is left be
            if not mask.is_floating_point() or mask.shape[-1] != bias.shape[-1] or mask.ndim not in (3, 4):
                return func(q, k, v, *args, **kwargs)
            if mask.ndim == 3 and mask.shape[1] != 1:
                return func(q, k, v, *args, **kwargs)
            bias = (mask if mask.ndim == 4 else mask[:, None]) + bias
        self.run.bias = None  # taken by this call: never by a later one
        if positional:
            args = (args[0], bias, *args[2:])
        else:
            kwargs[hooks.ATTN_MASK] = bias
        return func(q, k, v, *args, **kwargs)


# -- the node's work --------------------------------------------------------------------------
def _refuse(model: Any, reason: str) -> Any:
    log.warning("ToMA: not patching this model: %s (tested on ComfyUI %s)", reason, hooks.TESTED_VERSION)
    return model


def patch_model(
    model: Any,
    ratio: float = 0.5,
    tile_size: int = 0,
    start_percent: float = 0.0,
    end_percent: float = 1.0,
    blocks: str = "",
    merge_mlp: str = "auto",
    proportional_attention: bool = True,
) -> Any:
    """A clone of ComfyUI ModelPatcher ``model`` that merges tokens with ToMA; ``model``
    itself is left as it was.

    Bad input raises a ValueError naming it, before anything is cloned. A family toma does
    not merge, or a ComfyUI whose hooks differ from what toma expects, is refused: one
    warning with the reason, and ``model`` comes back unpatched.

    Args:
        model: a ComfyUI MODEL (``comfy.model_patcher.ModelPatcher``).
        ratio: fraction of image tokens merged away, in [0, 1).
        tile_size: tile side in tokens; 0 scales it to the grid (auto).
        start_percent, end_percent: the part of the schedule that merges, read as ComfyUI's
            own nodes read them (``percent_to_sigma``, compared with each call's sigma).
        blocks: which blocks merge (:func:`parse_blocks`); empty: the family's default.
        merge_mlp: "auto" (the family's way), "on" or "off"; refused where the family's
            hook cannot honour it.
        proportional_attention: weight merged keys by the tokens they stand for.
    """
    _check_inputs(ratio, tile_size, start_percent, end_percent, merge_mlp, proportional_attention)
    base = getattr(model, hooks.PATCHER_MODEL, None)
    dm = getattr(base, hooks.DIFFUSION_MODEL, None)
    if dm is None:
        raise ValueError("model must be a ComfyUI MODEL (a ModelPatcher whose model has a diffusion_model)")
    family = family_of(dm)
    if family is None:
        return _refuse(model, f"toma does not know the denoiser class {class_name(type(dm))}")
    if not family.merges:
        return _refuse(model, family.reason or "no hook")
    wrappers = getattr(model, hooks.PATCHER_WRAPPERS, None) or {}
    if any(hooks.WRAPPER_KEY in by_key for by_key in wrappers.values()):
        return _refuse(model, "ToMA is already applied to this model (an earlier ToMA node); apply it once")
    if tome_patch_in(getattr(model, hooks.MODEL_OPTIONS, {}).get(hooks.TO_TRANSFORMER_OPTIONS, {})):
        return _refuse(model, _TOME + "; remove one of them")
    site = family.site
    problem = hooks.first_problem(hooks.COMMON + family.needs)
    if problem is None and proportional_attention and site.override:
        problem = hooks.first_problem(hooks.ATTENTION_OVERRIDE_NEEDS)
    if problem is not None:
        return _refuse(model, problem)
    refusal = site.mlp_refusal(merge_mlp, family.title)
    if refusal is not None:
        raise ValueError(refusal)
    counts = site.counts(dm)
    chosen, levels = site.resolve(dm, parse_blocks(blocks, counts, site.defaults(dm, counts), first=site.first))

    sampling = model.get_model_object(hooks.MODEL_SAMPLING)
    to_sigma = getattr(sampling, hooks.PERCENT_TO_SIGMA)
    window = (float(to_sigma(start_percent)), float(to_sigma(end_percent)))
    config = ToMAConfig(
        ratio=float(ratio),
        tile_size="auto" if tile_size == 0 else int(tile_size),
        proportional_attention=proportional_attention,
    )
    run = ComfyRun(
        family, config, chosen, window, patch=site.patch(dm), levels=levels, percents=(start_percent, end_percent)
    )

    clone = model.clone()
    site.install(clone, model, dm, run, chosen, proportional_attention)
    override = KeyBias(run) if proportional_attention and site.override else None
    kinds = hooks.resolve(hooks.WRAPPERS)
    clone.add_wrapper_with_key(getattr(kinds, hooks.OUTER_SAMPLE), hooks.WRAPPER_KEY, _outer_sample(run))
    clone.add_wrapper_with_key(getattr(kinds, hooks.APPLY_MODEL), hooks.WRAPPER_KEY, _apply_model(run, override))
    clone.toma_run = run  # for tests and for nodes that want to read what merged
    return clone
