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

from toma.adapters.layouts import ALONE, ALONE_STREAM, CallRule, Fit, InMask, Layout, Span, Stream, ViaCall

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
class RopeModule:
    """A module whose output holds rotary tables over the image tokens: their image rows are
    put in the blocks' token order at its output.

    Attributes:
        path: the module's path in the model.
        dim: the tables' sequence dimension; a negative one counts from the end, for modules
            whose layout depends on the config (``(B, N, D)`` or ``(B, H, N, D)``: -2 in both).
        items: which items of its output tuple hold image rows (None: all of them).
        image_first: the tables hold the image's rows first, then the text's (HiDream),
            rather than the text's first.
    """

    path: str
    dim: int
    items: tuple[int, ...] | None = None
    image_first: bool = False


@dataclass(frozen=True)
class BlockRope:
    """Rotary tables every block of the stacks takes, for families whose forward makes them
    with no module (a method, JoyImage's): at each block's call their image rows are put in
    the blocks' order (tile order, conditioning tokens first), merged or not.

    Attributes:
        keyword: the tables' keyword in the block's call.
        position: their position when passed positionally (None if never).
        dim: their sequence dimension.
        items: which items of the table tuple hold image rows (an item may nest tensors);
            None: all of them.
    """

    keyword: str
    position: int | None
    dim: int
    items: tuple[int, ...] | None = None


def tile_order_unless(*keywords: str, check: Callable[[torch.nn.Module, dict], bool] | None = None):
    """A ``tile_order_ok`` for families whose forward adds raster-ordered residuals between
    blocks when passed one of ``keywords`` (ControlNet samples): such a call runs in raster
    order; any other call asks ``check``, if given."""

    def ok(model: torch.nn.Module, call: dict) -> bool:
        if any(call.get(k) is not None for k in keywords):
            return False
        return True if check is None else check(model, call)

    return ok


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
            ``patch_embedding``); ``("channels_last", path)`` for a module whose output is a
            channel-last grid ``(B, t, h, w, C)`` that the forward flattens into the blocks'
            sequence, and that ``leave`` gets back reshaped the same way, with plain reshapes
            (Kandinsky 5's ``fractal_flatten`` and ``fractal_unflatten``): the grid is put in
            the blocks' order, and back, as that sequence, so that everything between the two
            sees the blocks' order, block caches too; or ``("block", "")`` for the first
            block's ``hidden_states`` input. Prefer a module before the blocks: a cache around
            them (FirstBlockCache's hook on the first block, cache-dit's first blocks)
            compares the first blocks' output with their input, which must be in the same order.
        leave: a module after the blocks whose first input (``hidden_states``) is the
            ``(B, N, C)`` tokens; they go back to raster order there.
        stream: what the blocks' sequence holds beside the image (:mod:`toma.adapters.layouts`:
            the image alone, a :class:`~toma.adapters.layouts.Packed` prefix before it, or
            :class:`~toma.adapters.layouts.Conditioned` tokens after it), and the position
            inputs that follow its tokens.
        tables: the rotary tables over the image tokens that the engine puts in the blocks'
            order: :class:`RopeModule` at a module's output, or one :class:`BlockRope` at
            every block's call.
        tile_order_ok: optional check of the model and its forward's named arguments; False
            keeps raster order (per-token modulation laid out over the raster sequence,
            raster-ordered residuals between blocks: :func:`tile_order_unless`).
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
    stream: Stream = ALONE_STREAM
    tables: tuple[RopeModule | BlockRope, ...] = ()
    tile_order_ok: Callable[[torch.nn.Module, dict], bool] | None = None
    timestep: Callable[[dict], Any] | None = None
    default_blocks: Callable[[str, int], tuple[int, ...]] = lambda stack, n: tuple(range(n))
    video: bool = False
    reference: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.enter[0] not in ("output", "grid", "channels_last", "block"):
            raise ValueError(f"FamilySpec {self.name}: enter's kind must be output, grid, channels_last or block")
        if sum(isinstance(t, BlockRope) for t in self.tables) > 1:
            raise ValueError(f"FamilySpec {self.name}: at most one BlockRope (the blocks take one table tuple)")

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
