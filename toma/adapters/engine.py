"""The family engine: merging around sub-modules of transformer blocks, declared per family.

A family states, in a :class:`FamilySpec`, where its blocks are, which sub-modules of a
block merge (:class:`Site`), how to read the token grid from the model's call, where its
rotary tables come from and which modules bracket the token sequence. The engine does the
rest, the same way for every family:

* a hook on each merged sub-module merges its image tokens ``(B, N, C)`` before the call
  and unmerges its output after it, so ``x + U F(M x)`` replaces ``x + F(x)`` on the
  residual stream; rotary tables passed to the call are gathered to the merged tokens'
  destinations, and the family's own attention processor (hence diffusers' attention
  dispatch and ``set_attention_backend``) runs unchanged on fewer tokens;
* a hook on the model records the grid and the timestep (plan reuse across steps) and
  decides whether the forward runs in tile order: every op of these blocks but attention
  treats tokens one at a time, and attention does not depend on their order once rotary
  positions follow the tokens. So the tokens are put in tile order once where they enter
  the blocks and back in raster order where they leave, and merging is a matmul on a view.
  Padded grids and calls that add raster-ordered residuals (ControlNet) stay in raster order.

Some processors apply one rotary table to the whole batch (``cos[None, :, None, :]`` in
diffusers' ``apply_rotary_emb``, ``freqs.unsqueeze(1)`` in QwenImage's), so they cannot
take per-sample tables. A site whose :class:`Rotary` says ``shared=True`` then runs its
merged module once per batch sample, each call on that sample's hidden states, masks and
tables (every tensor argument whose first dimension is the batch is sliced), and
concatenates the outputs. A plan shared by the batch (``share_batch_plan``) needs one call.
Per-sample calls multiply the module's kernel launches by the batch size, not its FLOPs.

Text tokens are never merged: only a call's image hidden states are.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from toma.adapters.base import HOOK_NAME, Hook, Patched, Skipped, registry_of, step_timestep
from toma.config import ToMAConfig
from toma.core.plan import Plan, PlanCache, profiled
from toma.core.tiling import TileLayout, raster_order, tile_order

Grid = tuple[int, int, int]
# reads the token grid from the model and the named arguments of its forward call; None
# (or a reason, which is shown once as a warning) when the call cannot merge
GridReader = Callable[[torch.nn.Module, dict], "Grid | str | None"]


@dataclass(frozen=True)
class Rotary:
    """Where a merged call receives rotary tables, and how to gather them to merged tokens.

    Attributes:
        name: keyword of the tables in the call.
        index: their position when passed positionally (None if never).
        gather: ``gather(table, dest)`` takes one table over the ``N`` image tokens (in the
            order the tokens are in) and ``dest`` ``(Bp, K)`` token indices, and returns the
            table for the merged tokens, shaped so that the family's processor broadcasts
            it over a batch of ``Bp`` (or any batch when ``Bp`` is 1). Unused when ``shared``.
        shared: the processor applies one ``(S, ...)`` table to the whole batch: its last
            ``N`` rows (dimension 0) are the image tokens', any rows before them text's. The
            engine builds each sample's table (text rows, then the rows of the sample's
            destinations) and, when samples have their own plans, calls the module once per
            sample (see the module docstring).
        items: which items of the call's table tuple hold image rows (None: all of them);
            the others pass unchanged (e.g. QwenImage's text table).
        raster: the tables come from the model's caller in raster order and no module of
            the model makes them (so none puts them in tile order): they are gathered with
            raster token indices even while the tokens run in tile order.
    """

    name: str
    index: int | None
    gather: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    shared: bool = False
    items: tuple[int, ...] | None = None
    raster: bool = False

    def __post_init__(self) -> None:
        if self.gather is None and not self.shared:
            raise ValueError("Rotary needs a gather function unless shared=True (one table for the whole batch)")


@dataclass(frozen=True)
class Site:
    """A sub-module of a block whose image tokens merge.

    Attributes:
        path: the sub-module's name inside the block (``"attn1"``, ``"ff"``).
        part: ``"attn"`` (self or joint attention), ``"cross"`` (queries of
            cross-attention) or ``"mlp"``: which of the config's ``merge_*`` switches it obeys.
        rotary: where its call takes rotary tables, if it does.
        mask: ``(keyword, position)`` of the call's additive attention mask, when the
            family's processor takes one over merged keys (proportional attention); None if
            it cannot.
        mask_layout: ``mask_layout(log_mass, batch, heads)`` turns the plan's ``(Bp, K)``
            log masses into the mask the processor wants.
        joint_mask: ``joint_mask(mask, N, K)`` adapts the attention mask the model itself
            passes (over its joint sequence of ``N`` image tokens and the text) to ``K``
            merged image tokens, or returns None when it cannot (the call then runs
            unmerged, with a warning once). Without it, a call with a mask of the model's
            own runs unmerged.
        text_first: the call's hidden states are ``[text; image]`` (a single-stream block):
            the last ``N`` tokens merge, the text before them passes whole, and so does the
            text part of the output.
    """

    path: str
    part: str
    rotary: Rotary | None = None
    mask: tuple[str, int | None] | None = None
    mask_layout: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None
    joint_mask: Callable[[torch.Tensor, int, int], torch.Tensor | None] | None = None
    text_first: bool = False


@dataclass(frozen=True)
class FamilySpec:
    """What the engine needs to know about one model family.

    Attributes:
        name: short name (``"sd3"``, ``"wan"``), shown in summaries.
        classes: class names of the denoisers of this family (matched by name, so that
            matching imports no model code).
        stacks: attribute names of the block lists, in call order.
        sites: the mergeable sub-modules of a block, given the stack name and the block.
        grid: reads the ``(t, h, w)`` token grid from the model and its forward call's
            arguments by name (positional ones included), or None when the call cannot be
            merged (the forward then runs unmerged). A class is instantiated once per
            patched model (for readers that remember what they read).
        enter: where tokens enter the blocks: ``("output", path)`` for a module whose
            output is the ``(B, N, C)`` tokens, or ``("block", "")`` for the first block's
            ``hidden_states`` input.
        leave: a module after the blocks whose first input (``hidden_states``) is the
            ``(B, N, C)`` tokens; they go back to raster order there.
        rope: path of the module whose output tuple holds the rotary tables, and the
            sequence dimension of each table (their image rows are put in tile order), or
            None.
        rope_items: which items of that tuple hold image rows (None: all of them).
        position_inputs: forward arguments holding one position row per image token,
            ``(N, d)`` or ``(B, N, d)`` (Flux.2's ``img_ids``), put in tile order at the call
            when tokens are, so that tables computed from them follow the tokens.
        raster_kwargs: forward keywords that add raster-ordered residuals between blocks;
            a call that passes one runs in raster order.
        tile_order_ok: optional check of the model and its forward's named arguments; False
            keeps raster order (e.g. per-token modulation laid out over the raster sequence).
        default_blocks: the block indices merged by default in each stack, given the
            stack name and its length.
        video: whether tiles span frames by default (``tile_frames``).
    """

    name: str
    classes: tuple[str, ...]
    stacks: tuple[str, ...]
    sites: Callable[[str, torch.nn.Module], list[Site]]
    grid: GridReader
    enter: tuple[str, str]
    leave: str
    rope: tuple[str, int] | None = None
    rope_items: tuple[int, ...] | None = None
    position_inputs: tuple[str, ...] = ()
    raster_kwargs: tuple[str, ...] = ()
    tile_order_ok: Callable[[torch.nn.Module, dict], bool] | None = None
    default_blocks: Callable[[str, int], tuple[int, ...]] = lambda stack, n: tuple(range(n))
    video: bool = False

    def matches(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` is (a subclass of) one of this family's classes."""
        return any(cls.__name__ in self.classes for cls in type(model).__mro__)


def image_grid(model: torch.nn.Module, call: dict) -> Grid | None:
    """The ``(1, h, w)`` token grid of image latents ``(B, C, H, W)`` patchified by the
    model's ``config.patch_size`` (SD3, PixArt)."""
    latents = call.get("hidden_states")
    if latents is None or latents.ndim != 4:
        return None
    p = model.config.patch_size
    return (1, latents.shape[-2] // p, latents.shape[-1] // p)


def skip_first(count: int) -> Callable[[str, int], tuple[int, ...]]:
    """Default blocks: every block of a stack but the first ``count`` (at most half of it).

    The authors' rule for Flux (5); the other families use it until measured.
    """
    return lambda stack, n: tuple(range(min(count, n // 2), n))


def chosen_blocks(spec: FamilySpec, model: torch.nn.Module, config: ToMAConfig) -> dict[str, tuple[int, ...]]:
    """The merged block indices per stack: ``config.blocks`` where given, else the family's default.

    Raises:
        ValueError: a stack the model does not have, or an index past a stack's end.
    """
    chosen = dict(config.blocks or ())
    unknown = sorted(set(chosen) - set(spec.stacks))
    if unknown:
        raise ValueError(f"blocks names {unknown}, which {spec.name} does not have; its block stacks are {list(spec.stacks)}")
    out = {}
    for stack in spec.stacks:
        count = len(getattr(model, stack))
        indices = chosen.get(stack, spec.default_blocks(stack, count) if config.blocks is None else ())
        bad = [i for i in indices if i >= count]
        if bad:
            raise ValueError(f"blocks[{stack!r}] must hold indices in [0, {count - 1}]; got {bad}")
        out[stack] = tuple(indices)
    return out


def find_targets(spec: FamilySpec, model: torch.nn.Module, config: ToMAConfig) -> tuple[list[Patched], list[Skipped]]:
    """The sub-modules to merge and the blocks left alone, with why. Touches nothing."""
    aliases = [n for n in ("flux_double_blocks", "flux_single_blocks") if getattr(config, n) is not None]
    if aliases:
        raise ValueError(f"{aliases[0]} applies to Flux.1 only; for {spec.name} use blocks={{stack: indices}} with stacks {list(spec.stacks)}")
    wanted = {"attn": config.merge_attn, "cross": config.merge_crossattn, "mlp": config.merge_mlp}
    targets: list[Patched] = []
    skipped: list[Skipped] = []
    for stack, indices in chosen_blocks(spec, model, config).items():
        for i, block in enumerate(getattr(model, stack)):
            name = f"{stack}.{i}"
            if i not in indices:
                skipped.append(Skipped(name, "not among the merged blocks"))
                continue
            sites = [s for s in spec.sites(stack, block) if wanted[s.part]]
            if config.proportional_attention:
                lacking = [s.path for s in sites if s.part == "attn" and s.mask is None]
                if lacking:
                    raise ValueError(
                        f"proportional_attention=True needs an attention mask, which {spec.name}'s "
                        f"{name}.{lacking[0]} cannot take; use proportional_attention=False or None"
                    )
            if not sites:
                skipped.append(Skipped(name, "none of its parts is merged with these settings"))
            for site in sites:
                targets.append(Patched(f"{name}.{site.path}", block.get_submodule(site.path), f"{stack} {site.part}", site=site))
    return targets, skipped


def order_hooks(spec: FamilySpec, model: torch.nn.Module, cache: PlanCache) -> tuple[TileState, list[tuple[torch.nn.Module, Hook]]]:
    """The hooks every family needs: the step hook on the model, the reorderings where
    tokens enter and leave the blocks, and the rotary tables' reordering. Not registered."""
    order = TileState()
    kind, path = spec.enter
    if kind == "block":
        entry = next(getattr(model, s) for s in spec.stacks if len(getattr(model, s)))[0]
    else:
        entry = model.get_submodule(path)
    hooks: list[tuple[torch.nn.Module, Hook]] = [
        (model, StepHook(spec, cache, order)),
        (entry, Reorder(order, enter=True, on_output=kind == "output")),
        (model.get_submodule(spec.leave), Reorder(order, enter=False, on_output=False)),
    ]
    if spec.rope is not None:
        hooks.append((model.get_submodule(spec.rope[0]), RotaryToTileOrder(order, spec.rope[1], spec.rope_items)))
    return order, hooks


def register(hooks: list[tuple[torch.nn.Module, Hook]]) -> list[torch.nn.Module]:
    """Register ``hooks`` under toma's hook name; returns the hooked modules (for removal)."""
    for module, hook in hooks:
        registry_of(module).register_hook(hook, HOOK_NAME)
    return [module for module, _ in hooks]


def attach(spec: FamilySpec, model: torch.nn.Module, targets: list[Patched], cache: PlanCache) -> list[torch.nn.Module]:
    """Register the engine's hooks; returns every module that got one (for removal)."""
    from toma.adapters.chunking import ChunkedMergeHook, chunkable_block, take_over_chunking

    order, hooks = order_hooks(spec, model, cache)
    chunkers = []
    for target in targets:
        site = target.site
        block = chunkable_block(model, target, site.path) if site.part == "mlp" else None
        if block is not None:
            hook = ChunkedMergeHook(cache, 1, order, site=site, chunk=take_over_chunking(block))
            chunkers.append(block)
        elif site.rotary is not None and site.rotary.shared:
            hook = PerSampleMergeHook(cache, 1, order, site=site)
        else:
            hook = MergeHook(cache, 1, order, site=site)
        hooks.append((target.module, hook))
    return register(hooks) + chunkers


class EngineAdapter:
    """A family's adapter on the engine: what :func:`toma.apply_toma` calls, for one spec."""

    def __init__(self, spec: FamilySpec) -> None:
        self.spec = spec

    def matches(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` belongs to this family."""
        return self.spec.matches(model)

    def find_targets(self, model: torch.nn.Module, config: ToMAConfig) -> tuple[list[Patched], list[Skipped]]:
        """See :func:`find_targets`."""
        return find_targets(self.spec, model, config)

    def attach(self, model: torch.nn.Module, targets: list[Patched], cache: PlanCache) -> list[torch.nn.Module]:
        """See :func:`attach`."""
        return attach(self.spec, model, targets, cache)

    def detach(self, targets: list[Patched]) -> None:
        """Nothing beyond the hooks to undo."""

    def tile_frames(self, config: ToMAConfig) -> int:
        """Frames a tile spans: ``config.tile_frames``, else 2 for video families and 1 for images."""
        if not self.spec.video:
            return 1
        return config.tile_frames if config.tile_frames is not None else 2


class TileState:
    """The tile layout the tokens are in between two reorder points, or None for raster order."""

    def __init__(self) -> None:
        self.layout: TileLayout | None = None


class StepHook(Hook):
    """On the denoiser: records the grid and timestep in the cache and picks the token order."""

    def __init__(self, spec: FamilySpec, cache: PlanCache, order: TileState) -> None:
        self.spec = spec
        self.cache = cache
        self.order = order
        self.grid = spec.grid() if isinstance(spec.grid, type) else spec.grid  # one stateful reader per model
        self._warned: set[str] = set()

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        named = named_arguments(module, args, kwargs)
        grid = self.grid(module, named)
        if isinstance(grid, str):  # a reason why this call cannot merge: say it, once
            if grid not in self._warned:
                self._warned.add(grid)
                warnings.warn(f"ToMA: {grid}; such calls run unmerged", stacklevel=4)
            grid = None
        self.cache.begin_forward(grid if grid is not None else (0, 0, 0), step_timestep(self.cache, named.get("timestep")))
        raster = grid is None or any(named.get(k) is not None for k in self.spec.raster_kwargs)
        if not raster and self.spec.tile_order_ok is not None:
            raster = not self.spec.tile_order_ok(module, named)
        self.order.layout = None if raster else self.cache.tile_order_layout(grid)
        for name in self.spec.position_inputs if self.order.layout is not None else ():
            args, kwargs = _positions_to_tile_order(module, name, named.get(name), self.order.layout, args, kwargs)
        return args, kwargs


def _positions_to_tile_order(
    module: torch.nn.Module, name: str, rows: Any, layout: TileLayout, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """The call with its per-token position rows ``name`` (``(N, d)`` or ``(B, N, d)``) in tile order."""
    if not isinstance(rows, torch.Tensor) or rows.ndim not in (2, 3) or rows.shape[-2] != layout.num_tokens:
        return args, kwargs
    with profiled("toma::merge"):
        ordered = tile_order(rows if rows.ndim == 3 else rows[None], layout)
    names = _parameter_names(type(module))
    index = names.index(name) if name in names else None
    return replace_arg(args, kwargs, name, index, ordered if rows.ndim == 3 else ordered[0])


class Reorder(Hook):
    """Puts the tokens in tile order where they enter the blocks, back in raster order where they leave."""

    def __init__(self, order: TileState, enter: bool, on_output: bool) -> None:
        self.order = order
        self.enter = enter
        self.on_output = on_output

    def _convert(self, x: torch.Tensor) -> torch.Tensor:
        layout = self.order.layout
        if layout is None or x.ndim != 3 or x.shape[1] != layout.num_tokens:
            return x
        with profiled("toma::merge" if self.enter else "toma::unmerge"):  # reordering is part of merging's cost
            return tile_order(x, layout) if self.enter else raster_order(x, layout)

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.on_output:
            return args, kwargs
        x = hidden_states_of(args, kwargs)
        return (args, kwargs) if x is None else with_hidden_states(args, kwargs, self._convert(x))

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        return self._convert(output) if self.on_output else output


class RotaryToTileOrder(Hook):
    """On the rotary module: the image rows of its tables to tile order (text rows lead)."""

    def __init__(self, order: TileState, seq_dim: int, items: tuple[int, ...] | None = None) -> None:
        self.order = order
        self.seq_dim = seq_dim
        self.items = items  # the items of the output tuple with image rows (None: all)
        self._rows: dict[tuple[int, TileLayout, torch.device], torch.Tensor] = {}

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        layout = self.order.layout
        if layout is None:
            return output
        items = range(len(output)) if self.items is None else self.items
        table = output[items[0]]
        text = table.shape[self.seq_dim] - layout.num_tokens
        key = (text, layout, table.device)
        rows = self._rows.get(key)
        if rows is None:  # built on the device once per grid: no host-to-device copy per step
            rows = self._rows[key] = rotary_rows(layout, text, table.device)
        with profiled("toma::merge"):
            return tuple(t.index_select(self.seq_dim, rows) if i in items else t for i, t in enumerate(output))


def rotary_rows(layout: TileLayout, text: int, device: torch.device) -> torch.Tensor:
    """Row order that puts the image rows of a ``(text + N, ...)`` table in tile order, text first.

    Made as an ordinary tensor even under inference_mode: it is kept for later calls, which
    may train and save it for backward.
    """
    with torch.inference_mode(False):
        image = tile_order(torch.arange(layout.num_tokens, device=device)[None, :, None], layout).flatten()
        return torch.cat([torch.arange(text, device=device), image + text])


class MergeHook(Hook):
    """Merges the image hidden states ``(B, N, C)`` of a sub-module's call and unmerges its output.

    Tokens are in raster order, or in tile order while ``order`` says so. A call with an
    attention mask of its own (laid out over the unmerged sequence) gets it fitted to the
    merged tokens by the site's ``joint_mask``, or runs unmerged where there is none. With a
    site that takes rotary tables, they are gathered to the merged tokens; under
    proportional attention the plan's log masses go in as the site's attention mask.
    """

    def __init__(self, cache: PlanCache, downsample: int, order: TileState, site: Site | None = None, bias: bool = False,
                 part: str = "attn") -> None:
        self.cache = cache
        self.downsample = downsample
        self.order = order
        self.site = site
        self.ratio = cache.config.ratio_for(site.part if site is not None else part)
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
        if x is None or x.ndim != 3 or grid is None:
            return args, kwargs
        # a mask of the model's own is laid out over the unmerged keys; cross-attention's
        # keys are the text, which stays whole, so only self-attention must then adapt it
        # to the merged keys (where the family says how) or run unmerged
        site = self.site
        own = None if site is not None and site.part == "cross" else self._own_mask(args, kwargs)
        if own is not None and (site is None or site.joint_mask is None):
            return args, kwargs
        tiled = self.order.layout is not None
        tokens = math.prod(grid)
        text = x.shape[1] - tokens if site is not None and site.text_first else 0
        image = x[:, text:] if text > 0 else x
        plan = self.cache.get(image, grid, group=grid, tiled=tiled, ratio=self.ratio)
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
        merged = plan.merge(image, tiled)
        if text:
            merged = torch.cat([x[:, :text], merged], dim=1)
        args, kwargs = with_hidden_states(args, kwargs, merged)
        if site is not None and site.rotary is not None:
            args, kwargs, self._samples = _gather_rotary(site.rotary, plan, tiled, tokens, args, kwargs)
        if self.bias:
            if site is None:  # UNet attention processors: (batch * heads, 1, K)
                kwargs = {**kwargs, "attention_mask": _head_bias(plan, merged.shape[0], module.heads)}
            else:
                mask = plan.memo(f"mask_{site.path}", lambda: site.mask_layout(plan.log_mass, merged.shape[0], module.heads))
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
            return (plan.unmerge(output[0], self._tiled), *output[1:])
        if self._text:  # [text; image] in one sequence
            t = self._text
            return torch.cat([output[:, :t], plan.unmerge(output[:, t:], self._tiled)], dim=1)
        return plan.unmerge(output, self._tiled)


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


def gather_rows(table: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """Rows ``dest`` ``(Bp, K)`` of a per-batch table ``(Bt, N, D)`` (``Bt`` 1 or B): ``(max(Bt, Bp), K, D)``."""
    if table.shape[0] == 1:
        return table[0][dest]
    if dest.shape[0] == 1:
        return table[:, dest[0]]
    return table.gather(1, dest[..., None].expand(-1, -1, table.shape[-1]))


def head_mask(log_mass: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """Log masses ``(Bp, K)`` as the ``(batch * heads, 1, K)`` mask diffusers' classic
    attention processors (``AttnProcessor2_0``) take as is."""
    bias = log_mass[:, None, :]
    return bias.expand(batch * heads, 1, -1) if bias.shape[0] == 1 else bias.repeat_interleave(heads, dim=0)


def replace_arg(args: tuple, kwargs: dict, name: str, index: int | None, value: Any) -> tuple[tuple, dict]:
    """The call's arguments with ``value`` for the parameter ``name`` at position ``index``."""
    if index is not None and len(args) > index:
        return (*args[:index], value, *args[index + 1 :]), kwargs
    return args, {**kwargs, name: value}


def named_arguments(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by parameter name of the module's ``forward``, positional ones
    included (a model called positionally must merge as one called by keyword)."""
    if not args:
        return kwargs
    names = _parameter_names(type(module))
    return {**dict(zip(names, args)), **kwargs}


@functools.cache
def _parameter_names(cls: type) -> tuple[str, ...]:
    """Names of the positional parameters of ``cls.forward`` (a class's signature never changes)."""
    params = list(inspect.signature(cls.forward).parameters.values())[1:]  # without self
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


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
