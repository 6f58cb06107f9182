"""Adapter for ``FluxTransformer2DModel`` (Flux.1 dev/schnell and relatives).

Only image tokens are merged; the text tokens always pass at full length. A merged token
takes the rotary position of its destination.

* Double-stream blocks: the attention processor is swapped for one that merges the image
  stream before the Q/K/V projections and unmerges it after the output projection (rows of
  the unmerge matrix sum to 1, so unmerging after the affine projection equals unmerging
  before it, on fewer tokens). The MLPs run at full resolution.
* Single-stream blocks: a hook on the block's norm merges the image part of its output, so
  that attention and the parallel MLP both run on ``[text; merged image]``; the processor
  applies per-batch rotary embeddings; a hook on ``proj_out`` unmerges the image part
  before the gated residual.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, FluxTransformer2DModel

from toma.adapters.base import HOOK_NAME, Hook, Patched, Skipped, registry_of, step_timestep
from toma.config import ToMAConfig
from toma.core.plan import Plan, PlanCache, profiled
from toma.core.tiling import TileLayout, raster_order, tile_order

DEFAULT_SKIP = 5  # the authors leave the first 5 double and 5 single blocks unmerged


def matches(model: torch.nn.Module) -> bool:
    """Whether the model is a Flux transformer."""
    return isinstance(model, FluxTransformer2DModel)


def default_blocks(count: int) -> tuple[int, ...]:
    """Blocks merged by default: all but the first ``min(5, count // 2)``."""
    return tuple(range(min(DEFAULT_SKIP, count // 2), count))


def find_targets(model: torch.nn.Module, config: ToMAConfig) -> tuple[list[Patched], list[Skipped]]:
    """List the blocks to merge (and those skipped, with why). Touches nothing."""
    targets: list[Patched] = []
    skipped: list[Skipped] = []
    streams = [
        ("transformer_blocks", "flux_double_blocks", config.flux_double_blocks, "double"),
        ("single_transformer_blocks", "flux_single_blocks", config.flux_single_blocks, "single"),
    ]
    for attr, option, chosen, stream in streams:
        blocks = getattr(model, attr)
        if chosen is None:
            chosen = default_blocks(len(blocks))
        bad = [i for i in chosen if i >= len(blocks)]
        if bad:
            raise ValueError(f"{option} must hold indices in [0, {len(blocks) - 1}]; got {bad}")
        for i, block in enumerate(blocks):
            name = f"{attr}.{i}"
            if i not in chosen:
                skipped.append(Skipped(name, f"not in {option}"))
            elif type(_original_processor(block)) is not FluxAttnProcessor:
                kind = type(_original_processor(block)).__name__
                skipped.append(Skipped(name, f"attention processor {kind} is not FluxAttnProcessor"))
            else:
                targets.append(Patched(name, block, f"{stream}-stream"))
    return targets, skipped


def attach(model: torch.nn.Module, targets: list[Patched], cache: PlanCache) -> list[torch.nn.Module]:
    """Register hooks and processors; returns every module that got a hook (for removal)."""
    order = _ImageOrder()
    hooks: list[tuple[torch.nn.Module, Hook]] = [
        (model, _FluxStepHook(cache, order)),
        (model.x_embedder, _Reorder(order, tile_order, "merge")),
        (model.pos_embed, _RotaryToTileOrder(order)),
        (model.norm_out, _Reorder(order, raster_order, "unmerge")),
    ]
    for target in targets:
        block = target.module
        if target.where.startswith("double"):
            block.attn.set_processor(_MergedFluxProcessor(cache, block.attn.processor, None, order))
            continue
        state = _SingleBlockState()
        block.attn.set_processor(_MergedFluxProcessor(cache, block.attn.processor, state, order))
        hooks += [(block.norm, _SingleMergeHook(cache, state, order)), (block.proj_out, _SingleUnmergeHook(state))]
    for module, hook in hooks:
        registry_of(module).register_hook(hook, HOOK_NAME)
    return [module for module, _ in hooks]


def detach(targets: list[Patched]) -> None:
    """Put back the attention processors that :func:`attach` replaced."""
    for target in targets:
        processor = target.module.attn.processor
        if isinstance(processor, _MergedFluxProcessor):
            target.module.attn.set_processor(processor.original)


def _original_processor(block: torch.nn.Module) -> Any:
    """The block's attention processor, seen through a ToMA processor left by an earlier apply."""
    processor = block.attn.processor
    return processor.original if isinstance(processor, _MergedFluxProcessor) else processor


def image_grid(img_ids: torch.Tensor) -> tuple[int, int]:
    """Token grid ``(h, w)`` of raster-ordered Flux image ids ``(N, 3)`` (or ``(B, N, 3)``)."""
    ids = img_ids[0] if img_ids.ndim == 3 else img_ids
    first, last = ids[0, 1:].tolist(), ids[-1, 1:].tolist()
    return int(last[0] - first[0]) + 1, int(last[1] - first[1]) + 1


class _ImageOrder:
    """The tile layout the image tokens of the running forward are in, or None (raster).

    Every Flux block is indifferent to the order of the image tokens as long as their
    rotary positions follow them, so a forward may run in tile order from the patch
    embedding to the final norm; merging and unmerging are then matmuls on views, with two
    reorderings per forward instead of two per merged block.
    """

    def __init__(self) -> None:
        self.layout: TileLayout | None = None


class _FluxStepHook(Hook):
    """Records the image token grid (from ``img_ids``) and the timestep at each forward,
    and decides whether the forward runs in tile order."""

    def __init__(self, cache: PlanCache, order: _ImageOrder) -> None:
        super().__init__()
        self.cache = cache
        self.order = order
        self._known: tuple[torch.Tensor, int, tuple[int, int]] | None = None  # (ids, version, grid)

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        hidden = args[0] if args else kwargs["hidden_states"]
        img_ids = kwargs.get("img_ids")
        grid = self._grid(img_ids) if img_ids is not None else (0, 0)
        # grids we cannot read (extra conditioning tokens, odd ids) simply get no merging
        if grid[0] * grid[1] != hidden.shape[1]:
            grid = (0, 0)
        self.cache.begin_forward(grid, step_timestep(self.cache, kwargs.get("timestep")))
        # ControlNet residuals are added in raster order between blocks: stay in raster order
        controlled = any(kwargs.get(k) is not None for k in ("controlnet_block_samples", "controlnet_single_block_samples"))
        self.order.layout = None if controlled or grid[0] * grid[1] == 0 else self.cache.tile_order_layout(grid)
        return args, kwargs

    def _grid(self, img_ids: torch.Tensor) -> tuple[int, int]:
        # Reading the ids waits for the GPU; pipelines pass the same ids tensor at every
        # step, so they are read once per denoising run rather than once per forward.
        known = self._known
        if known is not None and known[0] is img_ids and known[1] == _version(img_ids):
            return known[2]
        grid = image_grid(img_ids)
        self._known = (img_ids, _version(img_ids), grid)
        return grid


def _version(t: torch.Tensor) -> int:
    """In-place modification count of ``t``; -1 for inference tensors, which keep none."""
    return -1 if t.is_inference() else t._version


class _Reorder(Hook):
    """Reorders a module's image-token output ``(B, N, C)`` when the forward runs in tile order.

    On the patch embedding with ``tile_order`` (counted as merging), on the final norm with
    ``raster_order`` (counted as unmerging).
    """

    def __init__(self, order: _ImageOrder, reorder: Callable[[torch.Tensor, TileLayout], torch.Tensor], part: str) -> None:
        super().__init__()
        self.order = order
        self.reorder = reorder
        self.part = part

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        layout = self.order.layout
        if layout is None:
            return output
        with profiled(f"toma::{self.part}"):  # reordering is part of what merging costs
            return self.reorder(output, layout)


class _RotaryToTileOrder(Hook):
    """On the rotary embedding: the image rows of the ``(text + N, D)`` tables to tile order."""

    def __init__(self, order: _ImageOrder) -> None:
        super().__init__()
        self.order = order
        self._rows: dict[tuple[int, TileLayout, torch.device], torch.Tensor] = {}

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        layout = self.order.layout
        if layout is None:
            return output
        table = output[0]
        text = table.shape[0] - layout.num_tokens
        key = (text, layout, table.device)
        rows = self._rows.get(key)
        if rows is None:  # built on the device once per grid: no host-to-device copy per step
            image = tile_order(torch.arange(layout.num_tokens, device=table.device)[None, :, None], layout).flatten()
            rows = self._rows[key] = torch.cat([torch.arange(text, device=table.device), image + text])
        with profiled("toma::merge"):
            return tuple(t.index_select(0, rows) for t in output)


class _SingleBlockState:
    """The plan one single-stream block is using between its norm and its ``proj_out``."""

    def __init__(self) -> None:
        self.plan: Plan | None = None
        self.text_len = 0
        self.tiled = False


class _SingleMergeHook(Hook):
    """On the single-stream norm: merges the image part of the normalised tokens."""

    def __init__(self, cache: PlanCache, state: _SingleBlockState, order: _ImageOrder) -> None:
        super().__init__()
        self.cache = cache
        self.state = state
        self.order = order

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        normed, gate = output
        grid = self.cache.grid_at(1)
        self.state.plan = None
        if grid is None or grid[0] * grid[1] == 0 or normed.shape[1] <= grid[0] * grid[1]:
            return output
        text_len = normed.shape[1] - grid[0] * grid[1]
        tiled = self.order.layout is not None
        plan = self.cache.get(normed[:, text_len:], grid, group="single", tiled=tiled)
        if plan is None:
            return output
        self.state.plan, self.state.text_len, self.state.tiled = plan, text_len, tiled
        merged = torch.cat([normed[:, :text_len], plan.merge(normed[:, text_len:], tiled)], dim=1)
        return merged, gate


class _SingleUnmergeHook(Hook):
    """On the single-stream ``proj_out``: unmerges the image part of its output."""

    def __init__(self, state: _SingleBlockState) -> None:
        super().__init__()
        self.state = state

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        plan, self.state.plan = self.state.plan, None
        if plan is None:
            return output
        t = self.state.text_len
        return torch.cat([output[:, :t], plan.unmerge(output[:, t:], self.state.tiled)], dim=1)


class _MergedFluxProcessor:
    """Flux attention on merged image tokens, with per-batch rotary embeddings.

    Falls back to the original processor whenever no plan applies (ratio 0, unknown grid,
    an attention mask).
    """

    def __init__(self, cache: PlanCache, original: Any, single: _SingleBlockState | None, order: _ImageOrder) -> None:
        self.cache = cache
        self.original = original
        self.single = single
        self.order = order

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        args = (attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        tiled = self.order.layout is not None
        if self.single is not None:
            plan, text_len = self.single.plan, self.single.text_len
        else:
            grid = self.cache.grid_at(1)
            plan = None if grid is None else self.cache.get(hidden_states, grid, group="double", tiled=tiled)
            text_len = 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        if plan is None or attention_mask is not None or image_rotary_emb is None:
            if self.single is not None and plan is not None:
                raise RuntimeError("ToMA merged a single-stream block whose attention cannot run merged")
            return self.original(*args)
        if self.single is None:
            hidden_states = plan.merge(hidden_states, tiled)
        query, key, value = _projections(attn, hidden_states, "to_qkv", ("to_q", "to_k", "to_v"))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:
            eq, ek, ev = _projections(attn, encoder_hidden_states, "to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj"))
            query = torch.cat([attn.norm_added_q(eq), query], dim=1)
            key = torch.cat([attn.norm_added_k(ek), key], dim=1)
            value = torch.cat([ev, value], dim=1)
        # Built once per plan, not per block: every block of a forward gets the same rotary
        # tables (positions come from the ids, fixed through a denoising run).
        cos, sin = plan.memo(
            f"flux_rotary_{text_len}_{tiled}", lambda: tuple(_merged_rotary(t, text_len, plan, tiled) for t in image_rotary_emb)
        )
        query, key = _apply_rotary(query, cos, sin), _apply_rotary(key, cos, sin)
        mask = None
        if self.cache.config.proportional_attention:  # off unless asked for (None is off for Flux)
            mask = plan.memo(f"flux_bias_{text_len}", lambda: _key_bias(plan, text_len, query.dtype))
        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=mask,
            backend=getattr(self.original, "_attention_backend", None),
            parallel_config=getattr(self.original, "_parallel_config", None),
        )
        out = out.flatten(2, 3).to(query.dtype)
        if self.single is not None:
            return out  # proj_out's hook unmerges after the block's own projection
        text, image = out[:, :text_len], out[:, text_len:]
        image = plan.unmerge(attn.to_out[1](attn.to_out[0](image.contiguous())), tiled)
        return image, attn.to_add_out(text.contiguous())


def _projections(attn: torch.nn.Module, x: torch.Tensor, fused: str, separate: tuple[str, str, str]) -> list:
    """Q, K, V as ``(B, S, heads, head_dim)``, from fused or separate projections."""
    if getattr(attn, "fused_projections", False) and hasattr(attn, fused):
        qkv = getattr(attn, fused)(x).chunk(3, dim=-1)
    else:
        qkv = [getattr(attn, name)(x) for name in separate]
    return [t.unflatten(-1, (-1, attn.head_dim)) for t in qkv]


def _key_bias(plan: Plan, text_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Proportional-attention mask ``(Bp, 1, 1, text + K)``: 0 on text keys, log masses on image keys."""
    text_bias = plan.log_mass.new_zeros(plan.log_mass.shape[0], text_len)
    return torch.cat([text_bias, plan.log_mass], dim=1)[:, None, None, :].to(dtype)


def _merged_rotary(table: torch.Tensor, text_len: int, plan: Plan, tiled: bool = False) -> torch.Tensor:
    """Rotary table ``(text + N, D)`` for ``[text; merged image]``: ``(Bp, text + K, D)``.

    The image rows of ``table`` are in raster order, or in tile order when ``tiled``.
    """
    image = table[text_len:][plan.dest_slots if tiled else plan.dest_tokens]
    text = table[:text_len].expand(image.shape[0], -1, -1)
    return torch.cat([text, image], dim=1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Flux's interleaved rotary embedding with a per-batch table.

    Args:
        x: ``(B, S, heads, D)``.
        cos, sin: ``(Bp, S, D)`` with ``Bp`` 1 or B.
    """
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos[:, :, None, :] + rotated.float() * sin[:, :, None, :]).to(x.dtype)


def tile_frames(config: ToMAConfig) -> int:
    """Flux tiles images: tiles span one frame."""
    return 1
