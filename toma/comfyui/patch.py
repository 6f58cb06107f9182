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

import copy
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from toma.adapters.state import PlanCache
from toma.comfyui import hooks
from toma.comfyui.families import ComfyFamily, class_name, family_of
from toma.config import ToMAConfig
from toma.core.plan import Plan

log = logging.getLogger("toma.comfyui")

MLP_CHOICES = ("auto", "on", "off")
# the authors' Flux default, which toma's diffusers path keeps for Wan too: every block but
# the first few, which lay out the image
SKIPPED_BLOCKS = 5


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


def unet_attention_levels(unet: torch.nn.Module) -> list[int]:
    """The spatial downsample factors (1, 2, 4, ...) of a ComfyUI UNet's input blocks that hold
    a SpatialTransformer, ascending: SD 1.x has ``[1, 2, 4]``, SDXL ``[2, 4]``."""
    spatial = hooks.resolve(hooks.SPATIAL_TRANSFORMER)
    down = hooks.resolve(hooks.UNET_DOWNSAMPLE)
    ds, levels = 1, []
    for block in getattr(unet, hooks.UNET_INPUT_BLOCKS):
        mods = list(block.modules())
        if any(isinstance(m, spatial) for m in mods) and ds not in levels:
            levels.append(ds)
        if any(isinstance(m, down) for m in mods):
            ds *= 2
    return levels


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


# -- Flux -------------------------------------------------------------------------------------
def _gather_rows(table: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows ``index`` ``(Bp, L')`` along ``dim`` of a rotary table ``(B or 1, ..., L, ...)``,
    per sample: ``(max(B, Bp), ..., L', ...)``."""
    b = max(table.shape[0], index.shape[0])
    table = table.expand(b, *table.shape[1:])
    view = [b] + [1] * (table.ndim - 1)
    view[dim] = index.shape[1]
    sizes = list(table.shape)
    sizes[dim] = index.shape[1]
    return torch.gather(table, dim, index.expand(b, -1).reshape(view).expand(sizes))


def _kept_rows(plan: Plan, text: int, n: int, total: int, device: torch.device) -> torch.Tensor:
    """``(Bp, text + K + total - text - n)``: the sequence positions a merged sequence keeps
    (text, each merged token's destination, the tokens after the image)."""
    dest = plan.dest_tokens.to(device) + text
    bp = dest.shape[0]
    head = torch.arange(text, device=device).expand(bp, -1)
    tail = torch.arange(text + n, total, device=device).expand(bp, -1)
    return torch.cat((head, dest, tail), 1)


def _key_bias(plan: Plan, text: int, tail: int, dtype: torch.dtype) -> torch.Tensor:
    """``(Bp, 1, 1, text + K + tail)`` additive key bias of proportional attention: each merged
    key's log mass, 0 for the others."""
    lm = plan.log_mass.to(dtype)
    bp = lm.shape[0]
    zeros = lm.new_zeros
    return torch.cat((zeros(bp, text), lm, zeros(bp, tail)), 1)[:, None, None, :]


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in a block's ``vec``: a tensor, a tuple of them, or of ComfyUI's
    modulation records (whose ``shift`` is one)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
        return None
    return _first_tensor(getattr(value, hooks.MODULATION_SHIFT, None))


def _segment_modulation(vec: Any, batch: int) -> bool:
    """Whether Flux modulates spans of the sequence apart (Kontext's reference tokens at
    timestep zero): the modulation then addresses tokens by position, which merging moves."""
    t = _first_tensor(vec)
    return t is not None and (t.shape[0] != batch or (t.ndim == 3 and t.shape[1] > 1))


@dataclass(frozen=True)
class JointLayout:
    """How a joint-stream family's block replacement passes its block (Flux, HunyuanVideo).

    Attributes:
        mask_key: the ``args`` key of the attention mask (an additive key mask over
            ``[text; image]``), or None where the block takes none: proportional attention
            then goes through the attention override (:class:`KeyBias`).
        fixed_keys: ``args`` keys which, when set, address tokens by position (modulation
            spans): such a call runs unmerged, with the reason.
        tail: whether tokens may follow the image's (Kontext's references, passed whole).
    """

    mask_key: str | None
    fixed_keys: tuple[str, ...] = ()
    tail: bool = True


FLUX_LAYOUT = JointLayout(hooks.ARG_FLUX_MASK)
HUNYUAN_LAYOUT = JointLayout(hooks.ARG_HUNYUAN_MASK, fixed_keys=hooks.ARG_HUNYUAN_SPANS, tail=False)
JOINT_LAYOUT = JointLayout(None)  # Qwen-Image, SD3: no mask argument; SD3 has no rotary table either


def _slice_key_mask(mask: torch.Tensor, text: int, n: int, image_bias: torch.Tensor) -> torch.Tensor | None:
    """A key mask ``(B', 1, text + n + tail)`` over ``[text; image; tail]`` rebuilt for the
    merged sequence with ``image_bias`` ``(Bp, K)`` on the image's keys: ``(B, 1, 1, L')``.
    None where the mask is not such a key mask or is not 0 over the image's keys (a mask
    on the image itself, which merging cannot keep)."""
    if mask.ndim != 3 or mask.shape[1] != 1 or not mask.is_floating_point():
        return None
    if bool(mask[..., text : text + n].any()):
        return None
    b = max(mask.shape[0], image_bias.shape[0])
    head = mask[..., :text].expand(b, -1, -1)
    tail = mask[..., text + n :].expand(b, -1, -1)
    return torch.cat((head, image_bias.to(mask.dtype).expand(b, -1)[:, None], tail), -1)[:, :, None]


class JointBlock:
    """A joint-stream family's block replacement (Flux, HunyuanVideo): merge the image tokens
    entering a double or single block, run the block on ``K`` of them, and add the unmerged
    change to the full-size stream.

    The rotary table ``pe`` (over ``[text; image; tail]``) gets each merged token's
    destination's row, so that positions stay those of real tokens; text and any tokens
    after the image (Kontext's references) pass whole. Single blocks carry ``[text; image]``
    in ``img`` (``img_slice`` says where the image starts). ControlNet residuals are added
    by the model after the block, on full-size tokens. Proportional attention is the key
    mask the block takes anyway: the family's text mask, with ``log(mass)`` on merged keys.
    """

    def __init__(
        self, run: ComfyRun, layout: JointLayout, kind: str, index: int, proportional: bool, stack: str = ""
    ) -> None:
        self.run, self.layout, self.kind, self.index, self.proportional = run, layout, kind, index, proportional
        self.stack = stack or kind.split("_")[0]  # the blocks input's name for the block's stack

    def __call__(self, args: dict, extra: dict) -> dict:
        """The replacement, as ComfyUI calls it: ``args`` of the block, ``extra["original_block"]``."""
        original = extra[hooks.ORIGINAL_BLOCK]
        run, layout = self.run, self.layout
        if not run.merging or run.grid is None:
            return original(args)
        grid = run.grid
        n = math.prod(grid)
        seq = args[hooks.ARG_IMG]
        single = self.kind == hooks.SINGLE_BLOCK
        text = (args.get(hooks.TO_TRANSFORMER_OPTIONS) or {}).get(hooks.TO_IMG_SLICE, [0])[0] if single else 0
        tail = seq.shape[1] - text - n
        if tail < 0 or (tail and not layout.tail):
            run.skipped = "the sequence holds tokens besides the image's where this family keeps none"
            return original(args)
        if any(args.get(key) is not None for key in layout.fixed_keys) or _segment_modulation(
            args.get(hooks.ARG_VEC), seq.shape[0]
        ):
            run.skipped = "parts of the sequence are modulated apart (reference or guiding-frame timesteps)"
            return original(args)
        image = seq[:, text : text + n]
        plan = run.plan(image, grid, "dit")
        if plan is None:
            return original(args)
        pe_text = text if single else args[hooks.ARG_TXT].shape[1]
        mask = args.get(layout.mask_key) if layout.mask_key is not None else None
        bias = plan.log_mass if self.proportional else plan.log_mass.new_zeros(plan.log_mass.shape)
        new = dict(args)
        if mask is not None:
            new[layout.mask_key] = _slice_key_mask(mask, pe_text, n, bias)
            if new[layout.mask_key] is None:
                run.skipped = "the attention mask covers image tokens, which toma does not merge yet"
                return original(args)
        elif self.proportional and layout.mask_key is not None:
            new[layout.mask_key] = _key_bias(plan, pe_text, tail, seq.dtype)
        merged = plan.merge(image)
        k = merged.shape[1]
        if args.get(hooks.ARG_PE) is not None:
            pe_len = pe_text + n + tail
            new[hooks.ARG_PE] = _gather_rows(
                args[hooks.ARG_PE], _kept_rows(plan, pe_text, n, pe_len, seq.device), dim=2
            )
        # the block adds to its input in place: it gets a copy, ``merged`` stays M x
        new[hooks.ARG_IMG] = torch.cat((seq[:, :text], merged, seq[:, text + n :]), 1)
        if self.proportional and layout.mask_key is None:  # the block's joint attention takes it
            run.bias = _key_bias(plan, pe_text, tail, seq.dtype)[:, 0, 0]
        try:
            out = original(new)
        finally:
            run.bias = None
        y = out[hooks.ARG_IMG]
        image_out = plan.unmerge(y[:, text : text + k] - merged, residual=image)
        run.count(self.stack, self.index, n, k)
        result = dict(out)
        result[hooks.ARG_IMG] = torch.cat((y[:, :text], image_out, y[:, text + k :]), 1)
        return result


# -- Wan -------------------------------------------------------------------------------------
class WanBlock:
    """Wan's block replacement: the block (self-attention, cross-attention queries and the
    MLP) runs on ``K`` merged video tokens, and its change is unmerged onto the full stream.

    The rotary table ``pe`` (``(1, N, 1, ...)``, tokens on dim 1) gets each merged token's
    destination's row. Proportional attention goes through the attention override: the key
    bias is armed for the block's first attention call, its self-attention.
    """

    def __init__(self, run: ComfyRun, index: int, proportional: bool) -> None:
        self.run, self.index, self.proportional = run, index, proportional

    def __call__(self, args: dict, extra: dict) -> dict:
        """The replacement, as ComfyUI calls it: ``args`` of the block, ``extra["original_block"]``."""
        original = extra[hooks.ORIGINAL_BLOCK]
        run = self.run
        if not run.merging or run.grid is None:
            return original(args)
        x, vec = args[hooks.ARG_IMG], args[hooks.ARG_VEC]
        n = math.prod(run.grid)
        if x.shape[1] != n:
            run.skipped = "the sequence holds tokens besides the video's (reference or context latents)"
            return original(args)
        if vec.ndim >= 3 and vec.shape[1] != 1:
            run.skipped = "the timestep embedding is per token (Wan 2.2 TI2V), which toma does not merge yet"
            return original(args)
        plan = run.plan(x, run.grid, "dit")
        if plan is None:
            return original(args)
        merged = plan.merge(x)
        new = dict(args)
        new[hooks.ARG_IMG] = merged
        if args.get(hooks.ARG_PE) is not None:
            new[hooks.ARG_PE] = _gather_rows(args[hooks.ARG_PE], plan.dest_tokens.to(x.device), dim=1)
        if self.proportional:
            run.bias = plan.log_mass
        try:
            out = original(new)
        finally:
            run.bias = None
        result = dict(out)
        result[hooks.ARG_IMG] = plan.unmerge(out[hooks.ARG_IMG] - merged, residual=x)
        run.count("blocks", self.index, n, merged.shape[1])
        return result


# -- Z-Image / Lumina 2 (NextDiT) -------------------------------------------------------------
def _fit_key_mask(mask: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor | None:
    """A key mask over the ``length`` positions of the sequence (``(B, L)``, ``(B, 1, L)`` or
    ``(B, 1, 1, L)``, boolean or additive) taken at ``rows`` ``(Bp, L')``: ``(B', 1, 1, L')``
    additive. None where it is no key mask (it masks queries too, or its shape is another),
    which merging cannot keep."""
    if mask.shape[-1] != length or mask.ndim not in (2, 3, 4) or any(d != 1 for d in mask.shape[1:-1]):
        return None
    flat = mask.reshape(mask.shape[0], length)
    if flat.dtype == torch.bool:
        # additive, so that the key bias of proportional attention can join it
        flat = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device).masked_fill(~flat, float("-inf"))
    b = max(flat.shape[0], rows.shape[0])
    return torch.gather(flat.expand(b, -1), 1, rows.expand(b, -1))[:, None, None, :]


class NextDiTLayer:
    """One of NextDiT's main layers, merged: the layer runs on ``[caption; K merged image
    tokens; image pad]`` and its change to the image tokens is unmerged onto the full stream.

    NextDiT has no block replacement, so the layer is reached through an object patch: a
    shallow copy of the layer (:meth:`stand_in`), which shares the layer's submodules,
    parameters and hooks (weight patches such as LoRA and ComfyUI's casting reach them
    under the same names) and whose ``forward`` is :meth:`forward`; ComfyUI puts the
    original back when it unpatches, and the layer itself is never changed.

    The sequence is the caption (padded to ``multiple``), then the image tokens in raster
    order, then the image's pad tokens: the caption and the pads pass whole, their rotary
    rows too, and each merged token takes its destination's row of ``freqs_cis`` (tokens on
    dim 1). A key mask is taken at the kept positions; any other mask, and omni mode (parts
    of the sequence modulated apart by ``timestep_zero_index``), run the layer unmerged.
    Proportional attention goes through the attention override: a key bias over the whole
    merged sequence, armed for the layer's attention call.
    """

    def __init__(self, run: ComfyRun, index: int, layer: torch.nn.Module, proportional: bool, multiple: Any) -> None:
        self.run, self.index, self.layer, self.proportional = run, index, layer, proportional
        self.multiple = int(multiple) if multiple else 0

    def stand_in(self) -> torch.nn.Module:
        """The object that replaces the layer while the model is patched."""
        twin = copy.copy(self.layer)  # shares _modules, _parameters, _buffers and the hooks
        twin.forward = self.forward  # on toma's copy only
        twin.toma_layer = self
        return twin

    @staticmethod
    def original(layer: Any) -> Any:
        """``layer`` without toma's stand-ins: while another patched clone of the same model
        is loaded, its stand-ins sit in the model, and ``get_model_object`` returns them."""
        while isinstance(getattr(layer, "toma_layer", None), NextDiTLayer):
            layer = layer.toma_layer.layer
        return layer

    def forward(
        self,
        x: torch.Tensor,
        x_mask: torch.Tensor | None = None,
        freqs_cis: torch.Tensor | None = None,
        adaln_input: torch.Tensor | None = None,
        timestep_zero_index: Any = None,
        transformer_options: dict | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The layer's forward, as NextDiT calls it, on merged image tokens where they merge."""
        run = self.run
        options = {} if transformer_options is None else transformer_options

        def call(seq: torch.Tensor, mask: Any, pe: Any) -> torch.Tensor:
            extra = {"timestep_zero_index": timestep_zero_index, "transformer_options": options, **kwargs}
            return self.layer.forward(seq, mask, pe, adaln_input, **extra)

        if not run.merging or run.grid is None:
            return call(x, x_mask, freqs_cis)
        if timestep_zero_index is not None:
            run.unmerged("omni mode modulates parts of the sequence apart (references), which toma does not merge")
            return call(x, x_mask, freqs_cis)
        n = math.prod(run.grid)
        length = x.shape[1]
        text = length - n - (-n % self.multiple if self.multiple else 0)
        if text < 0 or freqs_cis is None or freqs_cis.shape[1] != length:
            run.unmerged("the sequence is not [caption; image; pad] as toma expects of NextDiT")
            return call(x, x_mask, freqs_cis)
        image = x[:, text : text + n]
        plan = run.plan(image, run.grid, "dit")
        if plan is None:
            return call(x, x_mask, freqs_cis)
        rows = _kept_rows(plan, text, n, length, x.device)
        mask = x_mask
        if x_mask is not None:
            mask = _fit_key_mask(x_mask, rows, length)
            if mask is None:
                run.unmerged(f"the attention mask {tuple(x_mask.shape)} is not a mask over keys, which merging keeps")
                return call(x, x_mask, freqs_cis)
        merged = plan.merge(image)
        k = merged.shape[1]
        pe = _gather_rows(freqs_cis, rows, dim=1)
        seq = torch.cat((x[:, :text], merged, x[:, text + n :]), 1)
        if self.proportional:
            run.bias = _key_bias(plan, text, length - text - n, x.dtype)[:, 0, 0]
        try:
            out = call(seq, mask, pe)
        finally:
            run.bias = None
        image_out = plan.unmerge(out[:, text : text + k] - merged, residual=image)
        run.count("layers", self.index, n, k)
        return torch.cat((out[:, :text], image_out, out[:, text + k :]), 1)


# -- SD / SDXL UNet ---------------------------------------------------------------------------
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


class UNetAttn1:
    """The UNet's self-attention, merged: ``attn1_patch`` merges the normed tokens (queries,
    keys and values alike, unlike ComfyUI's TomePatchModel) before the projections, and
    ``attn1_output_patch`` unmerges the attention's output before the residual add."""

    def __init__(self, run: ComfyRun, proportional: bool) -> None:
        self.run, self.proportional = run, proportional

    def _level(self, tokens: int) -> tuple[int, tuple[int, int]] | None:
        h, w = self.run.latent_hw
        for ds in self.run.levels:
            grid = (math.ceil(h / ds), math.ceil(w / ds))
            if grid[0] * grid[1] == tokens:
                return ds, grid
        return None

    def before(self, n: torch.Tensor, context: Any, value: Any, extra_options: dict) -> tuple:
        """``attn1_patch``: merge ``n`` (and the keys and values where they are ``n``)."""
        run = self.run
        if not run.merging or run.latent_hw is None:
            return n, context, value
        found = self._level(n.shape[1])
        if found is None:
            return n, context, value
        ds, grid = found
        plan = run.plan(n, grid, ("unet", ds))
        if plan is None:
            return n, context, value
        merged = plan.merge(n)
        run.pending.append((plan, merged.shape[1]))
        if self.proportional:
            run.bias = plan.log_mass
        run.count("levels", run.levels.index(ds) + 1, n.shape[1], merged.shape[1])
        return merged, merged if context is n else context, merged if value is n else value

    def after(self, n: torch.Tensor, extra_options: dict) -> torch.Tensor:
        """``attn1_output_patch``: unmerge the attention output merged by :meth:`before`."""
        run = self.run
        if not run.pending or run.pending[-1][1] != n.shape[1]:
            return n
        plan, _ = run.pending.pop()
        run.bias = None  # in case no attention call took it
        return plan.unmerge(n)


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
    problem = hooks.first_problem(hooks.COMMON + family.needs)
    if (
        problem is None
        and proportional_attention
        and family.hook in ("unet_attn1", "wan_blocks", "qwen_blocks", "sd3_blocks", "nextdit_layers")
    ):
        problem = hooks.first_problem(hooks.ATTENTION_OVERRIDE_NEEDS)
    if problem is not None:
        return _refuse(model, problem)

    levels: tuple[int, ...] = ()
    patch: int | tuple[int, int, int]
    if family.hook in ("flux_blocks", "hunyuan_blocks", "qwen_blocks", "sd3_blocks", "wan_blocks", "nextdit_layers"):
        if merge_mlp == "off":
            raise ValueError(
                f"merge_mlp: 'off' is not available on {family.title}: toma merges around whole blocks there "
                "(attention and MLP together); use 'auto' or 'on'"
            )
        if family.hook == "flux_blocks":
            counts = {"double": len(getattr(dm, hooks.DOUBLE_BLOCKS)), "single": len(getattr(dm, hooks.SINGLE_BLOCKS))}
            patch = int(getattr(dm, hooks.PATCH_SIZE, family.patch))
        elif family.hook == "hunyuan_blocks":
            counts = {"double": len(getattr(dm, hooks.DOUBLE_BLOCKS)), "single": len(getattr(dm, hooks.SINGLE_BLOCKS))}
            patch = tuple(int(p) for p in getattr(dm, hooks.PATCH_SIZE, (1, 2, 2)))
        elif family.hook == "qwen_blocks":
            counts = {"blocks": len(getattr(dm, hooks.QWEN_BLOCKS))}
            side = int(getattr(dm, hooks.PATCH_SIZE, family.patch))
            patch = (1, side, side)
        elif family.hook == "nextdit_layers":
            counts = {"layers": len(getattr(dm, hooks.NEXTDIT_LAYERS))}
            patch = int(getattr(dm, hooks.PATCH_SIZE, family.patch))
        elif family.hook == "sd3_blocks":
            counts = {"blocks": len(getattr(dm, hooks.SD3_BLOCKS))}
            side = getattr(dm, hooks.PATCH_SIZE, family.patch)
            patch = int(side[-1] if isinstance(side, (tuple, list)) else side)
        else:
            counts = {"blocks": len(getattr(dm, hooks.WAN_BLOCKS))}
            patch = tuple(int(p) for p in getattr(dm, hooks.PATCH_SIZE, (1, 2, 2)))
        defaults = {s: tuple(range(min(SKIPPED_BLOCKS, c), c)) for s, c in counts.items()}
        chosen = parse_blocks(blocks, counts, defaults)
    else:
        if merge_mlp == "on":
            raise ValueError(
                "merge_mlp: 'on' is not available on the SD/SDXL UNet: ComfyUI's transformer block has no "
                "hook around its feed-forward; use 'auto' or 'off'"
            )
        attention_levels = unet_attention_levels(dm)
        # SDXL (no attention at full resolution) merges its top two levels, SD 1.x its top one
        default = 2 if attention_levels and attention_levels[0] > 1 else 1
        counts = {"levels": len(attention_levels)}
        chosen = parse_blocks(blocks, counts, {"levels": tuple(range(min(default, len(attention_levels))))}, first=1)
        # "levels" count from 1 in the input, its docs and the log line, from 0 in indices
        levels = tuple(attention_levels[i] for i in chosen.get("levels", ()))
        chosen = {"levels": tuple(i + 1 for i in chosen.get("levels", ()))}
        patch = 1

    sampling = model.get_model_object(hooks.MODEL_SAMPLING)
    to_sigma = getattr(sampling, hooks.PERCENT_TO_SIGMA)
    window = (float(to_sigma(start_percent)), float(to_sigma(end_percent)))
    config = ToMAConfig(
        ratio=float(ratio),
        tile_size="auto" if tile_size == 0 else int(tile_size),
        proportional_attention=proportional_attention,
    )
    run = ComfyRun(family, config, chosen, window, patch=patch, levels=levels, percents=(start_percent, end_percent))

    clone = model.clone()
    override = None
    if family.hook in ("qwen_blocks", "sd3_blocks"):
        # Qwen-Image's and SD3's blocks are joint ones under Flux's double-block name
        for i in chosen.get("blocks", ()):
            block = JointBlock(run, JOINT_LAYOUT, hooks.DOUBLE_BLOCK, i, proportional_attention, stack="blocks")
            clone.set_model_patch_replace(block, hooks.DIT_REPLACE, hooks.DOUBLE_BLOCK, i)
        if proportional_attention:
            override = KeyBias(run)
    elif family.hook in ("flux_blocks", "hunyuan_blocks"):
        layout = FLUX_LAYOUT if family.hook == "flux_blocks" else HUNYUAN_LAYOUT
        for stack, kind in (("double", hooks.DOUBLE_BLOCK), ("single", hooks.SINGLE_BLOCK)):
            for i in chosen.get(stack, ()):
                block = JointBlock(run, layout, kind, i, proportional_attention)
                clone.set_model_patch_replace(block, hooks.DIT_REPLACE, kind, i)
    elif family.hook == "nextdit_layers":
        multiple = getattr(dm, hooks.NEXTDIT_PAD_MULTIPLE, None)
        for i in chosen.get("layers", ()):
            name = f"{hooks.DIFFUSION_MODEL}.{hooks.NEXTDIT_LAYERS}.{i}"
            # the layer as this model has it: another node's object patch of it is wrapped
            layer = NextDiTLayer.original(model.get_model_object(name))
            stand_in = NextDiTLayer(run, i, layer, proportional_attention, multiple).stand_in()
            clone.add_object_patch(name, stand_in)
        if proportional_attention:
            override = KeyBias(run)
    elif family.hook == "wan_blocks":
        # Wan's blocks are replaced under the name Flux's double blocks have
        for i in chosen.get("blocks", ()):
            clone.set_model_patch_replace(
                WanBlock(run, i, proportional_attention), hooks.DIT_REPLACE, hooks.DOUBLE_BLOCK, i
            )
        if proportional_attention:
            override = KeyBias(run)
    else:
        attn = UNetAttn1(run, proportional_attention)
        clone.set_model_attn1_patch(attn.before)
        clone.set_model_attn1_output_patch(attn.after)
        if proportional_attention:
            override = KeyBias(run)
    kinds = hooks.resolve(hooks.WRAPPERS)
    clone.add_wrapper_with_key(getattr(kinds, hooks.OUTER_SAMPLE), hooks.WRAPPER_KEY, _outer_sample(run))
    clone.add_wrapper_with_key(getattr(kinds, hooks.APPLY_MODEL), hooks.WRAPPER_KEY, _apply_model(run, override))
    clone.toma_run = run  # for tests and for nodes that want to read what merged
    return clone
