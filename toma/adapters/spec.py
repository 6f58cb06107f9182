"""What a model family declares for the engine (:mod:`toma.adapters.engine`).

A :class:`FamilySpec` names a family's block stacks, the sub-modules of a block that merge
(:class:`Site`), how to read the token grid from the model's call, where its rotary tables
come from (:class:`Rotary`) and which modules bracket the token sequence. The helpers here
are the small pieces specs share (grids from latents, default blocks, table gathering,
mask layouts). Nothing here registers a hook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from toma.adapters.layouts import ALONE, CallRule, Fit, InMask, Layout, Span, ViaCall

if TYPE_CHECKING:
    from toma.adapters.base import Patched
    from toma.config import ToMAConfig

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
            the others pass unchanged (e.g. QwenImage's text table). An item may be a tuple
            nesting tables (JoyImage's ``((cos, sin), text)``): each tensor in it is gathered.
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

    Each attribute past ``part`` is an object of :mod:`toma.adapters.layouts` that the
    family picks, so that a family states its call's layout as data and the engine asks the
    object, never the family.

    Attributes:
        path: the sub-module's name inside the block (``"attn1"``, ``"ff"``).
        part: ``"attn"`` (self or joint attention), ``"cross"`` (queries of
            cross-attention) or ``"mlp"``: which of the config's ``merge_*`` switches it obeys.
        layout: where the image tokens sit in the call's hidden states
            (:data:`~toma.adapters.layouts.ALONE`, ``TEXT_FIRST``, ``IMAGE_FIRST``, ``SeqFirst``).
        rotary: where its call takes rotary tables, if it does.
        bias: how the key bias of proportional attention reaches its attention
            (:class:`~toma.adapters.layouts.InMask`, :class:`~toma.adapters.layouts.ViaCall`);
            None: it cannot take one.
        fit: how a mask of the model's own is fitted to the merged tokens
            (:class:`~toma.adapters.layouts.Fit`); None: a call with one runs unmerged.
        rules: one-family rewrites of the merged call (:class:`~toma.adapters.layouts.CallRule`).
        span: a merge from ``path``'s output to a later sub-module's
            (:class:`~toma.adapters.layouts.Span`); None: the merge wraps ``path``'s call.
        group: sites with the same group share one plan per step and grid (None: one group
            for every site of the family without one).
    """

    path: str
    part: str
    layout: Layout = ALONE
    rotary: Rotary | None = None
    bias: InMask | ViaCall | None = None
    fit: Fit | None = None
    rules: tuple[CallRule, ...] = ()
    span: Span | None = None
    group: str | None = None

    @property
    def takes_bias(self) -> bool:
        """Whether the site's processor can take the key bias (proportional attention)."""
        return self.bias is not None

    def __post_init__(self) -> None:
        if self.fit is not None and self.fit.slot is not None and (self.bias is not None or self.span is not None):
            raise ValueError("Site: a Fit with a slot of its own takes neither a bias nor a span")
        shared = self.rotary is not None and self.rotary.shared
        why = self.layout.refuses(bias=self.bias is not None, span=self.span is not None, shared_rotary=shared)
        if why is not None:
            raise ValueError(f"Site: {why}")

    def own_slot(self) -> tuple[str, int | None]:
        """``(keyword, position)`` of the mask the model itself passes to the call."""
        if self.fit is not None and self.fit.slot is not None:
            return self.fit.slot
        if self.bias is not None and self.bias.slot is not None:
            return self.bias.slot
        return ("attention_mask", None)


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
            output is the ``(B, N, C)`` tokens; ``("grid", path)`` for a patch embedding whose
            output is the channel-first grid ``(B, C, t, h, w)`` that the forward flattens
            with ``flatten(2).transpose(1, 2)`` and hands to the blocks unchanged (Wan's
            ``patch_embedding``); or ``("block", "")`` for the first block's
            ``hidden_states`` input. Prefer a module before the blocks: a cache around them
            (FirstBlockCache's hook on the first block, cache-dit's first blocks) compares
            the first blocks' output with their input, which must be in the same order.
        leave: a module after the blocks whose first input (``hidden_states``) is the
            ``(B, N, C)`` tokens; they go back to raster order there.
        grid_tokens: the tokens come out of the ``enter`` module (an ``("output", path)``)
            and go into the ``leave`` module as a channel-last grid ``(B, t, h, w, C)``, which
            the forward flattens into the blocks' sequence and reshapes back with plain
            reshapes (Kandinsky 5's ``fractal_flatten`` and ``fractal_unflatten``): they are
            put in the blocks' order, and back, as that sequence. Everything between the two
            then sees the blocks' order, block caches too (MagCache compares and replays
            residuals around the blocks, and its skipped steps never call the last block).
        rope: path of the module whose output tuple holds the rotary tables, and the
            sequence dimension of each table (their image rows are put in tile order), or
            None. A family with several such modules over the image tokens (LTX-2's
            self-attention tables and its audio-video cross-attention's) gives a tuple of
            such pairs (see :attr:`rope_modules`). A negative dimension counts from the end,
            for modules whose layout depends on the config (``(B, N, D)`` or ``(B, H, N, D)``:
            -2 in both).
        rope_image_first: the ``rope`` modules' tables hold the image's rows first, then the
            text's (HiDream), rather than the text's first.
        rope_items: which items of that tuple hold image rows (None: all of them; the same
            for every module of ``rope``); with ``block_rope``, of the blocks' table tuple
            (an item may nest tensors).
        block_rope: ``(keyword, position, sequence dimension)`` of the rotary tables every
            block of the stacks takes, for families whose forward makes them with no module
            (a method, JoyImage's): at each block's call their image rows are put in the
            blocks' order (tile order, conditioning tokens first), merged or not; None if
            there are none or ``rope`` reorders them.
        position_inputs: forward arguments holding one position row per image token,
            ``(N, d)`` or ``(B, N, d)`` (Flux.2's ``img_ids``), put in tile order at the call
            when tokens are, so that tables computed from them follow the tokens. With
            ``packed``, rows over the whole packed sequence, ``(S,)``, ``(S, d)`` or
            ``(B, S, d)``, whose last ``N`` are the image's (its per-row tags too).
        packed: the sequence that enters the blocks and leaves them is ``[prefix; image]``
            (a packed single stream built from the model's inputs: MiniMax H3, Ideogram 4):
            its last ``N`` tokens are the image's and are the ones put in tile order at
            ``enter`` and back at ``leave``; the prefix (text, other modalities) stays where
            it is, and so do its rows of ``position_inputs``.
        spread: for a ``packed`` family under context parallelism, where diffusers splits the
            packed sequence itself: ``(model, call, order) -> replacements``, the call's
            arguments that lay out the packed rows, permuted so that its row ``i`` is the
            model's row ``order[i]`` (``order`` from
            :func:`~toma.adapters.parallel.spread_order`: each shard gets an equal part of
            the prefix, then a run of the image). The packed sequence's length is read off
            the call by ``spread_length``. None: refused under context parallelism.
        spread_length: ``(call) -> int``, the packed sequence's rows, for ``spread``.
        raster_kwargs: forward keywords that add raster-ordered residuals between blocks;
            a call that passes one runs in raster order.
        tile_order_ok: optional check of the model and its forward's named arguments; False
            keeps raster order (e.g. per-token modulation laid out over the raster sequence).
        conditioning_tokens: the model's ``(B, S, C)`` image tokens may be those of the
            ``grid`` followed by conditioning images' (Flux Kontext, FLUX.2 references,
            Qwen-Image-Edit): those pass whole, like text; between the modules that bracket
            the blocks they lead the sequence, so that every site sees them before the
            image tokens it merges. True counts them from ``hidden_states`` ``(B, S, C)``;
            a function ``(model, call) -> int`` counts them from the call's named arguments
            where ``hidden_states`` are latents (JoyImage's reference frames).
        timestep: reads the call's denoising timestep from its named arguments, as a value
            that falls over a run (step windows and plans kept across steps count steps by
            it); None: the ``timestep`` argument. Z-Image's ``t`` rises (``1 - sigma``): its
            reader negates it.
        default_blocks: the block indices merged by default in each stack, given the
            stack name and its length.
        video: whether tiles span frames by default (``tile_frames``).
        reference: ``(rows, columns)`` of a frame's tokens at the family's default
            resolution (its pipeline's), to which ``tile_size="auto"`` scales tiles; None:
            ``"auto"`` keeps 4x4 tiles.
    """

    name: str
    classes: tuple[str, ...]
    stacks: tuple[str, ...]
    sites: Callable[[str, torch.nn.Module], list[Site]]
    grid: GridReader
    enter: tuple[str, str]
    leave: str
    grid_tokens: bool = False
    rope: tuple[str, int] | tuple[tuple[str, int], ...] | None = None
    rope_image_first: bool = False
    rope_items: tuple[int, ...] | None = None
    block_rope: tuple[str, int | None, int] | None = None
    position_inputs: tuple[str, ...] = ()
    packed: bool = False
    spread: Callable[[torch.nn.Module, dict, torch.Tensor], dict] | None = None
    spread_length: Callable[[dict], int] | None = None
    raster_kwargs: tuple[str, ...] = ()
    tile_order_ok: Callable[[torch.nn.Module, dict], bool] | None = None
    conditioning_tokens: bool | Callable[[torch.nn.Module, dict], int] = False
    timestep: Callable[[dict], Any] | None = None
    default_blocks: Callable[[str, int], tuple[int, ...]] = lambda stack, n: tuple(range(n))
    video: bool = False
    reference: tuple[int, int] | None = None

    @property
    def rope_modules(self) -> tuple[tuple[str, int], ...]:
        """``rope`` as pairs ``(path, sequence dimension)``, one per rotary module (none when None)."""
        if self.rope is None:
            return ()
        return (self.rope,) if isinstance(self.rope[0], str) else tuple(self.rope)

    def matches(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` is (a subclass of) one of this family's classes."""
        return any(cls.__name__ in self.classes for cls in type(model).__mro__)


class Quirks:
    """A family's own steps around the engine's, for what a :class:`FamilySpec` cannot
    state as data: Flux.1's block aliases, Lumina 2's per-sample roll, Wan-Animate's tiles
    of one frame.

    A family module that needs one declares ``QUIRKS``, an instance of a subclass, beside
    its ``SPEC``; the registry (:func:`toma.adapters.adapter_for`) hands both to the
    engine's adapter, which calls each method at its step. So the family's code stays in
    its own file and imports nothing of the engine. Every default changes nothing. A family
    derived from another's ``SPEC`` does not inherit its quirks.
    """

    def placement(self, taken: tuple[str, ...], hint: str) -> tuple[tuple[str, ...], str]:
        """The placement options the family takes and how they place merging, given the
        engine's (see :func:`toma.adapters.check_placement`)."""
        return taken, hint

    def config(self, model: torch.nn.Module, config: ToMAConfig) -> ToMAConfig:
        """The settings the engine finds the merged sub-modules with, given the user's:
        a family's own options become the engine's here. Touches nothing."""
        return config

    def attach(self, model: torch.nn.Module, targets: list[Patched], cache: Any, ledger: Any) -> list[torch.nn.Module]:
        """Registers the family's own hooks, after the engine's, given the model's plan cache
        (a :class:`toma.adapters.state.PlanCache`), each through ``ledger`` (a
        :class:`toma.adapters.ledger.Ledger`, whose ``hook`` records it for undo); returns
        the modules that got one."""
        return []

    def tile_frames(self, config: ToMAConfig, frames: int) -> int:
        """Frames a tile spans, given the engine's choice ``frames``."""
        return frames


def image_grid(model: torch.nn.Module, call: dict) -> Grid | None:
    """The ``(1, h, w)`` token grid of image latents ``(B, C, H, W)`` patchified by the
    model's ``config.patch_size`` (SD3, PixArt)."""
    latents = call.get("hidden_states")
    if latents is None or latents.ndim != 4:
        return None
    p = model.config.patch_size
    return (1, latents.shape[-2] // p, latents.shape[-1] // p)


def video_grid(model: torch.nn.Module, call: dict) -> Grid | None:
    """The ``(t, h, w)`` token grid of video latents ``(B, C, F, H, W)`` patchified by the
    model's config: ``patch_size`` as ``(pt, ph, pw)`` (Wan, Cosmos), or a side with
    ``patch_size_t`` (HunyuanVideo)."""
    video = call.get("hidden_states")
    if video is None or video.ndim != 5:
        return None
    p = model.config.patch_size
    pt, ph, pw = p if isinstance(p, (tuple, list)) else (model.config.patch_size_t, p, p)
    return (video.shape[2] // pt, video.shape[3] // ph, video.shape[4] // pw)


def skip_first(count: int) -> Callable[[str, int], tuple[int, ...]]:
    """Default blocks: every block of a stack but the first ``count`` (at most half of it).

    The authors' rule for Flux (5); the other families use it until measured.
    """
    return lambda stack, n: tuple(range(min(count, n // 2), n))


def gather_rows(table: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """Rows ``dest`` ``(Bp, K)`` of a per-batch table ``(Bt, N, ...)`` (``Bt`` 1 or B):
    ``(max(Bt, Bp), K, ...)``."""
    if table.shape[0] == 1:
        return table[0][dest]
    if dest.shape[0] == 1:
        return table[:, dest[0]]
    index = dest.view(*dest.shape, *(1,) * (table.ndim - 2)).expand(-1, -1, *table.shape[2:])
    return table.gather(1, index)


def gather_token_rows(table: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """Rows ``dest`` ``(Bp, K)`` of a per-batch table whose tokens are its second-to-last
    dimension: ``(Bt, N, D)`` as :func:`gather_rows`, or ``(Bt, H, N, D)`` (heads first,
    LTX-2's "split" rotary layout) to ``(max(Bt, Bp), H, K, D)``."""
    if table.ndim == 3:
        return gather_rows(table, dest)
    if table.ndim != 4:
        raise ValueError(f"gather_token_rows takes a (B, N, D) or (B, H, N, D) table; got shape {tuple(table.shape)}")
    if table.shape[0] == 1:
        return table[0][:, dest].transpose(0, 1)  # (H, Bp, K, D) -> (Bp, H, K, D)
    if dest.shape[0] == 1:
        return table[:, :, dest[0]]
    index = dest[:, None, :, None].expand(-1, table.shape[1], -1, table.shape[-1])
    return table.gather(2, index)


def head_mask(log_mass: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """Log masses ``(Bp, K)`` as the ``(batch * heads, 1, K)`` mask diffusers' classic
    attention processors (``AttnProcessor2_0``) take as is."""
    bias = log_mass[:, None, :]
    return bias.expand(batch * heads, 1, -1) if bias.shape[0] == 1 else bias.repeat_interleave(heads, dim=0)
