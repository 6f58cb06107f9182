"""Hooks that run a sub-module of a block on merged tokens (the engine's moving parts).

:class:`MergeHook` merges a call's image hidden states ``(B, N, C)`` and unmerges its
output, so that ``x + U F(M x)`` replaces ``x + F(x)`` on the residual stream; rotary
tables passed to the call are gathered to the merged tokens' destinations, and the
family's own attention processor (hence diffusers' attention dispatch and
``set_attention_backend``) runs unchanged on fewer tokens. A spanning site
(``Site.span``) merges one sub-module's output and unmerges a later one's, with
:class:`SpanOpen`, :class:`SpanCall` and :class:`SpanClose`.

What one call merged (its plan, the token order it was merged in, the text before the
image tokens) is a :class:`MergedCall`, made at the merge and used at the unmerge. How the
merged module is then called is up to the hook's call strategies, which combine:

* :class:`PerSample`: some processors apply one rotary table to the whole batch
  (``cos[None, :, None, :]`` in diffusers' ``apply_rotary_emb``, ``freqs.unsqueeze(1)`` in
  QwenImage's), so they cannot take per-sample tables. A site whose
  :class:`~toma.adapters.spec.Rotary` says ``shared=True`` then runs its merged module once
  per batch sample, each call on that sample's hidden states, masks and tables (every
  tensor argument whose first dimension is the batch is sliced), and concatenates the
  outputs. A plan shared by the batch (``share_batch_plan``) needs one call. Per-sample
  calls multiply the module's kernel launches by the batch size, not its FLOPs.
* :class:`~toma.adapters.chunking.Chunked`: an MLP whose block chunks it runs over the
  merged tokens in the block's slices.
"""

from __future__ import annotations

import copy
import functools
import math
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch

from toma.adapters.attention import KeyBias
from toma.adapters.base import Hook
from toma.adapters.layouts import ALONE, Layout, hidden_states_of, read_arg, replace_arg, with_hidden_states
from toma.adapters.spec import Rotary, Site
from toma.core.plan import Plan
from toma.adapters.state import PlanCache, TileState

if TYPE_CHECKING:  # the UNet adapter's; families on the engine do not import it
    from toma.adapters.residual import ResidualSlot


class MergedCall:
    """What one call merged, from its merge to its unmerge: the plan, whether the image
    tokens were in tile order (the token order's layout when the call began), the call's
    layout, the tokens beside the image tokens in it (which pass whole), and the image
    tokens before merging."""

    __slots__ = ("plan", "tiled", "text", "tokens", "layout")

    def __init__(self, plan: Plan, tiled: bool, text: int, tokens: int, layout: Layout = ALONE) -> None:
        self.plan = plan
        self.tiled = tiled
        self.text = text
        self.tokens = tokens
        self.layout = layout

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``(B, text + N, C)`` with the image part merged: ``(B, text + K, C)``, laid
        out as the call's layout says."""
        return self.layout.merge(lambda image: self.plan.merge(image, self.tiled), x, self.tokens, self.text)

    def unmerge(self, y: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Inverse of :meth:`merge` on output rows ``(B, text + K, C)``: ``(B, text + N, C)``;
        plus ``residual`` (image tokens only, with no text beside them), added in the
        unmerge's kernel."""
        return self.layout.unmerge(lambda image: self.plan.unmerge(image, self.tiled, residual=residual), y, self.text)


def open_call(
    cache: PlanCache, order: TileState, site: Site, x: torch.Tensor, grid: tuple[int, ...], ratio: float
) -> MergedCall | None:
    """The merge of a call whose hidden states are ``x`` ``(B, S, C)`` on ``grid``, or None
    where nothing merges (see :meth:`PlanCache.get`). Text, and conditioning tokens, lead
    the image tokens and pass whole."""
    tokens = math.prod(grid)
    layout = site.layout
    text = layout.text(x.shape[1], tokens, order.extra)
    if text < 0:
        return None
    tiled = order.layout is not None
    plan = cache.get(layout.image(x, tokens, text), grid, group=plan_group(site, grid), tiled=tiled, ratio=ratio)
    return None if plan is None else MergedCall(plan, tiled, text, tokens, layout)


# proportional_attention=None on a transformer: the bias runs only where its forms were
# measured to cost at most 3% of a forward (benchmarks/proportional_cost.py): on CPU
AUTO = "auto"
AUTO_DEVICES = ("cpu",)


def bias_setting(config: Any, site: Site) -> bool | str:
    """Whether a transformer's merged ``site`` takes the key bias: True under
    ``proportional_attention=True``, :data:`AUTO` under None where the site takes a mask,
    else False."""
    setting = config.proportional_attention
    if site.part != "attn" or setting is False:
        return False
    if setting is True:
        return True
    return AUTO if site.takes_bias else False


class MergeHook(Hook):
    """Merges the image hidden states ``(B, N, C)`` of a sub-module's call and unmerges its output.

    Tokens are in raster order, or in tile order while ``order`` says so. A call with an
    attention mask of its own (laid out over the unmerged sequence) gets it fitted to the
    merged tokens by the site's ``fit``, or runs unmerged where there is none. With a
    site that takes rotary tables, they are gathered to the merged tokens; with ``bias``
    (proportional attention) the plan's log masses go in as the site's attention mask.

    Args:
        cache: the model's plan cache.
        downsample: the call's token grid is the cache's at this downsample (UNet levels).
        order: the token order of the stretch the sub-module is in.
        site: what the sub-module is (part, rotary tables, masks).
        bias: add the plan's log masses to the attention logits (proportional attention):
            True, or :data:`AUTO` for only where its form was measured to be cheap (on
            CPU; :func:`bias_setting`).
        residual: where a block's forward hands over its residual add, to be done with the
            unmerge (:mod:`toma.adapters.residual`), if it does.
        calls: how the merged module is called (:class:`PerSample`, :class:`Chunked`), outermost first.
    """

    def __init__(
        self,
        cache: PlanCache,
        downsample: int,
        order: TileState,
        site: Site,
        *,
        bias: bool | str = False,
        residual: ResidualSlot | None = None,
        calls: tuple = (),
    ) -> None:
        self.cache = cache
        self.residual = residual
        self.downsample = downsample
        self.order = order
        self.site = site
        self.part = site.part
        self.ratio = cache.config.ratio_for(site.part)
        self.bias = bias
        self.calls = tuple(calls)
        if self.calls:  # diffusers' registry wraps the call only for hooks that have new_forward
            self.new_forward = self._call_through
        self.merged: MergedCall | None = None  # this call's, from pre_forward to post_forward
        self.samples: list | None = None  # per-sample rotary tables of the coming call, if split
        self.module: torch.nn.Module | None = None  # the module, while its call runs through ``calls``
        self._warned = False

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        self.merged = None
        self.samples = None
        x = hidden_states_of(args, kwargs)
        grid = self.cache.grid_at(self.downsample)
        if x is None or x.ndim != 3 or grid is None or not grid[-1]:  # (0, 0, 0): this forward merges nothing
            return args, kwargs
        # a mask of the model's own is laid out over the unmerged keys; cross-attention's
        # keys are the text, which stays whole, so only self-attention must then adapt it
        # to the merged keys (where the family says how) or run unmerged
        site = self.site
        x = site.layout.rows(x)
        own = None if self.part == "cross" else self._own_mask(args, kwargs)
        if own is not None and site.fit is None:
            self._warn_once(
                f"ToMA: {type(module).__name__} got an attention mask over its unmerged tokens, which "
                "does not fit merged ones; such calls run unmerged"
            )
            return args, kwargs
        for rule in site.rules:
            why = rule.refuses(args, kwargs)
            if why is not None:
                self._warn_once(f"ToMA: {type(module).__name__} {why}; such calls run unmerged")
                return args, kwargs
        merged = open_call(self.cache, self.order, site, x, grid, self.ratio)
        if merged is None:
            self._warn_if_chunked(module, x.shape[1], math.prod(grid))
            return args, kwargs
        if own is not None:
            own = site.fit.fit(own, merged.tokens, merged.plan.num_merged)
            if own is None:
                self._warn_once(
                    f"ToMA: {type(module).__name__} got an attention mask it cannot fit to merged tokens; such "
                    "calls run unmerged"
                )
                return args, kwargs
            args, kwargs = replace_arg(args, kwargs, *site.own_slot(), own)
        self.merged = merged
        args, kwargs = with_hidden_states(args, kwargs, site.layout.unrows(merged.merge(x)))
        return self._merged_call(module, merged, args, kwargs)

    def _merged_call(
        self, module: torch.nn.Module, merged: MergedCall, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict]:
        """A call on merged tokens with its rotary tables gathered to the merged tokens and,
        under proportional attention, the plan's log masses as its mask."""
        site, plan = self.site, merged.plan
        if site.rotary is not None:
            args, kwargs, self.samples = _gather_rotary(site.rotary, merged, args, kwargs, site=site.path)
        x = hidden_states_of(args, kwargs)
        for rule in site.rules:
            args, kwargs = rule.apply(args, kwargs, site.layout.rows(x).shape[1] - merged.text)
        route = site.bias
        if route is not None and self._biased(module, x):
            named = kwargs.get(route.keys) if route.keys else None
            # the keys before the merged image keys: the call's text, or none where the
            # layout's bias form pads the text keys after them
            lead = site.layout.bias_lead(merged.text) + (named.shape[1] if isinstance(named, torch.Tensor) else 0)
            # diffusers' Attention names its query heads heads; some families' own modules, num_heads (Krea 2)
            batch, heads = x.shape[0], getattr(module, "heads", None) or module.num_heads
            key = f"{site.path}_{lead}_{batch}_{heads}"
            mask = plan.memo(f"mask_{key}", lambda: route.form(_lead_zeros(plan.log_mass, lead), batch, heads))
            if self.bias == AUTO and isinstance(mask, KeyBias):
                mask = mask.automatic()
            own = self._own_mask(args, kwargs)  # the model's, fitted to the merged keys above
            args, kwargs = route.route(args, kwargs, mask, own, lambda: _shared_dense(plan, key, own))
        return args, kwargs

    def _biased(self, module: torch.nn.Module, x: torch.Tensor) -> bool:
        """Whether this call takes the key bias: asked for, or under :data:`AUTO` on CPU, and
        where the module's processor can take it (said once where it cannot)."""
        if not (self.bias is True or (self.bias == AUTO and x.device.type in AUTO_DEVICES)):
            return False
        ok = self.site.bias.ok if self.site.bias is not None else None
        why = ok(module) if ok is not None else None
        if why is not None:
            self._warn_once(f"ToMA: proportional attention is off in {type(module).__name__}: {why}")
        return why is None

    def _call_through(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        """The module's call through this hook's call strategies (its ``new_forward``)."""
        forward = self.fn_ref.original_forward
        for strategy in reversed(self.calls):
            forward = functools.partial(strategy, forward, self)
        self.module = module  # for strategies that call the module's attention themselves (SD3's)
        try:
            return forward(*args, **kwargs)
        finally:
            self.module = None

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
        return read_arg(args, kwargs, *self.site.own_slot())

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        merged, self.merged = self.merged, None
        if merged is None:
            return output
        if isinstance(output, tuple):  # joint attention: (image, text)
            return (merged.unmerge(output[0]), *output[1:])
        slot = self.residual
        if slot is not None and slot.x is not None and not merged.text:
            slot.fused = True
            return merged.unmerge(output, residual=slot.x)
        layout = self.site.layout
        return layout.unrows(merged.unmerge(layout.rows(output)))


class PerSample:
    """A call strategy for sites whose processor takes one rotary table for the whole batch
    (``Rotary(shared=True)``): when the samples have plans of their own, the merged module
    runs once per sample, with that sample's table, and the outputs are concatenated."""

    def __init__(self, rotary: Rotary) -> None:
        self.rotary = rotary

    def __call__(self, forward: Callable, hook: MergeHook, *args: Any, **kwargs: Any) -> Any:
        samples, hook.samples = hook.samples, None
        if samples is None:
            return forward(*args, **kwargs)
        rotary = self.rotary
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


def _shared_dense(plan: Any, key: str, own: torch.Tensor) -> dict:
    """The dict in which the merged calls of ``plan`` keep the float masks they build from the
    model's per-query mask ``own`` (:attr:`KeyBias.dense`): one per plan, key and model mask.
    The model builds its mask once per forward and hands every block a view of it, so the
    blocks share one dict while ``own`` views the same memory in the same way, unchanged;
    another mask (the next forward's, with a plan kept for several steps) starts a new one.
    The dict holds the mask's storage, so that no other tensor can take its address while
    the dict lives. A view's version counter is its base's; inference tensors keep none, and
    one made under inference_mode is taken as unchanged (the model builds its mask once)."""
    storage = own.untyped_storage()
    version = None if own.is_inference() else own._version
    view = (storage.data_ptr(), tuple(own.shape), own.stride(), own.storage_offset(), version)
    slot = plan.memo(f"per_query_{key}", dict)
    if slot.get("view") != view:
        slot.clear()
        slot.update(storage=storage, view=view, dense={})
    return slot["dense"]


def _lead_zeros(log_mass: torch.Tensor, lead: int) -> torch.Tensor:
    """Log masses ``(Bp, K)`` behind ``lead`` text keys of log mass 0: ``(Bp, lead + K)``."""
    if lead == 0:
        return log_mass
    return torch.cat([log_mass.new_zeros(log_mass.shape[0], lead), log_mass], dim=1)


class SpanState:
    """A spanning merge (``Site.span``) between the output it merged and the one it unmerges."""

    def __init__(self) -> None:
        self.merged: MergedCall | None = None


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
        state.merged = None
        x = output[0] if isinstance(output, tuple) else output
        grid = self.cache.grid_at(1)
        if grid is None or x.ndim != 3:
            return output
        merged = state.merged = open_call(self.cache, self.order, self.site, x, grid, self.ratio)
        if merged is None:
            return output
        out = merged.merge(x)
        return (out, *output[1:]) if isinstance(output, tuple) else out


class SpanCall(MergeHook):
    """On the ``call`` module inside a span: its rotary tables and mask follow the merged
    tokens (once per sample where the processor takes one table for the whole batch)."""

    def __init__(
        self, cache: PlanCache, order: TileState, site: Site, state: SpanState, *, bias: bool | str = False
    ) -> None:
        shared = site.rotary is not None and site.rotary.shared
        super().__init__(cache, 1, order, site, bias=bias, calls=(PerSample(site.rotary),) if shared else ())
        self.state = state

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        self.samples = None
        merged = self.state.merged
        if merged is None:
            return args, kwargs
        own = self._own_mask(args, kwargs)
        if own is not None:
            # the span merged before this call could be seen, so the family's grid reader
            # must have refused a forward whose mask cannot fit: one that gets here is toma's bug
            fitted = self.site.fit.fit(own, merged.tokens, merged.plan.num_merged) if self.site.fit else None
            if fitted is None:
                raise RuntimeError(
                    f"ToMA: {type(module).__name__} got an attention mask of shape {tuple(own.shape)} inside a "
                    "merged span, which its family cannot fit to merged tokens"
                )
            args, kwargs = replace_arg(args, kwargs, *self.site.own_slot(), fitted)
        return self._merged_call(module, merged, args, kwargs)

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        return output


class SpanClose(Hook):
    """On a spanning site's ``span.until`` module: unmerges the image part of its output."""

    def __init__(self, state: SpanState) -> None:
        self.state = state

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        merged, self.state.merged = self.state.merged, None
        return output if merged is None else merged.unmerge(output)


def _batch_slice(value: Any, b: int, batch: int) -> Any:
    """Sample ``b`` of a tensor whose first dimension is the batch, of a key bias, or of a
    key-value cache read in the call (a shallow copy whose per-sample tensors are that
    sample's: Qwen-Image 2.1's layer cache of prefix keys and values); anything else as is."""
    if hasattr(value, "batch_slice"):  # toma.adapters.attention.KeyBias
        return value.batch_slice(b, batch)
    if isinstance(value, torch.Tensor):
        return value[b : b + 1] if value.ndim and value.shape[0] == batch else value
    if type(value).__name__.endswith("Cache") and hasattr(value, "__dict__"):
        one = copy.copy(value)
        for name, held in vars(value).items():
            if isinstance(held, torch.Tensor) and held.ndim and held.shape[0] == batch:
                setattr(one, name, held[b : b + 1])
        return one
    return value


def _concat_batch(outputs: list) -> Any:
    """Per-sample outputs (tensors, or tuples of tensors and None) joined along the batch."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs)
    return type(first)(None if parts[0] is None else torch.cat(parts) for parts in zip(*outputs))


def _gather_rotary(
    rotary: Rotary, merged: MergedCall, args: tuple, kwargs: dict, site: str = ""
) -> tuple[tuple, dict, list | None]:
    """The call with its rotary tables gathered to the tokens of ``merged``, at the site whose
    path is ``site``.

    The tables are one tensor or a tuple of items, of which ``rotary.items`` hold image
    rows; such an item is a tensor or a tuple nesting tensors (and None), each gathered.
    Per-batch tables (not ``shared``) are gathered as the call's layout says (a text-first
    layout keeps their text rows whole before the gathered image rows: Ideogram 4's packed
    sequence).
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
    plan, tiled, tokens = merged.plan, merged.tiled, merged.tokens

    def rows(table: Any, b: int | None, dest: torch.Tensor) -> Any:
        # an item may nest its tables (JoyImage's ((cos, sin), text)): every tensor in it is gathered
        if isinstance(table, (tuple, list)):
            return type(table)(rows(t, b, dest) for t in table)
        if table is None:
            return None
        if rotary.shared:
            return _sample_rows(table, dest[b], tokens)
        return merged.layout.table_rows(rotary.gather, table, dest, tokens, merged.text)

    def pick(b: int | None, dest: torch.Tensor) -> Any:
        gathered = tuple(rows(t, b, dest) if i in wanted else t for i, t in enumerate(items))
        return gathered[0] if single else gathered

    def make() -> list:
        dest = plan.dest_slots if tiled and not rotary.raster else plan.dest_tokens
        if not rotary.shared:
            return [pick(None, dest)]
        return [pick(b, dest) for b in range(dest.shape[0])]

    # every block of a forward passes the same tables to a site: gather once per plan, site
    # path and table size, as two sites of a block may take other tables under one keyword
    # (LTX-2's self-attention and audio-to-video attention, both query_rotary_emb), and so may
    # two stacks' sites of one path (FLUX.3's image blocks, (N, D), and its single-stream
    # blocks, (text + N, D))
    shape = next((tuple(t.shape) for t in nested_tensors(items)), ())
    gathered = plan.memo(f"rotary_{site}_{rotary.name}_{tiled}_{shape}", make)
    args, kwargs = replace_arg(args, kwargs, rotary.name, rotary.index, gathered[0])
    return args, kwargs, (gathered if len(gathered) > 1 else None)


def nested_tensors(tables: Any) -> list[torch.Tensor]:
    """The tensors nested in ``tables`` (tuples, lists, None), in order."""
    if isinstance(tables, torch.Tensor):
        return [tables]
    if isinstance(tables, (tuple, list)):
        return [t for part in tables for t in nested_tensors(part)]
    return []


def _sample_rows(table: torch.Tensor, dest: torch.Tensor, tokens: int) -> torch.Tensor:
    """A shared ``(text + tokens, ...)`` table's text rows, then its image rows ``dest`` ``(K,)``."""
    text = table.shape[0] - tokens
    if text == 0:
        return table[dest]
    return torch.cat([table[:text], table[text:][dest]])
