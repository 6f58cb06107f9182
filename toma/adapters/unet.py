"""Adapter for diffusers UNets whose attention is ``BasicTransformerBlock`` (SD 1.x/2.x, SDXL).

Each merged sub-module of a transformer block (self-attention, optionally cross-attention
and the MLP) computes ``F(norm(x))`` on a residual stream. A diffusers hook on the
sub-module merges its input tokens and unmerges its output, so ``x + U F(M norm(x))``
replaces ``x + F(norm(x))`` and the residual stays at full resolution; blocks that
:mod:`toma.adapters.residual` covers hand the ``+ x`` to that hook, so that unmerge and add are
one kernel. Each transformer stack runs in tile order, where merging is a matmul on views: a
``Transformer2DModel`` flattens its image straight into it, other stacks reorder at their
first and last blocks. A hook on the UNet itself records the latent size and counts
denoising steps for plan reuse, and blocks recomputed under gradient checkpointing merge as
their forward did (:mod:`toma.adapters.replay`).
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

import torch

from toma.adapters.layouts import InMask
from toma.adapters import _private
from toma.adapters.base import HOOK_NAME, Hook, Patched, Skipped, step_timestep
from toma.adapters.chunking import Chunked, chunkable_block, take_over_chunking
from toma.adapters.engine import MergeHook, TileState, hidden_states_of, with_hidden_states
from toma.adapters.replay import attach_replay
from toma.adapters.residual import RESIDUAL_HOOK_NAME, FusedResidualHook, ResidualSlot, fusable
from toma.adapters.spec import Site, head_mask
from toma.config import ToMAConfig
from toma.core.plan import profiled
from toma.adapters.state import PlanCache
from toma.core.tiling import TileLayout, image_to_tile_order, tile_order_to_image

_LEVEL = re.compile(r"^(down_blocks|up_blocks)\.(\d+)\.|^(mid_block)\.")


def _is_transformer_block(module: torch.nn.Module) -> bool:
    # by name, so that matching a model imports no diffusers model code
    return any(cls.__name__ == "BasicTransformerBlock" for cls in type(module).__mro__)


# transformers whose blocks attend over the frames of each pixel (AnimateDiff's motion
# modules, ModelScope's temporal attentions), with BasicTransformerBlocks inside
_TEMPORAL = ("AnimateDiffTransformer3D", "TransformerTemporalModel")


def _is_temporal(module: torch.nn.Module) -> bool:
    return any(cls.__name__ in _TEMPORAL for cls in type(module).__mro__)


def matches(model: torch.nn.Module) -> bool:
    """Whether the model is a UNet with ``down_blocks``/``up_blocks`` and transformer blocks."""
    return (
        hasattr(model, "down_blocks")
        and hasattr(model, "up_blocks")
        and any(map(_is_transformer_block, model.modules()))
    )


def placement() -> tuple[tuple[str, ...], str]:
    """The placement options UNets take (see :func:`toma.adapters.check_placement`)."""
    return ("levels", "mlp_levels"), "levels (attention levels merged, from the highest resolution down) and mlp_levels"


def find_targets(model: torch.nn.Module, config: ToMAConfig) -> tuple[list[Patched], list[Skipped]]:
    """List the sub-modules to merge (and the transformer blocks skipped, with why).

    Touches nothing: this runs before any patching so that errors leave the model as is.
    """
    levels = len(model.down_blocks)
    blocks: list[tuple[str, torch.nn.Module, int]] = []
    skipped: list[Skipped] = []
    temporal = [f"{name}." for name, module in model.named_modules() if _is_temporal(module)]
    for name, module in model.named_modules():
        if not _is_transformer_block(module):
            continue
        if any(name.startswith(prefix) for prefix in temporal):
            skipped.append(
                Skipped(name, "temporal attention: over the frames of each latent pixel, not the image grid")
            )
            continue
        found = _LEVEL.match(name)
        if found is None:
            skipped.append(Skipped(name, "not inside down_blocks, mid_block or up_blocks"))
            continue
        if found.group(3):
            downsample = 2 ** (levels - 1)
        elif found.group(1) == "down_blocks":
            downsample = 2 ** int(found.group(2))
        else:
            downsample = 2 ** (len(model.up_blocks) - 1 - int(found.group(2)))
        blocks.append((name, module, downsample))
    attention_levels = sorted({ds for _, _, ds in blocks})
    if attention_levels and config.levels > len(attention_levels):
        # more levels than the model has would merge what levels=len does: say so, not accept it
        raise ValueError(
            f"levels must be in 1..{len(attention_levels)}: {type(model).__name__} has "
            f"{len(attention_levels)} attention level(s); got levels={config.levels}"
        )
    merged_levels = set(attention_levels[: config.levels])
    if config.mlp_levels is not None and config.mlp_levels[-1] > len(attention_levels):
        raise ValueError(
            f"mlp_levels names level {config.mlp_levels[-1]}, but {type(model).__name__} has "
            f"{len(attention_levels)} attention level(s)"
        )
    mlp_levels = merged_levels if config.mlp_levels is None else {attention_levels[i - 1] for i in config.mlp_levels}
    targets: list[Patched] = []
    for name, block, ds in blocks:
        if ds not in merged_levels:
            skipped.append(Skipped(name, f"downsample {ds} is not among the merged levels {sorted(merged_levels)}"))
            continue
        parts = [
            ("attn1", config.merge_attn),
            ("attn2", config.merge_crossattn),
            ("ff", config.merge_mlp and ds in mlp_levels),
        ]
        for part, wanted in parts:
            sub = getattr(block, part, None)
            if wanted and sub is not None:
                targets.append(Patched(f"{name}.{part}", sub, f"downsample {ds}", ds))
    return targets, skipped


# the block sub-modules merged, as the engine's sites: each names the ToMAConfig part whose
# ratio it uses, and attention takes proportional attention's log masses as the
# (batch * heads, 1, K) mask diffusers' classic processors take as is
SITES = {
    "attn1": Site("attn1", "attn", bias=InMask(("attention_mask", None), head_mask)),
    "attn2": Site("attn2", "cross"),
    "ff": Site("ff", "mlp"),
}


def attach(model: torch.nn.Module, targets: list[Patched], cache: PlanCache, ledger: Any) -> list[torch.nn.Module]:
    """Register the hooks, each recorded in ``ledger`` (a :class:`~toma.adapters.ledger.Ledger`);
    returns every module that got one."""
    hooked = [model]
    ledger.hook(model, UNetStepHook(cache), HOOK_NAME)
    states: dict[str, TileState] = {}
    fused: dict[str, tuple[torch.nn.Module, ResidualSlot] | None] = {}  # block name -> (block, slot)
    replayed: list[str] = []  # blocks with toma hooks besides those of fused
    for target in targets:
        stack, inside, _ = target.name.rpartition(".transformer_blocks.")
        if not inside:  # a block outside a transformer stack: it reorders its own tokens
            stack = target.name.rsplit(".", 1)[0]
            states.setdefault(stack, TileState(cache, stack))
        elif stack not in states:
            states[stack] = TileState(cache, stack)
            modules, blocks = _order_stack(model, stack, cache, target.downsample, states[stack], ledger)
            hooked += modules
            replayed += blocks
        # only self-attention has keys among the merged tokens to weight by their mass
        bias = (
            cache.config.proportional_attention is not False
            and getattr(target.module, "is_cross_attention", None) is False
        )
        block_name, _, sub = target.name.rpartition(".")
        if block_name not in fused:
            parent = _fusable_parent(model, block_name, sub, target.module)
            fused[block_name] = None if parent is None else (parent, ResidualSlot())
        slot = None if fused[block_name] is None else fused[block_name][1]
        block = chunkable_block(model, target, "ff") if sub == "ff" else None
        calls = ()
        if block is not None:
            calls = (Chunked(take_over_chunking(block, ledger)),)
            hooked.append(block)
        hook = MergeHook(cache, target.downsample, states[stack], SITES[sub], bias=bias, residual=slot, calls=calls)
        ledger.hook(target.module, hook, HOOK_NAME)
        hooked.append(target.module)
    # registered last, so innermost: inside the blocks' tile-order and chunking hooks
    for block, slot in filter(None, fused.values()):
        ledger.hook(block, FusedResidualHook(slot), RESIDUAL_HOOK_NAME)
        hooked.append(block)
    return hooked + attach_replay(model, [*fused, *replayed], cache, ledger)


def _order_stack(
    model: torch.nn.Module, stack: str, cache: PlanCache, downsample: int, state: TileState, ledger: Any
) -> tuple[list[torch.nn.Module], list[str]]:
    """Register the hooks that run a transformer stack in tile order: on the stack itself
    where it flattens its image (:func:`image_stack`), else on its first and last blocks.
    Returns the hooked modules and the names of the hooked blocks."""
    owner = model.get_submodule(stack)
    if image_stack(owner):
        ledger.hook(owner, _ImageOrderHook(cache, downsample, state), HOOK_NAME)
        return [owner], []
    blocks = model.get_submodule(f"{stack}.transformer_blocks")
    first, last = blocks[0], blocks[len(blocks) - 1]
    hooked, names = [], []
    for i, block in dict.fromkeys(((0, first), (len(blocks) - 1, last))):
        ledger.hook(block, _TileOrderHook(cache, downsample, state, block is first, block is last), HOOK_NAME)
        hooked.append(block)
        names.append(f"{stack}.transformer_blocks.{i}")
    return hooked, names


def _fusable_parent(model: torch.nn.Module, name: str, sub: str, module: torch.nn.Module) -> torch.nn.Module | None:
    """The module called ``name`` if it holds ``module`` as ``sub`` and can run toma's
    fused-residual forward, else None."""
    try:
        block = model.get_submodule(name)
    except AttributeError:
        return None
    return block if getattr(block, sub, None) is module and fusable(block) else None


class UNetStepHook(Hook):
    """Records the latent grid and the timestep at each UNet forward (in ``cache``).

    Also serves the ToDo baseline, which needs the grid of each merged level.
    """

    def __init__(self, cache: PlanCache) -> None:
        super().__init__()
        self.cache = cache

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        sample = args[0] if args else kwargs["sample"]
        timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        self.cache.begin_forward(tuple(sample.shape[-2:]), step_timestep(self.cache, timestep))
        return args, kwargs


class _TileOrderHook(Hook):
    """Puts a transformer stack's tokens in tile order at its first block, back at its last.

    Everything in a ``BasicTransformerBlock`` but self-attention treats tokens one by one,
    and self-attention (with no positional encoding) does not depend on their order; so
    the stack may run in tile order, where merging and unmerging are plain matmuls on
    views. Two copies per stack replace two per merged sub-module.
    """

    def __init__(self, cache: PlanCache, downsample: int, state: TileState, first: bool, last: bool) -> None:
        super().__init__()
        self.cache = cache
        self.downsample = downsample
        self.state = state
        self.first = first
        self.last = last

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if not self.first:
            return args, kwargs
        self.state.layout = None
        found = _tokens(self.cache, self.downsample, args, kwargs)
        if found is None:
            return args, kwargs
        x, grid = found
        layout = self.cache.tile_order_layout(grid, x.device)
        if layout is None or x.shape[1] != layout.num_tokens:
            return args, kwargs
        self.state.layout = layout
        return with_hidden_states(args, kwargs, self.state.convert(x, enter=True))

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        # The layout stays set until the stack's next call: a checkpointed block recomputed in
        # the backward pass must merge its tokens in the order its forward did.
        return self.state.convert(output, enter=False) if self.last else output


# Transformer2DModel's methods that flatten its image into tokens and back, and their parameters
_IMAGE_METHODS = _private.IMAGE_METHODS


def image_stack(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a diffusers ``Transformer2DModel`` on continuous (latent image)
    inputs whose flattening :class:`_ImageOrderHook` can take over."""
    base = next((cls for cls in type(module).__mro__ if cls.__name__ == "Transformer2DModel"), None)
    if base is None or type(module).forward is not base.forward or not getattr(module, "is_input_continuous", False):
        return False
    if not all(hasattr(module, name) for name in ("norm", "proj_in", "proj_out", "use_linear_projection")):
        return False
    for name, params in _IMAGE_METHODS.items():
        method = getattr(type(module), name, None)
        if method is None or method is not getattr(base, name, None):  # a subclass's own: leave it
            return False
        try:
            if tuple(inspect.signature(method).parameters) != params:
                return False
        except (TypeError, ValueError):
            return False
    return True


class _ImageOrderHook(Hook):
    """On a ``Transformer2DModel``: flattens its image straight into tile order, and back.

    The model flattens its ``(B, C, H, W)`` image into raster tokens (a view where it can)
    and unflattens them with a copy; :class:`_TileOrderHook` then adds a reordering copy at
    each end. Here the model's own methods for those two steps are replaced, on the
    instance, by ones that write and read tile order in one copy each (the same maths on
    the same values otherwise): one copy per stack fewer, two where flattening copied. A
    call left in raster order (an attention mask over the raster sequence, a grid other
    than the level's, a step that merges nothing) runs the model's methods.
    """

    def __init__(self, cache: PlanCache, downsample: int, state: TileState) -> None:
        super().__init__()
        self.cache = cache
        self.downsample = downsample
        self.state = state
        self._pending: TileLayout | None = None  # the layout this call's flattening will use

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        setattr(module, _private.FLATTEN_IMAGE, functools.partial(self._flatten, module))
        setattr(module, _private.UNFLATTEN_IMAGE, functools.partial(self._unflatten, module))
        return module

    def deinitalize_hook(self, module: torch.nn.Module) -> torch.nn.Module:  # diffusers' spelling
        for name in _IMAGE_METHODS:
            module.__dict__.pop(name, None)
        return module

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        self._pending = None
        x = hidden_states_of(args, kwargs)
        mask = kwargs.get("attention_mask", args[6] if len(args) > 6 else None)
        grid = self.cache.grid_at(self.downsample)
        if (
            isinstance(x, torch.Tensor)
            and x.ndim == 4
            and mask is None
            and grid is not None
            and tuple(x.shape[-2:]) == grid
        ):
            self._pending = self.cache.tile_order_layout(grid, x.device)
        return args, kwargs

    def _flatten(self, module: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Copied from diffusers 0.42 ``Transformer2DModel._operate_on_continuous_inputs``.
        Modifications: the ``(B, C, H, W)`` to ``(B, N, C)`` permute-and-reshape writes tile
        order (:func:`~toma.core.tiling.image_to_tile_order`) instead of raster order;
        without a layout this call, the model's own method runs."""
        layout, self._pending = self._pending, None
        # set on every call, and left set after it: blocks recomputed in backward read it
        self.state.layout = layout
        if layout is None:
            return getattr(type(module), _private.FLATTEN_IMAGE)(module, hidden_states)
        x = module.norm(hidden_states)
        if not module.use_linear_projection:
            x = module.proj_in(x)
        inner_dim = x.shape[1]
        with profiled("toma::merge"):  # reordering is part of what merging costs
            x = image_to_tile_order(x, layout)
        return (module.proj_in(x) if module.use_linear_projection else x), inner_dim

    def _unflatten(
        self,
        module: torch.nn.Module,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        batch_size: int,
        height: int,
        width: int,
        inner_dim: int,
    ) -> torch.Tensor:
        """Copied from diffusers 0.42 ``Transformer2DModel._get_output_for_continuous_inputs``.
        Modifications: the ``(B, N, C)`` to ``(B, C, H, W)`` reshape-and-permute reads tile
        order (:func:`~toma.core.tiling.tile_order_to_image`); without a layout, the model's
        own method runs."""
        layout = self.state.layout
        if layout is None:
            return getattr(type(module), _private.UNFLATTEN_IMAGE)(
                module,
                hidden_states=hidden_states,
                residual=residual,
                batch_size=batch_size,
                height=height,
                width=width,
                inner_dim=inner_dim,
            )
        x = module.proj_out(hidden_states) if module.use_linear_projection else hidden_states
        with profiled("toma::unmerge"):
            x = tile_order_to_image(x, layout)
        return (x if module.use_linear_projection else module.proj_out(x)) + residual


def _tokens(
    cache: PlanCache, downsample: int, args: tuple, kwargs: dict
) -> tuple[torch.Tensor, tuple[int, int]] | None:
    """A call's hidden states ``(B, N, C)`` and the token grid of its level, or None when the
    call is to be left alone: no such tensor, no grid yet, or an attention mask, which is
    laid out over the raster sequence and would fit neither a merged nor a reordered one."""
    x = hidden_states_of(args, kwargs)
    grid = cache.grid_at(downsample)
    if x is None or x.ndim != 3 or grid is None or kwargs.get("attention_mask") is not None:
        return None
    return x, grid


def tile_frames(config: ToMAConfig) -> int:
    """UNets tile images: tiles span one frame."""
    return 1
