"""Hooks that run a sub-module of a block on merged tokens (the engine's moving parts).

:class:`MergeHook` merges a call's image hidden states ``(B, N, C)`` and unmerges its
output, so that ``x + U F(M x)`` replaces ``x + F(x)`` on the residual stream; rotary
tables passed to the call are gathered to the merged tokens' destinations, and the
family's own attention processor (hence diffusers' attention dispatch and
``set_attention_backend``) runs unchanged on fewer tokens. A spanning site
(``Site.until``) merges one sub-module's output and unmerges a later one's, with
:class:`SpanOpen`, :class:`SpanCall` and :class:`SpanClose`.

Some processors apply one rotary table to the whole batch (``cos[None, :, None, :]`` in
diffusers' ``apply_rotary_emb``, ``freqs.unsqueeze(1)`` in QwenImage's), so they cannot
take per-sample tables. A site whose :class:`~toma.adapters.spec.Rotary` says
``shared=True`` then runs its merged module once per batch sample, each call on that
sample's hidden states, masks and tables (every tensor argument whose first dimension is
the batch is sliced), and concatenates the outputs. A plan shared by the batch
(``share_batch_plan``) needs one call. Per-sample calls multiply the module's kernel
launches by the batch size, not its FLOPs.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

import torch

from toma.adapters.base import Hook
from toma.adapters.spec import Rotary, Site, head_mask
from toma.core.plan import Plan
from toma.adapters.state import PlanCache, TileState

if TYPE_CHECKING:  # the UNet adapter's; families on the engine do not import it
    from toma.adapters.residual import ResidualSlot


class MergeHook(Hook):
    """Merges the image hidden states ``(B, N, C)`` of a sub-module's call and unmerges its output.

    Tokens are in raster order, or in tile order while ``order`` says so. A call with an
    attention mask of its own (laid out over the unmerged sequence) gets it fitted to the
    merged tokens by the site's ``joint_mask``, or runs unmerged where there is none. With a
    site that takes rotary tables, they are gathered to the merged tokens; under
    proportional attention the plan's log masses go in as the site's attention mask.
    """

    def __init__(self, cache: PlanCache, downsample: int, order: TileState, site: Site | None = None, bias: bool = False,
                 part: str = "attn", residual: ResidualSlot | None = None) -> None:
        self.cache = cache
        self.residual = residual  # where the block's forward hands over its residual add, if it does
        self.downsample = downsample
        self.order = order
        self.site = site
        self.part = site.part if site is not None else part
        self.ratio = cache.config.ratio_for(self.part)
        self.bias = bias or (site is not None and site.part == "attn" and bool(cache.config.proportional_attention))
        self._plan: Plan | None = None
        self._tiled = False
        self._text = 0  # text tokens before the image ones in the call's hidden states
        self._warned = False
        self._samples: list | None = None  # per-sample rotary tables of the coming call, if split

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        self._plan = None
        self._samples = None
        x = hidden_states_of(args, kwargs)
        grid = self.cache.grid_at(self.downsample)
        if x is None or x.ndim != 3 or grid is None or not grid[-1]:  # (0, 0, 0): this forward merges nothing
            return args, kwargs
        # a mask of the model's own is laid out over the unmerged keys; cross-attention's
        # keys are the text, which stays whole, so only self-attention must then adapt it
        # to the merged keys (where the family says how) or run unmerged
        site = self.site
        own = None if self.part == "cross" else self._own_mask(args, kwargs)
        if own is not None and (site is None or site.joint_mask is None):
            self._warn_once(f"ToMA: {type(module).__name__} got an attention mask over its unmerged tokens, which "
                            "does not fit merged ones; such calls run unmerged")
            return args, kwargs
        tiled = self.order.layout is not None
        tokens = math.prod(grid)
        # text, and conditioning tokens, lead the image tokens and pass whole
        text = x.shape[1] - tokens if site is not None and (site.text_first or self.order.extra) else 0
        image = x[:, text:] if text > 0 else x
        plan = self.cache.get(image, grid, group=plan_group(site, grid), tiled=tiled, ratio=self.ratio)
        if plan is None:
            self._warn_if_chunked(module, x.shape[1], tokens)
            return args, kwargs
        if own is not None:
            own = site.joint_mask(own, tokens, plan.num_merged)
            if own is None:
                self._warn_once(f"ToMA: {type(module).__name__} got an attention mask it cannot fit to merged tokens; such calls run unmerged")
                return args, kwargs
            name, index = site.mask or ("attention_mask", None)
            args, kwargs = replace_arg(args, kwargs, name, index, own)
        self._plan, self._tiled, self._text = plan, tiled, text
        merged = merge_after_text(x, text, plan, tiled)
        args, kwargs = with_hidden_states(args, kwargs, merged)
        if site is None:
            if self.bias:  # UNet attention processors: (batch * heads, 1, K)
                kwargs = {**kwargs, "attention_mask": _head_bias(plan, merged.shape[0], module.heads)}
            return args, kwargs
        return self._merged_call(module, plan, tiled, tokens, text, args, kwargs)

    def _merged_call(self, module: torch.nn.Module, plan: Plan, tiled: bool, tokens: int, text: int,
                     args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A call on merged tokens (``text`` leading text tokens, then the merged image
        tokens of ``tokens`` image tokens) with its rotary tables gathered to the merged
        tokens and, under proportional attention, the plan's log masses as its mask."""
        site = self.site
        if site.rotary is not None:
            args, kwargs, self._samples = _gather_rotary(site.rotary, plan, tiled, tokens, args, kwargs)
        if self.bias:
            named = kwargs.get(site.text_keys) if site.text_keys else None
            lead = text + (named.shape[1] if isinstance(named, torch.Tensor) else 0)
            batch = hidden_states_of(args, kwargs).shape[0]
            mask = plan.memo(f"mask_{site.path}_{lead}",
                             lambda: site.mask_layout(_lead_zeros(plan.log_mass, lead), batch, module.heads))
            args, kwargs = replace_arg(args, kwargs, *site.mask, mask)
        return args, kwargs

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(message, stacklevel=5)

    def _warn_if_chunked(self, module: torch.nn.Module, tokens: int, grid_tokens: int) -> None:
        """Feed-forward chunking calls the MLP on slices of the tokens, which no plan fits:
        say once that this MLP runs unmerged rather than let merging switch off silently."""
        if self.ratio == 0 or not 0 < tokens < grid_tokens or grid_tokens % tokens:
            return
        self._warn_once(
            f"ToMA: {type(module).__name__} is called on {tokens} of the {grid_tokens} tokens at a time "
            "(feed-forward chunking?); a slice cannot be merged, so it runs unmerged. Turn feed-forward "
            "chunking off to merge it."
        )

    def _own_mask(self, args: tuple, kwargs: dict) -> Any:
        """The attention mask the model itself passes (over the raster sequence), if any."""
        name, index = self.site.mask if self.site is not None and self.site.mask else ("attention_mask", None)
        return args[index] if index is not None and len(args) > index else kwargs.get(name)

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        plan, self._plan = self._plan, None
        if plan is None:
            return output
        if isinstance(output, tuple):  # joint attention: (image, text)
            return (unmerge_after_text(output[0], self._text, plan, self._tiled), *output[1:])
        slot = self.residual
        if slot is not None and slot.x is not None and not self._text:
            out = plan.unmerge(output, self._tiled, residual=slot.x)
            slot.fused = True
            return out
        return unmerge_after_text(output, self._text, plan, self._tiled)  # [text; image] when text_first


class PerSampleMergeHook(MergeHook):
    """A :class:`MergeHook` for sites whose processor takes one rotary table for the whole
    batch (``Rotary(shared=True)``): when the samples have plans of their own, the merged
    module runs once per sample, with that sample's table, and the outputs are concatenated."""

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        forward = self.fn_ref.original_forward
        samples, self._samples = self._samples, None
        if samples is None:
            return forward(*args, **kwargs)
        rotary = self.site.rotary
        batch = hidden_states_of(args, kwargs).shape[0]
        outputs = []
        for b, tables in enumerate(samples):
            one_args = tuple(_batch_slice(v, b, batch) for v in args)
            one_kwargs = {k: _batch_slice(v, b, batch) for k, v in kwargs.items()}
            one_args, one_kwargs = replace_arg(one_args, one_kwargs, rotary.name, rotary.index, tables)
            outputs.append(forward(*one_args, **one_kwargs))
        return _concat_batch(outputs)


def plan_group(site: Site | None, grid: tuple[int, int, int]) -> Any:
    """The plan cache group of a site on ``grid``: sites of one group share a plan per step."""
    return grid if site is None or site.group is None else (site.group, grid)


def merge_after_text(x: torch.Tensor, text: int, plan: Plan, tiled: bool) -> torch.Tensor:
    """``[text; image]`` tokens ``(B, text + N, C)`` with the image part merged: ``(B, text + K, C)``."""
    merged = plan.merge(x[:, text:] if text else x, tiled)
    return torch.cat([x[:, :text], merged], dim=1) if text else merged


def unmerge_after_text(y: torch.Tensor, text: int, plan: Plan, tiled: bool) -> torch.Tensor:
    """Inverse of :func:`merge_after_text` on an output ``(B, text + K, C)``: ``(B, text + N, C)``."""
    if not text:
        return plan.unmerge(y, tiled)
    return torch.cat([y[:, :text], plan.unmerge(y[:, text:], tiled)], dim=1)


def _lead_zeros(log_mass: torch.Tensor, lead: int) -> torch.Tensor:
    """Log masses ``(Bp, K)`` behind ``lead`` text keys of log mass 0: ``(Bp, lead + K)``."""
    if lead == 0:
        return log_mass
    return torch.cat([log_mass.new_zeros(log_mass.shape[0], lead), log_mass], dim=1)


class SpanState:
    """The plan of a spanning merge (``Site.until``) between the output it merged and the one it unmerges."""

    def __init__(self) -> None:
        self.plan: Plan | None = None
        self.tiled = False
        self.text = 0  # text tokens before the merged image tokens
        self.tokens = 0  # image tokens before merging


class SpanOpen(Hook):
    """On a spanning site's ``path`` module: merges the image part of its output ``(B, text + N, C)``
    (the first item, when the output is a tuple)."""

    def __init__(self, cache: PlanCache, order: TileState, site: Site, state: SpanState) -> None:
        self.cache = cache
        self.order = order
        self.site = site
        self.state = state
        self.ratio = cache.config.ratio_for(site.part)

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        state = self.state
        state.plan = None
        x = output[0] if isinstance(output, tuple) else output
        grid = self.cache.grid_at(1)
        if grid is None or x.ndim != 3:
            return output
        tokens = math.prod(grid)
        text = x.shape[1] - tokens if self.site.text_first or self.order.extra else 0
        tiled = self.order.layout is not None
        plan = None if text < 0 else self.cache.get(x[:, text:], grid, group=plan_group(self.site, grid), tiled=tiled,
                                                    ratio=self.ratio)
        if plan is None:
            return output
        state.plan, state.tiled, state.text, state.tokens = plan, tiled, text, tokens
        merged = merge_after_text(x, text, plan, tiled)
        return (merged, *output[1:]) if isinstance(output, tuple) else merged


class SpanCall(PerSampleMergeHook):
    """On the ``call`` module inside a span: its rotary tables and mask follow the merged
    tokens (once per sample where the processor takes one table for the whole batch)."""

    def __init__(self, cache: PlanCache, order: TileState, site: Site, state: SpanState) -> None:
        super().__init__(cache, 1, order, site=site)
        self.state = state

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        self._samples = None
        state = self.state
        if state.plan is None:
            return args, kwargs
        return self._merged_call(module, state.plan, state.tiled, state.tokens, state.text, args, kwargs)

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        return output


class SpanClose(Hook):
    """On a spanning site's ``until`` module: unmerges the image part of its output."""

    def __init__(self, state: SpanState) -> None:
        self.state = state

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        plan, self.state.plan = self.state.plan, None
        if plan is None:
            return output
        return unmerge_after_text(output, self.state.text, plan, self.state.tiled)


def _batch_slice(value: Any, b: int, batch: int) -> Any:
    """Sample ``b`` of a tensor whose first dimension is the batch; anything else as is."""
    if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == batch:
        return value[b : b + 1]
    return value


def _concat_batch(outputs: list) -> Any:
    """Per-sample outputs (tensors, or tuples of tensors and None) joined along the batch."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs)
    return type(first)(None if parts[0] is None else torch.cat(parts) for parts in zip(*outputs))


def _gather_rotary(
    rotary: Rotary, plan: Plan, tiled: bool, tokens: int, args: tuple, kwargs: dict
) -> tuple[tuple, dict, list | None]:
    """The call with its rotary tables gathered to the merged tokens (of ``tokens`` image tokens).

    Returns the arguments and, for ``rotary.shared`` when samples have plans of their own,
    each sample's tables (the module must then run once per sample); else None.
    """
    positional = rotary.index is not None and len(args) > rotary.index
    tables = args[rotary.index] if positional else kwargs.get(rotary.name)
    if tables is None:
        return args, kwargs, None
    single = isinstance(tables, torch.Tensor)
    items = (tables,) if single else tuple(tables)
    wanted = range(len(items)) if rotary.items is None else rotary.items

    def pick(b: int | None, dest: torch.Tensor) -> Any:
        gathered = tuple(
            (_sample_rows(t, dest[b], tokens) if rotary.shared else rotary.gather(t, dest)) if i in wanted else t
            for i, t in enumerate(items)
        )
        return gathered[0] if single else gathered

    def make() -> list:
        dest = plan.dest_slots if tiled and not rotary.raster else plan.dest_tokens
        if not rotary.shared:
            return [pick(None, dest)]
        return [pick(b, dest) for b in range(dest.shape[0])]

    # every block of a forward passes the same tables: gather once per plan
    merged = plan.memo(f"rotary_{rotary.name}_{tiled}", make)
    args, kwargs = replace_arg(args, kwargs, rotary.name, rotary.index, merged[0])
    return args, kwargs, (merged if len(merged) > 1 else None)


def _sample_rows(table: torch.Tensor, dest: torch.Tensor, tokens: int) -> torch.Tensor:
    """A shared ``(text + tokens, ...)`` table's text rows, then its image rows ``dest`` ``(K,)``."""
    text = table.shape[0] - tokens
    if text == 0:
        return table[dest]
    return torch.cat([table[:text], table[text:][dest]])


def replace_arg(args: tuple, kwargs: dict, name: str, index: int | None, value: Any) -> tuple[tuple, dict]:
    """The call's arguments with ``value`` for the parameter ``name`` at position ``index``."""
    if index is not None and len(args) > index:
        return (*args[:index], value, *args[index + 1 :]), kwargs
    return args, {**kwargs, name: value}


def hidden_states_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A call's hidden states: its first positional argument, or ``hidden_states=``."""
    return args[0] if args else kwargs.get("hidden_states")


def with_hidden_states(args: tuple, kwargs: dict, x: torch.Tensor) -> tuple[tuple, dict]:
    """The call's arguments with ``x`` in place of its hidden states."""
    if args:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}


def _head_bias(plan: Plan, batch: int, heads: int) -> torch.Tensor:
    """The plan's log masses as the ``(batch * heads, 1, K)`` mask diffusers' attention
    processors take as is (a smaller one they repeat over heads in every block).

    Built once per plan: a view when the plan is shared by the batch, else a copy.
    """

    return plan.memo(f"head_bias_{batch}_{heads}", lambda: head_mask(plan.log_mass, batch, heads))
