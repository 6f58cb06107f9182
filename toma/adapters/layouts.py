"""How a merged call's arguments are laid out: small objects a family picks for each site.

A :class:`~toma.adapters.spec.Site` states a family's facts about one sub-module's call as
four kinds of object, so that the engine's hooks (:mod:`toma.adapters.merging`) ask each
object what to do instead of branching on one family's flag:

* a :class:`Layout`, where the image tokens sit in the call's hidden states (:data:`ALONE`,
  :data:`TEXT_FIRST`, :data:`IMAGE_FIRST`, :class:`SeqFirst`): which rows merge, which pass
  whole, how per-token rotary rows follow and how many text keys lead a key bias;
  :data:`BETWEEN` does the same where the image's place is read per call (a host that
  hands a block ``[lead; image; tail]``, as ComfyUI does);
* a bias route, how proportional attention's key bias reaches the attention
  (:class:`InMask`: as the processor's attention mask; :class:`ViaCall`: past a processor
  whose mask argument cannot carry it);
* a :class:`Fit`, how a mask of the model's own is fitted to the merged tokens;
* call rules, one-family rewrites of a merged call (:class:`SameTokens`, :class:`MergedCount`),
  and a :class:`Span`, for a merge that spans several sub-modules of a block.

Each is a frozen value with the behaviour of its kind, tested on its own
(``tests/adapters/test_layouts.py``). Nothing here registers a hook or names a family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from toma.adapters.attention import BIAS_KWARG

Slot = tuple[str, "int | None"]  # (keyword, position) of an argument of a call


def replace_arg(args: tuple, kwargs: dict, name: str, index: int | None, value: Any) -> tuple[tuple, dict]:
    """The call's arguments with ``value`` for the parameter ``name`` at position ``index``."""
    if index is not None and len(args) > index:
        return (*args[:index], value, *args[index + 1 :]), kwargs
    return args, {**kwargs, name: value}


def read_arg(args: tuple, kwargs: dict, name: str, index: int | None) -> Any:
    """The call's argument ``name`` (at position ``index``, when passed positionally), or None."""
    return args[index] if index is not None and len(args) > index else kwargs.get(name)


def hidden_states_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A call's hidden states: its first positional argument, or ``hidden_states=``."""
    return args[0] if args else kwargs.get("hidden_states")


def with_hidden_states(args: tuple, kwargs: dict, x: torch.Tensor) -> tuple[tuple, dict]:
    """The call's arguments with ``x`` in place of its hidden states."""
    if args:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}


# -- where the image tokens sit -----------------------------------------------------------


class Layout:
    """Where the ``N`` image tokens sit in a call's hidden states ``(B, S, C)``.

    The base layout is the image alone: the call's sequence is its image tokens, led by
    conditioning tokens while the model's token order puts them first (``extra``), which
    pass whole. Subclasses place text before or after the image. Every method is pure.
    """

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The call's hidden states as ``(B, S, C)`` rows (a view)."""
        return x

    def unrows(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``(B, S, C)`` back in the call's own layout (a view)."""
        return x

    def text(self, length: int, tokens: int, extra: bool) -> int:
        """How many of a call's ``length`` tokens are not the ``tokens`` image tokens: they
        pass whole. Negative: the call cannot hold the image (it then runs unmerged)."""
        return length - tokens if extra else 0

    def image(self, x: torch.Tensor, tokens: int, text: int) -> torch.Tensor:
        """The image tokens of rows ``x``."""
        return x[:, text:] if text else x

    def merge(self, merge: Callable, x: torch.Tensor, tokens: int, text: int) -> torch.Tensor:
        """Rows ``x`` with their image tokens merged by ``merge`` (the text where it was)."""
        merged = merge(x[:, text:] if text else x)
        return torch.cat([x[:, :text], merged], dim=1) if text else merged

    def unmerge(self, unmerge: Callable, y: torch.Tensor, text: int) -> torch.Tensor:
        """Inverse of :meth:`merge` on output rows ``y``, by ``unmerge``."""
        if not text:
            return unmerge(y)
        return torch.cat([y[:, :text], unmerge(y[:, text:])], dim=1)

    def table_rows(
        self, gather: Callable, table: torch.Tensor, dest: torch.Tensor, tokens: int, text: int
    ) -> torch.Tensor:
        """A per-batch rotary table over a call of ``tokens`` image tokens and ``text`` others,
        gathered to the merged tokens ``dest`` ``(Bp, K)`` by the site's ``gather``."""
        return gather(table, dest)

    def bias_lead(self, text: int) -> int:
        """How many keys of the call's attention lead its image keys (log mass 0 in the bias)."""
        return text

    def refuses(self, *, bias: bool, span: bool, shared_rotary: bool) -> str | None:
        """Why this layout cannot go with a key bias, a span or a shared rotary table, if so."""
        return None

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TextFirst(Layout):
    """``[text; image]`` hidden states (a single-stream block): the last ``N`` tokens merge
    and the text before them passes whole, in the output too. Per-batch rotary tables
    ``(B, text + N, ...)`` keep their text rows whole before the gathered image rows."""

    def text(self, length: int, tokens: int, extra: bool) -> int:
        return length - tokens

    def table_rows(
        self, gather: Callable, table: torch.Tensor, dest: torch.Tensor, tokens: int, text: int
    ) -> torch.Tensor:
        if not text:
            return gather(table, dest)
        lead = table.shape[1] - tokens  # the table's own text rows
        image = gather(table[:, lead:], dest)
        return torch.cat([_expand(table[:, :lead], image.shape[0]), image], dim=1)


class ImageFirst(Layout):
    """``[image; text]`` hidden states (Z-Image's unified sequence): the first ``N`` tokens
    merge and the text after them passes whole. Its rotary tables are per-batch
    ``(B, N + text, ...)``, the image's rows first. No text key leads the image keys: the
    site's bias form pads the text keys' log mass after them
    (:func:`toma.adapters.attention.key_bias_text_after`)."""

    def text(self, length: int, tokens: int, extra: bool) -> int:
        return length - tokens

    def image(self, x: torch.Tensor, tokens: int, text: int) -> torch.Tensor:
        return x[:, :tokens]

    def merge(self, merge: Callable, x: torch.Tensor, tokens: int, text: int) -> torch.Tensor:
        return torch.cat([merge(x[:, :tokens]), x[:, tokens:]], dim=1)

    def unmerge(self, unmerge: Callable, y: torch.Tensor, text: int) -> torch.Tensor:
        if not text:
            return unmerge(y)
        kept = y.shape[1] - text
        return torch.cat([unmerge(y[:, :kept]), y[:, kept:]], dim=1)

    def table_rows(
        self, gather: Callable, table: torch.Tensor, dest: torch.Tensor, tokens: int, text: int
    ) -> torch.Tensor:
        image = gather(table[:, :tokens], dest)
        return torch.cat([image, _expand(table[:, tokens:], image.shape[0])], dim=1)

    def bias_lead(self, text: int) -> int:
        return 0

    def refuses(self, *, bias: bool, span: bool, shared_rotary: bool) -> str | None:
        if span or shared_rotary:
            return "an image-first layout takes neither a span nor a shared rotary table"
        return None


@dataclass(frozen=True, repr=False)
class SeqFirst(Layout):
    """Sequence-first hidden states ``(S, B, C)`` (ERNIE-Image's MLP), laid out as ``inner``
    says once seen as their ``(B, S, C)`` transpose (a view); the merged call gets
    ``(K', B, C)``. It takes no key bias and no span."""

    inner: Layout = Layout()

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)

    def unrows(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)

    def text(self, length: int, tokens: int, extra: bool) -> int:
        return self.inner.text(length, tokens, extra)

    def image(self, x: torch.Tensor, tokens: int, text: int) -> torch.Tensor:
        return self.inner.image(x, tokens, text)

    def merge(self, merge: Callable, x: torch.Tensor, tokens: int, text: int) -> torch.Tensor:
        return self.inner.merge(merge, x, tokens, text)

    def unmerge(self, unmerge: Callable, y: torch.Tensor, text: int) -> torch.Tensor:
        return self.inner.unmerge(unmerge, y, text)

    def table_rows(
        self, gather: Callable, table: torch.Tensor, dest: torch.Tensor, tokens: int, text: int
    ) -> torch.Tensor:
        return self.inner.table_rows(gather, table, dest, tokens, text)

    def bias_lead(self, text: int) -> int:
        return self.inner.bias_lead(text)

    def refuses(self, *, bias: bool, span: bool, shared_rotary: bool) -> str | None:
        if bias or span:
            return "a sequence-first layout takes neither a key bias nor a span"
        return self.inner.refuses(bias=bias, span=span, shared_rotary=shared_rotary)

    def __repr__(self) -> str:
        return f"SeqFirst({self.inner!r})"


ALONE = Layout()
TEXT_FIRST = TextFirst()
IMAGE_FIRST = ImageFirst()


class Between:
    """``[lead; image; tail]`` hidden states whose image sits after ``lead`` tokens and before a
    tail, both passing whole: what a host hands a block whole, e.g. ComfyUI's Flux single
    blocks (``[text; image; reference]``) and NextDiT's layers (``[caption; image; pad]``).

    Unlike a :class:`Layout`, whose position rule is fixed, the lead is read per call, so every
    method takes it. ``lead=0`` with no tail is the image alone. Every method is pure.
    """

    def split(self, x: torch.Tensor, lead: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(lead rows, image rows, tail rows)`` of ``x`` ``(B, S, C)``."""
        return x[:, :lead], x[:, lead : lead + tokens], x[:, lead + tokens :]

    def join(self, lead: torch.Tensor, image: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        """The rows back in one sequence; the image alone is returned as it is."""
        if not lead.shape[1] and not tail.shape[1]:
            return image
        return torch.cat((lead, image, tail), 1)

    def kept(self, dest: torch.Tensor, lead: int, tokens: int, length: int) -> torch.Tensor:
        """``(Bp, lead + K + tail)``: the positions of a ``length``-token sequence that its merged
        sequence keeps (the lead, each merged token's destination, the tail)."""
        dest = dest + lead
        head = torch.arange(lead, device=dest.device).expand(dest.shape[0], -1)
        tail = torch.arange(lead + tokens, length, device=dest.device).expand(dest.shape[0], -1)
        return torch.cat((head, dest, tail), 1)

    def gather(self, table: torch.Tensor, positions: torch.Tensor, dim: int) -> torch.Tensor:
        """Rows ``positions`` ``(Bp, L')`` along ``dim`` of a per-token table ``(B or 1, ..., L, ...)``,
        per sample: ``(max(B, Bp), ..., L', ...)``."""
        b = max(table.shape[0], positions.shape[0])
        table = table.expand(b, *table.shape[1:])
        view = [b] + [1] * (table.ndim - 1)
        view[dim] = positions.shape[1]
        sizes = list(table.shape)
        sizes[dim] = positions.shape[1]
        return torch.gather(table, dim, positions.expand(b, -1).reshape(view).expand(sizes))

    def bias(self, log_mass: torch.Tensor, lead: int, tail: int, dtype: torch.dtype) -> torch.Tensor:
        """``(Bp, lead + K + tail)`` key bias: each merged key's log mass, 0 for the others."""
        lm = log_mass.to(dtype)
        zeros = lm.new_zeros
        return torch.cat((zeros(lm.shape[0], lead), lm, zeros(lm.shape[0], tail)), 1)

    def __repr__(self) -> str:
        return "Between()"


BETWEEN = Between()


def _expand(rows: torch.Tensor, batch: int) -> torch.Tensor:
    """Table rows ``(Bt, R, ...)`` broadcast to a batch of ``batch``."""
    return rows if rows.shape[0] == batch else rows.expand(batch, *rows.shape[1:])


# -- how the key bias reaches the attention -------------------------------------------------


@dataclass(frozen=True)
class InMask:
    """The key bias goes in as the processor's attention mask, at ``slot``.

    Attributes:
        slot: ``(keyword, position)`` of the call's attention mask.
        form: ``form(log_mass, batch, heads)`` turns the plan's ``(Bp, K)`` log masses into
            the mask the processor wants: a float mask for processors that call torch's SDPA
            (:func:`toma.adapters.spec.head_mask`), or :func:`toma.adapters.attention.key_bias`
            for those that hand it to diffusers' dispatch (which then applies it by the
            backend's rule, folding in a mask of the model's own that the site's
            :class:`Fit` fitted).
        ok: ``ok(module)``: why the module's current processor cannot take it (a string),
            or None where it can; not given: it always can.
        keys: keyword of the call's text tokens where its processor puts them before the
            image tokens in one joint attention (Flux): their keys get log mass 0, before
            the merged image keys'.
    """

    slot: Slot
    form: Callable[[torch.Tensor, int, int], Any]
    ok: Callable[[torch.nn.Module], str | None] | None = None
    keys: str | None = None

    def route(self, args: tuple, kwargs: dict, bias: Any, own: Any, dense: Callable[[], dict]) -> tuple[tuple, dict]:
        """The call with ``bias`` as its mask. A :class:`~toma.adapters.attention.KeyBias`
        takes in ``own``, the model's own mask (already fitted to the merged keys); one that
        then varies per query keeps the float masks it builds in ``dense()``, a dict the
        blocks of a forward share (not while compiling, where it is built in the graph)."""
        if own is not None and hasattr(bias, "with_model_mask"):
            bias = bias.with_model_mask(own)
            if bias.per_query and not torch.compiler.is_compiling():
                bias = bias._replace(dense=dense())
        return replace_arg(args, kwargs, *self.slot, bias)

    def calls(self) -> tuple:
        """Call strategies the bias needs around the merged call."""
        return ()


@dataclass(frozen=True)
class ViaCall:
    """The key bias goes past a processor whose mask argument cannot carry it (it ignores,
    rebuilds or reshapes it: SD3, LTX, Qwen-Image): in the call's keyword
    :data:`~toma.adapters.attention.BIAS_KWARG`, which ``call`` takes out and brings to the
    attention itself (:func:`toma.adapters.attention.through_dispatch`, or a family's own).

    Attributes:
        call: the call strategy ``call(forward, hook, *args, **kwargs)``.
        form: as :attr:`InMask.form`.
        ok: as :attr:`InMask.ok`.
        keys: as :attr:`InMask.keys`.
    """

    call: Callable[..., Any]
    form: Callable[[torch.Tensor, int, int], Any]
    ok: Callable[[torch.nn.Module], str | None] | None = None
    keys: str | None = None
    slot = None

    def route(self, args: tuple, kwargs: dict, bias: Any, own: Any, dense: Callable[[], dict]) -> tuple[tuple, dict]:
        """The call with ``bias`` under :data:`~toma.adapters.attention.BIAS_KWARG`; the
        processor folds in its own mask (built from what the module got, over other keys)."""
        return args, {**kwargs, BIAS_KWARG: bias}

    def calls(self) -> tuple:
        """Call strategies the bias needs around the merged call (innermost)."""
        return (self.call,)


# -- a mask of the model's own ---------------------------------------------------------------


@dataclass(frozen=True)
class Fit:
    """How a mask of the model's own, laid out over the call's unmerged sequence, is fitted
    to the merged tokens.

    Attributes:
        fit: ``fit(mask, N, K)`` adapts it to ``K`` merged image tokens, or returns None
            when it cannot (the call then runs unmerged, with a warning once).
            :func:`toma.core.masks.slice_joint_mask` fits a text-first mask that holds one
            value over the image, which the family's grid reader checks once per forward
            (Flux, FLUX.2, Chroma); a spanning site must get only masks it can fit, as its
            merge happens before its call is seen.
        slot: ``(keyword, position)`` of the mask where it is not the attention mask a key
            bias would go in (HiDream's ``hidden_states_masks``, which zeroes padded keys);
            None: the bias route's slot, else ``attention_mask``. Not with a key bias or a span.
    """

    fit: Callable[[torch.Tensor, int, int], torch.Tensor | None]
    slot: Slot | None = None


# -- one-family rewrites of a merged call -----------------------------------------------------


class CallRule:
    """A rewrite of a merged call that one family's module needs: :meth:`refuses` a call
    before it merges, :meth:`apply` rewrites the merged call."""

    def refuses(self, args: tuple, kwargs: dict) -> str | None:
        """Why this call cannot run merged (said once), or None."""
        return None

    def apply(self, args: tuple, kwargs: dict, image_tokens: int) -> tuple[tuple, dict]:
        """The merged call's arguments, given its ``image_tokens`` merged image tokens."""
        return args, kwargs


@dataclass(frozen=True)
class SameTokens(CallRule):
    """The call passes its hidden states a second time under ``keyword``, as the source of
    its keys and values (Lumina 2's self-attention, called through a cross-attention
    signature): the merged call gets the merged tokens there too. A call that passes
    another tensor there runs unmerged."""

    keyword: str

    def refuses(self, args: tuple, kwargs: dict) -> str | None:
        if kwargs.get(self.keyword) is not hidden_states_of(args, kwargs):
            return f"got keys ({self.keyword}) other than its hidden states"
        return None

    def apply(self, args: tuple, kwargs: dict, image_tokens: int) -> tuple[tuple, dict]:
        return args, {**kwargs, self.keyword: hidden_states_of(args, kwargs)}


@dataclass(frozen=True)
class MergedCount(CallRule):
    """An argument at ``(keyword, position)`` counts the call's image tokens, by which the
    module splits its sequence (Helios' ``original_context_length``: the history before
    them is the rest): the merged call gets the merged count."""

    keyword: str
    position: int | None = None

    def apply(self, args: tuple, kwargs: dict, image_tokens: int) -> tuple[tuple, dict]:
        return replace_arg(args, kwargs, self.keyword, self.position, image_tokens)


# -- a merge across several sub-modules ---------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """A merge that spans sub-modules of a block: the output of the site's ``path`` (its
    first item, when a tuple) is merged, everything the block computes from it runs on the
    merged tokens, and the output of ``until`` is unmerged (Flux's single-stream blocks:
    their norm feeds attention and the MLP in parallel, and ``proj_out`` joins them).

    Attributes:
        call: the sub-module in between whose call takes the site's rotary tables and mask.
        until: the sub-module whose output is unmerged.
    """

    call: str
    until: str


# -- what the blocks' sequence holds besides the image ----------------------------------------


class Spread:
    """How a packed family lays out its call's packed rows for diffusers' context parallelism,
    which splits the packed sequence itself (a family subclasses it in its own file)."""

    def length(self, call: dict) -> int:
        """The packed sequence's rows in ``call`` (the forward's named arguments)."""
        raise NotImplementedError

    def rows(self, model: torch.nn.Module, call: dict, order: torch.Tensor) -> dict:
        """The call's arguments that lay out the packed rows, permuted so that its row ``i``
        is the model's row ``order[i]`` (``order`` from
        :func:`~toma.adapters.parallel.spread_order`: each shard gets an equal part of the
        prefix, then a run of the image)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Stream:
    """What the sequence between the modules that bracket the blocks holds: here, the
    image's tokens alone.

    Attributes:
        positions: forward arguments holding one position row per image token, ``(N, d)`` or
            ``(B, N, d)`` (Flux.2's ``img_ids``), put in the blocks' token order at the call,
            so that tables computed from them follow the tokens.
    """

    positions: tuple[str, ...] = ()

    @property
    def packed(self) -> bool:
        """Whether a prefix leads the image in the sequence (:class:`Packed`)."""
        return False

    @property
    def conditioning(self) -> bool | Callable[[torch.nn.Module, dict], int]:
        """Whether conditioning images' tokens follow the image's (:class:`Conditioned`)."""
        return False

    @property
    def spread(self) -> Spread | None:
        """How the packed rows spread under context parallelism (:class:`Packed`)."""
        return None


@dataclass(frozen=True)
class Packed(Stream):
    """The sequence that enters the blocks and leaves them is ``[prefix; image]``, a packed
    single stream built from the model's inputs (MiniMax H3, Ideogram 4): its last ``N``
    tokens are the image's and are the ones put in tile order where they enter and back where
    they leave; the prefix (text, other modalities) stays where it is, and so do its rows of
    ``positions``, which are rows over the whole packed sequence, ``(S,)``, ``(S, d)`` or
    ``(B, S, d)``, whose last ``N`` are the image's.

    Attributes:
        positions: as :attr:`Stream.positions`, over the packed sequence.
        spread_rows: how the call's packed rows spread over the shards of diffusers' context
            parallelism (:class:`Spread`); None: refused under context parallelism.
    """

    spread_rows: Spread | None = None

    @property
    def packed(self) -> bool:
        return True

    @property
    def spread(self) -> Spread | None:
        return self.spread_rows


@dataclass(frozen=True)
class Conditioned(Stream):
    """The model's ``(B, S, C)`` image tokens may be those of the grid followed by
    conditioning images' (Flux Kontext, FLUX.2 references, Qwen-Image-Edit): those pass whole,
    like text; between the modules that bracket the blocks they lead the sequence, so that
    every site sees them before the image tokens it merges.

    Attributes:
        positions: as :attr:`Stream.positions`.
        count: True counts them from ``hidden_states`` ``(B, S, C)``; a function
            ``(model, call) -> int`` counts them from the call's named arguments where
            ``hidden_states`` are latents (JoyImage's reference frames).
    """

    count: bool | Callable[[torch.nn.Module, dict], int] = True

    @property
    def conditioning(self) -> bool | Callable[[torch.nn.Module, dict], int]:
        return self.count


ALONE_STREAM = Stream()
