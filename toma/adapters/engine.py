"""The family engine: merging around sub-modules of transformer blocks, declared per family.

A family states, in a :class:`~toma.adapters.spec.FamilySpec`, where its blocks are,
which sub-modules of a block merge, how to read the token grid from the model's call,
where its rotary tables come from and which modules bracket the token sequence. The
engine does the rest, the same way for every family:

* a hook on each merged sub-module (:mod:`toma.adapters.merging`) merges its image tokens
  before the call and unmerges its output after it; text tokens are never merged;
* a hook on the model records the grid and the timestep (plan reuse across steps) and
  decides whether the forward runs in tile order: every op of these blocks but attention
  treats tokens one at a time, and attention does not depend on their order once rotary
  positions follow the tokens. So the tokens are put in tile order once where they enter
  the blocks and back in raster order where they leave, and merging is a matmul on a view.
  Padded grids and calls that add raster-ordered residuals (ControlNet) stay in raster order.
  Rotary tables follow: at the output of the module that makes them or, where a method of
  the model makes them (``BlockRope``), at every block's call.
* where a family's sequence may carry conditioning images after the generated one's
  (a ``Conditioned`` stream: editing), their tokens lead in the blocks and pass
  every merge whole, as text does.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from typing import Any

import torch

from toma.adapters.attention import dispatch_modules, install, uninstall
from toma.adapters.base import (
    HOOK_NAME,
    ROPE_HOOK_NAME,
    Hook,
    Patched,
    Skipped,
    step_timestep,
)
from toma.adapters.chunking import Chunked, chunkable_block, take_over_chunking
from toma.adapters.ledger import Ledger
from toma.adapters.merging import (
    MergeHook,
    PerSample,
    SpanCall,
    SpanClose,
    SpanOpen,
    SpanState,
    TileState,
    bias_setting,
    hidden_states_of,
    nested_tensors,
    replace_arg,
    with_hidden_states,
)
from toma.adapters.parallel import (
    Shard,
    cp_config,
    refusal,
    shard_index,
    shard_of,
    splits_call,
    splits_output,
    spread_leads,
    spread_order,
    unsplit_tokens,
    world_size,
)
from toma.adapters.replay import attach_replay
from toma.adapters.spec import (
    BlockRope,
    FamilySpec,
    Grid,
    GridReader,
    Quirks,
    RopeModule,
    Rotary,
    Site,
    gather_rows,
    gather_token_rows,
    head_mask,
    image_grid,
    video_grid,
    skip_first,
)
from toma.config import ToMAConfig
from toma.core.plan import profiled
from toma.adapters.state import PlanCache
from toma.core.tiling import TileLayout, lead_spans, slot_raster_index, tile_order

# the spec's names, re-exported for the engine's users (the UNet adapter, tests); families take them from spec
__all__ = [
    "EngineAdapter",
    "FamilySpec",
    "Grid",
    "GridReader",
    "MergeHook",
    "Rotary",
    "Site",
    "TileState",
    "attach",
    "chosen_blocks",
    "find_targets",
    "gather_rows",
    "gather_token_rows",
    "head_mask",
    "hidden_states_of",
    "image_grid",
    "video_grid",
    "order_hooks",
    "register",
    "skip_first",
    "with_hidden_states",
]


def chosen_blocks(spec: FamilySpec, model: torch.nn.Module, config: ToMAConfig) -> dict[str, tuple[int, ...]]:
    """The merged block indices per stack: ``config.blocks`` where given, else the family's default.

    Raises:
        ValueError: a stack the model does not have, or an index past a stack's end.
    """
    chosen = dict(config.blocks or ())
    unknown = sorted(set(chosen) - set(spec.stacks))
    if unknown:
        raise ValueError(
            f"blocks names {unknown}, which {spec.name} does not have; its block stacks are {list(spec.stacks)}"
        )
    out = {}
    for stack in spec.stacks:
        count = len(model.get_submodule(stack))
        indices = chosen.get(stack, spec.default_blocks(stack, count) if config.blocks is None else ())
        bad = [i for i in indices if i >= count]
        if bad:
            raise ValueError(f"blocks[{stack!r}] must hold indices in [0, {count - 1}]; got {bad}")
        out[stack] = tuple(indices)
    return out


# what a family lacks when merge_crossattn / merge_mlp is refused, and why
# proportional_attention=True is: the refusals' words, which the compatibility matrix
# (toma.compat) shows in its cells
NO_PART = {"cross": "cross-attention (its text joins the image tokens in attention)", "mlp": "separate MLP to merge"}
NO_BIAS = "proportional_attention=True needs an attention mask, which {where} cannot take"


def find_targets(spec: FamilySpec, model: torch.nn.Module, config: ToMAConfig) -> tuple[list[Patched], list[Skipped]]:
    """The sub-modules to merge and the blocks left alone, with why. Touches nothing."""
    wanted = {"attn": config.merge_attn, "cross": config.merge_crossattn, "mlp": config.merge_mlp}
    sites_of = {
        (stack, i): spec.sites(stack, b) for stack in spec.stacks for i, b in enumerate(model.get_submodule(stack))
    }
    has = {s.part for sites in sites_of.values() for s in sites}
    for part, option in (("cross", "merge_crossattn"), ("mlp", "merge_mlp")):
        if wanted[part] and part not in has:  # accepted but merging nothing: say so
            raise ValueError(f"{option}=True: {spec.name} has no {NO_PART[part]}; set {option}=False")
    targets: list[Patched] = []
    skipped: list[Skipped] = []
    for stack, indices in chosen_blocks(spec, model, config).items():
        for i, block in enumerate(model.get_submodule(stack)):
            name = f"{stack}.{i}"
            if i not in indices:
                skipped.append(Skipped(name, "not among the merged blocks"))
                continue
            sites = [s for s in sites_of[(stack, i)] if wanted[s.part]]
            if config.proportional_attention:
                lacking = [s.path for s in sites if s.part == "attn" and not s.takes_bias]
                if lacking:
                    raise ValueError(
                        NO_BIAS.format(where=f"{spec.name}'s {name}.{lacking[0]}")
                        + "; use proportional_attention=False or None"
                    )
            if not sites:
                skipped.append(Skipped(name, "none of its parts is merged with these settings"))
            for site in sites:
                if site.span is not None:  # the span's modules are found from the block at attach
                    what = f"{stack} {site.part}, {site.path} to {site.span.until}"
                    targets.append(Patched(name, block, what, site=site))
                else:
                    targets.append(
                        Patched(
                            f"{name}.{site.path}", block.get_submodule(site.path), f"{stack} {site.part}", site=site
                        )
                    )
    return targets, skipped


def order_hooks(
    spec: FamilySpec, model: torch.nn.Module, cache: PlanCache
) -> tuple[TileState, list[tuple[torch.nn.Module, Hook]]]:
    """The hooks every family needs: the step hook on the model, the reorderings where
    tokens enter and leave the blocks, and the rotary tables' reordering. Not registered."""
    order = TileState(cache)
    kind, path = spec.enter
    if kind == "block":
        entry = next(model.get_submodule(s) for s in spec.stacks if len(model.get_submodule(s)))[0]
    else:
        entry = model.get_submodule(path)
    channels_last = kind == "channels_last"
    grid = "first" if kind == "grid" else channels_last
    hooks: list[tuple[torch.nn.Module, Hook]] = [
        (model, StepHook(spec, cache, order)),
        (entry, Reorder(order, enter=True, on_output=kind != "block", grid=grid)),
        (model.get_submodule(spec.leave), Reorder(order, enter=False, on_output=False, grid=channels_last)),
    ]
    for rope in spec.tables:
        if isinstance(rope, RopeModule):
            rotary = RotaryToTileOrder(order, rope.dim, rope.items, image_first=rope.image_first)
            hooks.append((model.get_submodule(rope.path), rotary))
    return order, hooks


def block_rope_hooks(
    spec: FamilySpec, model: torch.nn.Module, cache: PlanCache, order: TileState, ledger: Ledger
) -> list[torch.nn.Module]:
    """Registers, on every block of the stacks, the hook that puts the rotary tables the
    block takes in the blocks' order (a :class:`~toma.adapters.spec.BlockRope` of
    ``spec.tables``); returns the blocks."""
    rope = next((t for t in spec.tables if isinstance(t, BlockRope)), None)
    if rope is None:
        return []
    memo: dict = {}  # one reordering per forward, shared by the blocks
    blocks = [block for stack in spec.stacks for block in model.get_submodule(stack)]
    for block in blocks:
        hook = BlockRotaryToOrder(cache, order, (rope.keyword, rope.position, rope.dim), rope.items, memo)
        ledger.hook(block, hook, ROPE_HOOK_NAME)
    return blocks


def register(hooks: list[tuple[torch.nn.Module, Hook]], ledger: Ledger) -> list[torch.nn.Module]:
    """Register ``hooks`` under toma's hook name; returns the hooked modules."""
    for module, hook in hooks:
        ledger.hook(module, hook, HOOK_NAME)
    return [module for module, _ in hooks]


def attach(
    spec: FamilySpec, model: torch.nn.Module, targets: list[Patched], cache: PlanCache, ledger: Ledger
) -> list[torch.nn.Module]:
    """Register the engine's hooks, each recorded in ``ledger``; returns every module that got one."""
    order, hooks = order_hooks(spec, model, cache)
    chunkers = []
    for target in targets:
        site = target.site
        bias = bias_setting(cache.config, site)
        if site.span is not None:
            block, state = target.module, SpanState()
            hooks += [
                (block.get_submodule(site.path), SpanOpen(cache, order, site, state)),
                (block.get_submodule(site.span.call), SpanCall(cache, order, site, state, bias=bias)),
                (block.get_submodule(site.span.until), SpanClose(state)),
            ]
            continue
        calls = []
        block = chunkable_block(model, target, site.path) if site.part == "mlp" else None
        if block is not None:
            calls.append(Chunked(take_over_chunking(block, ledger)))
            chunkers.append(block)
        if site.rotary is not None and site.rotary.shared:
            calls.append(PerSample(site.rotary))
        if bias and site.bias is not None:  # innermost: after PerSample has sliced the bias
            calls.extend(site.bias.calls())
        hooks.append((target.module, MergeHook(cache, 1, order, site, bias=bias, calls=tuple(calls))))
    blocks = [".".join(target.name.split(".")[:2]) for target in targets]  # "stack.index"
    return (
        register(hooks, ledger)
        + block_rope_hooks(spec, model, cache, order, ledger)
        + chunkers
        + attach_replay(model, blocks, cache, ledger)
    )


class EngineAdapter:
    """A family's adapter on the engine: what :func:`toma.apply_toma` calls, for one spec
    and the family's :class:`~toma.adapters.spec.Quirks`, if it has any."""

    def __init__(self, spec: FamilySpec, quirks: Quirks | None = None) -> None:
        self.spec = spec
        self.quirks = quirks if quirks is not None else Quirks()

    def matches(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` belongs to this family."""
        return self.spec.matches(model)

    def placement(self) -> tuple[tuple[str, ...], str]:
        """The placement options this family takes, and how they place merging (see
        :func:`toma.adapters.check_placement`): ``blocks``, and ``tile_frames`` for video."""
        hint = f"blocks={{stack: indices}} with stacks {list(self.spec.stacks)}"
        taken = ("blocks", "tile_frames") if self.spec.video else ("blocks",)
        return self.quirks.placement(taken, hint + (" and tile_frames" if self.spec.video else ""))

    def find_targets(self, model: torch.nn.Module, config: ToMAConfig) -> tuple[list[Patched], list[Skipped]]:
        """See :func:`find_targets`, with the settings the family's quirks make of ``config``."""
        return find_targets(self.spec, model, self.quirks.config(model, config))

    def attach(
        self, model: torch.nn.Module, targets: list[Patched], cache: PlanCache, ledger: Ledger
    ) -> list[torch.nn.Module]:
        """See :func:`attach`; also wraps the dispatched attention of processors that take a
        key bias (:mod:`toma.adapters.attention`), then attaches the family's quirks, each
        change recorded in ``ledger``."""
        hooked = attach(self.spec, model, targets, cache, ledger)
        if any(bias_setting(cache.config, t.site) for t in targets):
            for name, users in dispatch_modules(targets).items():
                install(name, users)
                ledger.record(f"dispatch wrapper in {name}", lambda name=name, users=users: uninstall(name, users))
        return hooked + self.quirks.attach(model, targets, cache, ledger)

    @property
    def reference_tokens(self) -> int | None:
        """Tokens of a frame at the family's default resolution (``tile_size="auto"``), or None."""
        ref = self.spec.reference
        return None if ref is None else ref[0] * ref[1]

    def tile_frames(self, config: ToMAConfig) -> int:
        """Frames a tile spans: ``config.tile_frames``, else 1 (2-D tiles; images: always 1).

        2-D tiles are the default for video: on the built-in video DiT (100 clips, ratio 0.5)
        they were at least as faithful as 2-frame tiles, at the same speed, and a frame
        count that 2-frame tiles do not divide (Wan's 21 latent frames) needs no padding.
        """
        if not self.spec.video:
            return 1
        return self.quirks.tile_frames(config, config.tile_frames if config.tile_frames is not None else 1)


class StepHook(Hook):
    """On the denoiser: records the grid and timestep in the cache and picks the token order."""

    def __init__(self, spec: FamilySpec, cache: PlanCache, order: TileState) -> None:
        self.spec = spec
        self.cache = cache
        self.order = order
        self.grid = spec.grid() if isinstance(spec.grid, type) else spec.grid  # one stateful reader per model
        self._warned: set[str] = set()
        self._lead: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        named = named_arguments(module, args, kwargs)
        x = hidden_states_of(args, kwargs)
        cp = cp_config(module)
        if cp is not None:  # context parallelism enabled, maybe after apply_toma
            reason = refusal(self.spec.name, cp, self.cache.config)
            if reason is not None:
                raise ValueError(reason)
            if self.spec.stream.spread is not None:
                grid, shard = self._spread_grid(module, named, cp)
            else:
                grid, shard = self._shard_grid(module, named, x, cp)
        else:
            grid, shard = self.grid(module, named), None
        if isinstance(grid, str):  # a reason why this call cannot merge: say it, once
            self._warn_once(grid)
            grid = None
        self.cache.begin_forward(
            grid if grid is not None else (0, 0, 0), step_timestep(self.cache, self._timestep(named))
        )
        self.cache.forward.shard = shard
        if shard is not None and shard.leads is not None and self.cache.merging:
            # a spread packed shard: the call's rows moved so that the split hands it its part
            # (in forwards that merge nothing the model's order stays: bitwise the unpatched output)
            moved = self.spec.stream.spread.rows(module, named, spread_order(shard.leads, math.prod(shard.whole)))
            names = _parameter_names(type(module))
            for name, value in moved.items():
                args, kwargs = replace_arg(args, kwargs, name, names.index(name) if name in names else None, value)
        # a spread packed shard holds its image run in raster order: its rows were moved at the call
        raster = grid is None or (shard is not None and shard.leads is not None)
        if not raster and self.spec.tile_order_ok is not None:
            raster = not self.spec.tile_order_ok(module, named)
        device = x.device if isinstance(x, torch.Tensor) else None  # the Triton path merges from raster order
        order = self.order
        order.layout = None if raster else self.cache.tile_order_layout(grid, device)
        order.extra = 0
        order.enter = order.leave = None
        stream = self.spec.stream
        order.packed = stream.packed
        # conditioning tokens lead only in forwards that merge: others keep the model's order
        # (under context parallelism a shard's tokens are all the generated image's)
        lead = grid is not None and stream.conditioning and self.cache.merging and shard is None
        if lead and isinstance(x, torch.Tensor):
            order.extra = self._conditioning(module, named, x, grid)
            if order.extra:
                order.enter, order.leave = self._lead_index(math.prod(grid), order.extra, order.layout, x.device)
        if order.layout is not None or order.extra:
            for name in stream.positions:
                args, kwargs = _positions_to_block_order(module, name, named.get(name), order, args, kwargs)
        return args, kwargs

    def _timestep(self, named: dict) -> Any:
        """The call's denoising timestep, falling over a run (see ``FamilySpec.timestep``); read
        only where the cache needs it (:func:`~toma.adapters.base.step_timestep`)."""
        reader = self.spec.timestep
        return named.get("timestep") if reader is None else reader(named)

    def _conditioning(self, module: torch.nn.Module, named: dict, x: torch.Tensor, grid: Grid) -> int:
        """How many conditioning tokens follow the image's on ``grid`` in the call."""
        count = self.spec.stream.conditioning
        if callable(count):  # hidden_states are latents: the family counts them
            return count(module, named)
        return x.shape[1] - math.prod(grid) if x.ndim == 3 else 0

    def _warn_once(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"ToMA: {reason}; such calls run unmerged", stacklevel=5)

    def _shard_grid(
        self, module: torch.nn.Module, named: dict, x: Any, cp: Any
    ) -> tuple[Grid | str | None, Shard | None]:
        """Under context parallelism ``cp``: the grid of this rank's shard (see
        :mod:`toma.adapters.parallel`) or why the call cannot merge, and the :class:`Shard`."""
        world = world_size(cp)
        split = splits_call(module) and isinstance(x, torch.Tensor) and x.ndim == 3
        # readers give the whole grid; one that checks it against the call's tokens must
        # count every rank's
        grid = self.grid(module, {**named, "hidden_states": unsplit_tokens(x, world)} if split else named)
        if grid is None or isinstance(grid, str):
            return grid, None
        if split:
            tokens = x.shape[1]
        else:
            sequence = x.shape[1] if isinstance(x, torch.Tensor) and x.ndim == 3 else math.prod(grid)
            tokens = sequence // world
        found = shard_of(grid, tokens, world, shard_index(cp))
        if found is None:
            return (
                "under context parallelism, a sequence with tokens other than the generated image's "
                "(conditioning images) is split across ranks regardless of the image's grid"
            ), None
        return found

    def _spread_grid(self, module: torch.nn.Module, named: dict, cp: Any) -> tuple[Grid | str | None, Shard | None]:
        """Under context parallelism, for a packed family whose sequence diffusers splits
        (a ``Packed`` stream's ``spread_rows``): this rank's run of the image, under a ``(1, 1, n)`` stand-in
        (a span of the whole grid), and its :class:`Shard`, with every shard's prefix rows
        in ``leads``. Every rank reads the same whole call, so all decide alike."""
        grid = self.grid(module, named)
        if grid is None or isinstance(grid, str):
            return grid, None
        world, tokens = world_size(cp), math.prod(grid)
        leads = spread_leads(self.spec.stream.spread.length(named) - tokens, tokens, world)
        if leads is None:
            return "under context parallelism, a packed sequence that does not split into shards holding video", None
        span = lead_spans(leads, tokens)[shard_index(cp)]
        return (1, 1, span[1] - span[0]), Shard(world, span[1] - span[0], span, tuple(grid), leads)

    def _lead_index(
        self, tokens: int, extra: int, layout: TileLayout | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The index that puts ``extra`` conditioning tokens first and the ``tokens`` image
        tokens after them (in ``layout``'s tile order, or raster order), and its inverse;
        built once per shape, on the device, as ordinary tensors (training may save them)."""
        key = (tokens, extra, layout, device)
        known = self._lead.get(key)
        if known is None:
            with torch.inference_mode(False):
                image = torch.arange(tokens, device=device) if layout is None else slot_raster_index(layout, device)
                enter = torch.cat([torch.arange(tokens, tokens + extra, device=device), image])
                known = self._lead[key] = (enter, torch.argsort(enter))
        return known


def _positions_to_block_order(
    module: torch.nn.Module, name: str, rows: Any, order: TileState, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """The call with its per-token position rows ``name`` (``(N, d)`` or ``(B, N, d)``) in the
    order the tokens have in the blocks (tile order; conditioning tokens first). In a packed
    sequence (``order.packed``), rows ``(S,)``, ``(S, d)`` or ``(B, S, d)`` over ``[prefix; image]``
    with their image rows in tile order and the prefix's in place."""
    count = order.enter.numel() if order.extra else order.layout.num_tokens
    if not isinstance(rows, torch.Tensor):
        return args, kwargs
    seq = rows.shape[1 if rows.ndim == 3 else 0] if rows.ndim in (1, 2, 3) else 0
    if order.packed and not order.extra and (seq > count or (rows.ndim == 1 and seq == count)):
        shaped = rows[None, :, None] if rows.ndim == 1 else rows[None] if rows.ndim == 2 else rows
        ordered = order.convert(shaped, enter=True)
        ordered = ordered[0, :, 0] if rows.ndim == 1 else ordered[0] if rows.ndim == 2 else ordered
    elif rows.ndim not in (2, 3) or rows.shape[-2] != count:
        return args, kwargs
    else:
        ordered = order.convert(rows if rows.ndim == 3 else rows[None], enter=True)
        ordered = ordered if rows.ndim == 3 else ordered[0]
    names = _parameter_names(type(module))
    index = names.index(name) if name in names else None
    return replace_arg(args, kwargs, name, index, ordered)


class Reorder(Hook):
    """Puts the tokens in the blocks' order where they enter the blocks (tile order, after
    any conditioning tokens), and back in the model's where they leave. With ``grid``, the
    tokens may come as a channel-last grid ``(B, t, h, w, C)`` that the forward flattens to
    the blocks' sequence, or reshaped from it (``enter`` a ``channels_last`` grid): they are
    reordered as that sequence, in the grid's shape. With ``grid="first"``, they come as a
    channel-first grid ``(B, C, t, h, w)`` that the forward flattens with
    ``flatten(2).transpose(1, 2)`` (a patch embedding's output, ``FamilySpec.enter``'s
    ``"grid"``): the result is a view of the reordered sequence, so that flattening it
    costs no copy."""

    def __init__(self, order: TileState, enter: bool, on_output: bool, grid: bool | str = False) -> None:
        self.order = order
        self.enter = enter
        self.on_output = on_output
        self.grid = grid

    def _convert(self, x: torch.Tensor) -> torch.Tensor:
        if self.grid == "first" and x.ndim > 3:
            return self.order.convert(x.flatten(2).transpose(1, 2), self.enter).transpose(1, 2).reshape(x.shape)
        if self.grid and x.ndim > 3:
            # a plain reshape of the sequence in the blocks' order: flattening undoes it
            return self.order.convert(x.flatten(1, -2), self.enter).reshape(x.shape)
        return self.order.convert(x, self.enter)

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.on_output:
            return args, kwargs
        x = hidden_states_of(args, kwargs)
        return (args, kwargs) if x is None else with_hidden_states(args, kwargs, self._convert(x))

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        return self._convert(output) if self.on_output else output


class RotaryToTileOrder(Hook):
    """On the rotary module: the image rows of its tables to the blocks' order (tile order;
    text rows lead, then any conditioning tokens' rows; or, with ``image_first``, the image's
    rows lead and the text's follow)."""

    def __init__(
        self, order: TileState, seq_dim: int, items: tuple[int, ...] | None = None, image_first: bool = False
    ) -> None:
        self.order = order
        self.seq_dim = seq_dim
        self.items = items  # the items of the output tuple with image rows (None: all)
        self.image_first = image_first
        self._rows: dict[tuple, torch.Tensor] = {}  # (text rows, layout or index, device) -> row order

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        order = self.order
        layout = order.layout
        if layout is None and not order.extra:
            return output
        if isinstance(output, torch.Tensor):  # one table (HiDream's), not a tuple
            return self.post_forward(module, (output,))[0]
        items = range(len(output)) if self.items is None else self.items
        table = output[items[0]]
        # diffusers splits the output of some rotary modules (Wan's, LTX's, Qwen-Image's)
        # after this hook: their tables then hold every shard's rows
        runs = order.shard.world if not order.extra and order.shard is not None and splits_output(module) else 1
        rows = block_order_rows(order, table.shape[self.seq_dim], table.device, self._rows, runs, self.image_first)
        with profiled("toma::merge"):
            return tuple(t.index_select(self.seq_dim, rows) if i in items else t for i, t in enumerate(output))


class BlockRotaryToOrder(Hook):
    """On a block that takes rotary tables its model makes with no module (``BlockRope``):
    their image rows to the blocks' order at the block's call, as :class:`RotaryToTileOrder`
    does at a rotary module's output. Items may nest tensors; every block of a forward gets
    the same tables, reordered once (``memo``, shared by the blocks).

    A model may make them on the host whatever its device (JoyImage's ``get_rotary_pos_embed``;
    its processor copies them to the device at every call): in a forward that merges they go
    to the device of the block's hidden states, once per forward, so that their gathers to
    merged tokens (whose indices are on the device) run there.
    """

    def __init__(
        self,
        cache: PlanCache,
        order: TileState,
        where: tuple[str, int | None, int],
        items: tuple[int, ...] | None,
        memo: dict,
    ) -> None:
        self.cache = cache
        self.order = order
        self.name, self.index, self.seq_dim = where
        self.items = items
        self.memo = memo
        self._rows: dict[tuple, torch.Tensor] = {}

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if not self.cache.merging:  # the model's own tables, untouched
            return args, kwargs
        order = self.order
        positional = self.index is not None and len(args) > self.index
        tables = args[self.index] if positional else kwargs.get(self.name)
        x = hidden_states_of(args, kwargs)
        if tables is None or not isinstance(x, torch.Tensor):
            return args, kwargs
        single = isinstance(tables, torch.Tensor)
        items = (tables,) if single else tuple(tables)
        wanted = range(len(items)) if self.items is None else self.items
        sources = tuple(items[i] for i in wanted)
        tensors = nested_tensors(sources)  # what identifies the tables (Dynamo compares tensors, not tuples)
        reorder = order.layout is not None or bool(order.extra)
        if not reorder and all(t.device == x.device for t in tensors):
            return args, kwargs
        known = self.memo.get("last")
        if not (
            known is not None
            and known[1] is order.layout
            and known[2] is order.enter
            and known[3] == x.device
            and len(known[0]) == len(tensors)
            and all(a is b for a, b in zip(known[0], tensors))
        ):
            with profiled("toma::merge"):
                done = [self._reorder(t, x.device, reorder) for t in sources]
            known = self.memo["last"] = (tensors, order.layout, order.enter, x.device, done)
        ordered = iter(known[4])
        new = tuple(next(ordered) if i in wanted else t for i, t in enumerate(items))
        return replace_arg(args, kwargs, self.name, self.index if positional else None, new[0] if single else new)

    def _reorder(self, table: Any, device: torch.device, reorder: bool) -> Any:
        if isinstance(table, (tuple, list)):
            return type(table)(self._reorder(t, device, reorder) for t in table)
        if not isinstance(table, torch.Tensor):
            return table
        table = table.to(device)
        if not reorder:
            return table
        rows = block_order_rows(self.order, table.shape[self.seq_dim], device, self._rows)
        return table.index_select(self.seq_dim, rows)


def block_order_rows(
    order: TileState, length: int, device: torch.device, known: dict, runs: int = 1, image_first: bool = False
) -> torch.Tensor:
    """Row order that takes a ``(text + N + extra, ...)`` rotary table in the model's order to
    the blocks' (text rows, then conditioning tokens', then the image's in tile order); with
    ``runs`` > 1, a table of ``runs`` shards' image rows (see :func:`rotary_rows`); with
    ``image_first``, a ``(N + text, ...)`` table (no conditioning tokens). Built on the device
    once per shape (kept in ``known``): no host-to-device copy per step."""
    if order.extra and image_first:
        raise ValueError("block_order_rows: image-first tables with conditioning tokens are not supported")
    if order.extra:  # the conditioning tokens' rows, then the image's, after the text's
        text = length - order.enter.numel()
        key = (text, order.enter, device)  # the step hook keeps one index per shape
        rows = known.get(key)
        if rows is None:
            with torch.inference_mode(False):
                rows = torch.cat([torch.arange(text, device=device), order.enter.to(device) + text])
            known[key] = rows
        return rows
    layout = order.layout
    text = length - runs * layout.num_tokens
    key = (text, layout, runs, device, image_first)
    rows = known.get(key)
    if rows is None:
        rows = known[key] = rotary_rows(layout, text, device, runs, image_first)
    return rows


def rotary_rows(
    layout: TileLayout, text: int, device: torch.device, runs: int = 1, image_first: bool = False
) -> torch.Tensor:
    """Row order that puts the image rows of a ``(text + N, ...)`` table in tile order, text first
    (with ``image_first``, of a ``(N + text, ...)`` table, text last); with ``runs`` > 1,
    ``runs`` consecutive runs of ``N`` image rows (every context-parallel shard's), each in its
    own tile order.

    Made as an ordinary tensor even under inference_mode: it is kept for later calls, which
    may train and save it for backward.
    """
    with torch.inference_mode(False):
        image = tile_order(torch.arange(layout.num_tokens, device=device)[None, :, None], layout).flatten()
        image = torch.cat([image + r * layout.num_tokens for r in range(runs)])
        if image_first:
            return torch.cat([image, torch.arange(image.numel(), image.numel() + text, device=device)])
        return torch.cat([torch.arange(text, device=device), image + text])


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
