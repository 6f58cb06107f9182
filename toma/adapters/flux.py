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

import math
import warnings
from dataclasses import replace
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, FluxTransformer2DModel

from toma.adapters.base import Hook, Patched, Skipped
from toma.adapters.engine import FamilySpec, Grid, TileState, chosen_blocks, order_hooks, register, skip_first
from toma.config import ToMAConfig
from toma.core.plan import Plan, PlanCache

DEFAULT_SKIP = 5  # the authors leave the first 5 double and 5 single blocks unmerged


def matches(model: torch.nn.Module) -> bool:
    """Whether the model is a Flux transformer."""
    return isinstance(model, FluxTransformer2DModel)


def default_blocks(count: int) -> tuple[int, ...]:
    """Blocks merged by default: all but the first ``min(5, count // 2)``."""
    return skip_first(DEFAULT_SKIP)("", count)


def find_targets(model: torch.nn.Module, config: ToMAConfig) -> tuple[list[Patched], list[Skipped]]:
    """List the blocks to merge (and those skipped, with why). Touches nothing."""
    if config.merge_mlp or config.merge_crossattn:
        raise ValueError(
            "Flux merges the attention of its double-stream blocks, and the attention and MLP of its "
            "single-stream blocks together (they share one input), at ratio (or attn_ratio); it has no "
            "cross-attention: merge_mlp, merge_crossattn and their ratios do not apply to Flux"
        )
    aliases = {"transformer_blocks": config.flux_double_blocks, "single_transformer_blocks": config.flux_single_blocks}
    if config.blocks is not None and any(v is not None for v in aliases.values()):
        raise ValueError("give blocks or flux_double_blocks/flux_single_blocks, not both (they say the same)")
    if config.blocks is None:
        counts = {stack: len(getattr(model, stack)) for stack in aliases}
        for (stack, chosen), option in zip(aliases.items(), ("flux_double_blocks", "flux_single_blocks")):
            bad = [i for i in chosen or () if i >= counts[stack]]
            if bad:
                raise ValueError(f"{option} must hold indices in [0, {counts[stack] - 1}]; got {bad}")
        chosen = {stack: default_blocks(counts[stack]) if v is None else v for stack, v in aliases.items()}
        config = replace(config, blocks=chosen)
    targets: list[Patched] = []
    skipped: list[Skipped] = []
    for stack, indices in chosen_blocks(SPEC, model, config).items():
        stream = "double" if stack == "transformer_blocks" else "single"
        for i, block in enumerate(getattr(model, stack)):
            name = f"{stack}.{i}"
            if i not in indices:
                skipped.append(Skipped(name, "not among the merged blocks"))
            elif type(_original_processor(block)) is not FluxAttnProcessor:
                kind = type(_original_processor(block)).__name__
                skipped.append(Skipped(name, f"attention processor {kind} is not FluxAttnProcessor"))
            else:
                targets.append(Patched(name, block, f"{stream}-stream"))
    return targets, skipped


def attach(model: torch.nn.Module, targets: list[Patched], cache: PlanCache) -> list[torch.nn.Module]:
    """Register hooks and processors; returns every module that got a hook (for removal)."""
    order, hooks = order_hooks(replace(SPEC, grid=IdsGrid()), model, cache)
    for target in targets:
        block = target.module
        state = _SingleBlockState() if target.where.startswith("single") else None
        processor = _MergedFluxProcessor(cache, block.attn.processor, state, order)
        block.attn.set_processor(processor)
        hooks.append((block, _ProcessorWatch(target.name, processor, state)))
        if state is not None:
            hooks += [(block.norm, _SingleMergeHook(cache, state, order)), (block.proj_out, _SingleUnmergeHook(state))]
    return register(hooks)


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
    """Token grid ``(h, w)`` of raster-ordered Flux image ids ``(N, 3)`` (or ``(B, N, 3)``;
    Flux.2's have a fourth column), whose columns 1 and 2 are the row and column."""
    ids = img_ids[0] if img_ids.ndim == 3 else img_ids
    first, last = ids[0, 1:].tolist(), ids[-1, 1:].tolist()
    return int(last[0] - first[0]) + 1, int(last[1] - first[1]) + 1


class IdsGrid:
    """Reads the image token grid from ``img_ids`` (Flux.1, Flux.2); one per patched model.

    Reading the ids waits for the GPU; pipelines pass the same ids tensor at every step, so
    they are read once per denoising run rather than once per forward.
    """

    def __init__(self) -> None:
        self._known: tuple[torch.Tensor, int, tuple[int, int]] | None = None  # (ids, version, grid)

    def __call__(self, model: torch.nn.Module, call: dict) -> Grid | str | None:
        hidden, img_ids = call.get("hidden_states"), call.get("img_ids")
        if hidden is None or img_ids is None:
            return "a Flux call without img_ids gives no token grid"
        if (call.get("joint_attention_kwargs") or {}).get("attention_mask") is not None:
            return "joint_attention_kwargs has an attention_mask, laid out over the unmerged sequence"
        known = self._known
        if known is not None and known[0] is img_ids and known[1] == _version(img_ids):
            grid = known[2]
        else:
            grid = image_grid(img_ids)
            self._known = (img_ids, _version(img_ids), grid)
        # grids we cannot read (extra conditioning tokens, odd ids) simply get no merging
        return (1, *grid) if grid[0] * grid[1] == hidden.shape[1] else None


def _version(t: torch.Tensor) -> int:
    """In-place modification count of ``t``; -1 for inference tensors, which keep none."""
    return -1 if t.is_inference() else t._version


SPEC = FamilySpec(
    name="flux",
    classes=("FluxTransformer2DModel",),
    stacks=("transformer_blocks", "single_transformer_blocks"),
    sites=lambda stack, block: [],  # merged by the processor and hooks below, not by engine sites
    grid=IdsGrid,  # replaced by a fresh reader per patched model
    enter=("output", "x_embedder"),
    leave="norm_out",
    rope=("pos_embed", 0),
    # ControlNet residuals are added in raster order between blocks
    raster_kwargs=("controlnet_block_samples", "controlnet_single_block_samples"),
)


class _SingleBlockState:
    """The plan one single-stream block is using between its norm and its ``proj_out``."""

    def __init__(self) -> None:
        self.plan: Plan | None = None
        self.text_len = 0
        self.tiled = False
        self.active = True  # False once the block's attention processor was replaced


class _ProcessorWatch(Hook):
    """On a merged block: notices when its attention processor was replaced after
    :func:`toma.apply_toma` (``set_attn_processor``). The block then runs unmerged with the
    new processor, and a warning says so once."""

    def __init__(self, name: str, processor: Any, state: _SingleBlockState | None) -> None:
        self.name = name
        self.processor = processor
        self.state = state
        self._warned = False

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        active = module.attn.processor is self.processor
        if self.state is not None:
            self.state.active = active
        if not active and not self._warned:
            self._warned = True
            warnings.warn(
                f"ToMA: the attention processor of {self.name} was replaced after apply_toma; the block "
                "runs unmerged. Call toma.apply_toma again to merge with the new processor.",
                stacklevel=3,
            )
        return args, kwargs


class _SingleMergeHook(Hook):
    """On the single-stream norm: merges the image part of the normalised tokens."""

    def __init__(self, cache: PlanCache, state: _SingleBlockState, order: TileState) -> None:
        super().__init__()
        self.cache = cache
        self.state = state
        self.order = order

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        normed, gate = output
        grid = self.cache.grid_at(1)
        self.state.plan = None
        if not self.state.active:
            return output
        tokens = 0 if grid is None else math.prod(grid)
        if tokens == 0 or normed.shape[1] <= tokens:
            return output
        text_len = normed.shape[1] - tokens
        tiled = self.order.layout is not None
        plan = self.cache.get(normed[:, text_len:], grid, group="single", tiled=tiled, ratio=self.cache.config.ratio_for("attn"))
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

    def __init__(self, cache: PlanCache, original: Any, single: _SingleBlockState | None, order: TileState) -> None:
        self.cache = cache
        self.original = original
        self.single = single
        self.order = order

    # set_attention_backend and context parallelism set these on every processor that has
    # them: they go to the original processor, which the merged path and the fallback share
    @property
    def _attention_backend(self) -> Any:
        return getattr(self.original, "_attention_backend", None)

    @_attention_backend.setter
    def _attention_backend(self, backend: Any) -> None:
        self.original._attention_backend = backend

    @property
    def _parallel_config(self) -> Any:
        return getattr(self.original, "_parallel_config", None)

    @_parallel_config.setter
    def _parallel_config(self, config: Any) -> None:
        self.original._parallel_config = config

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
            plan = None if grid is None else self.cache.get(hidden_states, grid, group="double", tiled=tiled,
                                                                 ratio=self.cache.config.ratio_for("attn"))
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
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
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
