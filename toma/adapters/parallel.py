"""ToMA under diffusers' context parallelism (``model.enable_parallelism``, Ulysses and ring).

Context parallelism splits the token sequence across ``P`` ranks: each rank holds a
contiguous run of ``n = N / P`` raster tokens (its shard) from where the model's
``_cp_plan`` splits them until its output is gathered. toma merges each rank's shard on
its own, with no communication of its own: tiles are local, and a shard that is a grid of
its own has tiles of its own.

What a shard is (:func:`shard_grid`, then :func:`shard_of`):

* whole frames (``n`` a multiple of ``h * w``): the shard is a ``n / (h w) x h x w`` grid;
* else whole rows (``n`` a multiple of ``w``, at least two rows): a ``1 x n / w x w`` band,
  whose rows may run on across a frame boundary (a tile then spans two frames' rows where
  the frame height is not a multiple of the tile's);
* else (a shard that starts or ends inside a row): a span of the whole grid, whose tiles
  are the whole grid's tiles that the span touches; the slots of a tile that a shard
  boundary cuts which lie outside the span are masked, as padding is at a grid's edges
  (:func:`toma.core.tiling.make_span_layout`).

Every rank keeps the same number of tokens ``K`` (Ulysses' all-to-all and ring
attention's exchanges need equal lengths). A shard that is a grid of its own has the
same grid on every rank, hence the same layout. Span shards keep ``floor(K1 / P)`` each,
``K1`` being what single-process ToMA keeps of the whole grid: each tile keeps in
proportion to its tokens in the span, and keeps are then moved one at a time between
tiles to reach that count (:func:`toma.core.tiling.shard_target`). **The rule: the ranks
together keep between ``K1 - (P - 1)`` and ``K1`` tokens** (more only where a shard touches
more tiles than that count, as every tile keeps one).

Where the shard boundaries fall on tile boundaries, the tiles are the single-process
tiles, and CP + ToMA computes what single-process ToMA does (the plans of a tile read its
own tokens only). Bands of whole rows that do not fall on tile boundaries have tiles that
start at the band's first row (so a tile may take rows of two frames), and span shards
have the cut tiles masked: both merge, with equal lengths, but not exactly as one process.

The token grid of a forward is the shard's (:attr:`ForwardState.grid`), and
:attr:`ForwardState.shard` says which shard (:class:`Shard`): toma's reorder points that
run before diffusers splits the sequence (Qwen-Image's ``img_in``, the rotary modules whose
output diffusers splits) see all ``P * n`` tokens and put each shard's run in its tile
order, so that the split hands every rank its shard in tile order.

A packed sequence ``[prefix; image]`` that diffusers splits as it stands (MiniMax H3's)
would leave the prefix on the first ranks: such a family moves its rows at the call
(a ``Packed`` stream's ``spread_rows``) so that each shard holds an equal part of the prefix
(:func:`spread_leads`), then a run of the image (:func:`spread_order`). The runs then
differ in length by up to one row per shard, and each keeps what brings its shard to the
common merged length (:func:`toma.core.tiling.lead_target`, the same rule).

Every rank must decide alike whether and how it merges, from what it sees alone. Wan, LTX,
LTX-2 and Qwen-Image read the whole grid from the call's sizes. Flux and FLUX.2 read it from
the image ids, which diffusers splits before toma sees them: from the whole ids, through
the view the split leaves (:func:`unsplit`), else from the shard's own ids, which tell the
grid where a shard spans two rows or more. A sequence with conditioning images' tokens
(editing) runs unmerged: they are split together with the image's.

Combinations that cannot work are refused with a message naming context parallelism
(:func:`refusal`): families toma has no CP support for, diffusers' ``ulysses_anything`` /
``ring_anything`` (uneven shards, hence different layouts and merged lengths).
Proportional attention is not refused: under context parallelism the backend rule
(:mod:`toma.adapters.attention`) folds the bias into the keys, which ring attention's
exchanges carry, where a float mask over the local keys would be applied to every rank's
key/value chunk.

Nothing here imports diffusers: the model's parallel config and hooks are read as
attributes.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from toma.adapters import _private
from toma.core.tiling import lead_spans

Grid = tuple[int, int, int]


class Shard(NamedTuple):
    """Which part of the sequence this rank holds, in one forward.

    Attributes:
        world: ranks the sequence is split across.
        tokens: tokens per rank.
        span: where the shard is no grid of its own (a cut inside a row): its raster run
            ``[start, stop)`` of ``whole``; the forward's grid is then ``(1, 1, tokens)``,
            a stand-in whose layout is the span layout (:func:`toma.core.tiling.make_span_layout`).
        whole: the whole token grid.
        leads: in a packed sequence whose prefix rows are spread over the shards (MiniMax
            H3): every shard's prefix rows (:func:`spread_leads`); ``span`` is then this
            shard's run of the image, and ``tokens`` its image tokens.
    """

    world: int
    tokens: int
    span: tuple[int, int] | None = None
    whole: Grid | None = None
    leads: tuple[int, ...] | None = None


def spread_leads(prefix: int, tokens: int, world: int) -> tuple[int, ...] | None:
    """How many of a packed sequence's ``prefix`` rows (before its ``tokens`` image tokens) each
    of ``world`` equal shards holds, spread as evenly as they go (the first shards one more);
    None where the sequence does not split into ``world`` equal shards that all hold image
    tokens."""
    if world < 1 or (prefix + tokens) % world:
        return None
    base, extra = divmod(prefix, world)
    leads = tuple(base + (r < extra) for r in range(world))
    return leads if leads[0] < (prefix + tokens) // world else None


def spread_order(leads: tuple[int, ...], tokens: int) -> torch.Tensor:
    """The packed sequence ``[prefix; image]`` (``sum(leads)`` prefix rows, ``tokens`` image
    rows) in the order that hands shard ``r`` its ``leads[r]`` prefix rows, then its run of the
    image's (:func:`toma.core.tiling.lead_spans`): for each new position, the row it takes."""
    prefix, parts, lead_at = sum(leads), [], 0
    for lead, (start, stop) in zip(leads, lead_spans(leads, tokens)):
        parts += [torch.arange(lead_at, lead_at + lead), torch.arange(prefix + start, prefix + stop)]
        lead_at += lead
    return torch.cat(parts)


# the families whose token grid and rotary tables toma follows through diffusers' _cp_plan
SUPPORTED = ("flux", "flux2", "wan", "qwenimage", "ltx", "ltx2", "minimax-h3")


def cp_config(model: torch.nn.Module) -> Any:
    """The model's diffusers ``ContextParallelConfig`` once ``enable_parallelism`` ran, else None."""
    return _private.context_parallel_config(model)


def world_size(cp: Any) -> int:
    """Ranks the sequence is split across: ``ring_degree * ulysses_degree``."""
    return int(cp.ring_degree) * int(cp.ulysses_degree)


def refusal(family: str | None, cp: Any, config: Any) -> str | None:
    """Why toma cannot merge ``family`` under context parallelism ``cp`` with ``config``, or None."""
    if cp is None:
        return None
    if family not in SUPPORTED:
        return (
            f"ToMA does not merge {family or 'this model'} under context parallelism (enable_parallelism); "
            f"the families it merges under it are {', '.join(SUPPORTED)}"
        )
    if getattr(cp, "ulysses_anything", False) or getattr(cp, "ring_anything", False):
        return (
            "ToMA does not merge under context parallelism with ulysses_anything or ring_anything: their shards "
            "differ in length, so ranks would merge to different lengths; use equal shards"
        )
    return None


def shard_grid(grid: Grid, world: int) -> Grid | None:
    """The grid of each rank's shard when a ``(t, h, w)`` grid's raster tokens are split into
    ``world`` equal runs, or None where the runs are not whole frames or at least two whole
    rows (then each is a span; see the module docstring)."""
    t, h, w = grid
    tokens = t * h * w
    if world < 1 or tokens % world:
        return None
    n = tokens // world
    if n % (h * w) == 0:
        return (n // (h * w), h, w)
    if n % w == 0 and n // w >= 2:
        return (1, n // w, w)
    return None


def splits_call(model: torch.nn.Module) -> bool:
    """Whether diffusers splits the model's own ``hidden_states`` argument (Flux, Flux.2, LTX),
    so that the model's hooks see each rank's shard; otherwise (Wan, Qwen-Image) the split
    comes inside the model and its call has every token."""
    for metadata in _split_plans(model):
        if "hidden_states" in metadata:
            return True
    return False


def splits_output(module: torch.nn.Module) -> bool:
    """Whether diffusers splits ``module``'s output (the rotary modules of Wan, LTX and
    Qwen-Image): toma's hook on it then sees every rank's rows."""
    return any(getattr(m, "split_output", False) for plan in _split_plans(module) for m in _flat(plan.values()))


def _split_plans(module: torch.nn.Module) -> list[dict]:
    """The input plans of diffusers' CP split hooks on ``module`` (``cp_input---*``)."""
    hooks = getattr(_private.registry(module), "hooks", None) or {}
    prefix = _private.CP_INPUT_HOOK_PREFIX
    return [getattr(hook, "metadata", {}) for name, hook in hooks.items() if str(name).startswith(prefix)]


def _flat(values: Any) -> list:
    out = []
    for v in values:
        out.extend(v if isinstance(v, (list, tuple)) else [v])
    return out


def unsplit_tokens(x: torch.Tensor, world: int) -> torch.Tensor:
    """A stand-in for the unsplit ``(B, P * n, C)`` tokens of a shard ``x`` ``(B, n, C)``, for
    grid readers that check a grid against the token count: shaped, on the meta device."""
    return torch.empty((x.shape[0], x.shape[1] * world, *x.shape[2:]), device="meta", dtype=x.dtype)


def unsplit(shard: torch.Tensor, world: int, index: int, dim: int) -> torch.Tensor | None:
    """The tensor diffusers split ``shard`` from, where ``shard`` is still a view of it:
    shard ``index`` of ``world`` equal chunks along ``dim`` (diffusers' equal split chunks a
    tensor into views). None where ``shard`` is no such view (a copy, another slicing).

    Every rank reads the same whole tensor this way, with no communication: what it
    decides from it, every rank decides alike.
    """
    base = shard._base
    if base is None:
        return None
    n = shard.shape[dim]
    offset = shard.storage_offset() - base.storage_offset()
    along = base.ndim - (shard.ndim - dim)  # the same dimension, counted from the end (a view may drop leading ones)
    if along >= 0 and base.shape[along] == n * world and base.stride(along) == shard.stride(dim):
        return base if offset == index * n * shard.stride(dim) else None
    # a contiguous tensor reshaped before the split (Flux's ids on the CPU are a view of
    # their (h, w, 3) grid): the chunks are consecutive runs of its memory
    if base.is_contiguous() and shard.is_contiguous() and base.numel() == shard.numel() * world:
        if offset == index * shard.numel():
            shape = list(shard.shape)
            shape[dim] *= world
            return base.view(shape)
    return None


def shard_index(cp: Any) -> int:
    """This rank's shard: its rank in the flattened CP mesh, as diffusers' sharder reads it."""
    import torch.distributed as dist

    return dist.get_rank(_private.context_parallel_group(cp))


def shard_of(grid: Grid, tokens: int, world: int, index: int) -> tuple[Grid, Shard] | None:
    """The grid of shard ``index`` of the whole ``grid`` (``tokens`` tokens on each of
    ``world`` ranks), and the :class:`Shard`; None where ``grid`` does not hold ``tokens *
    world`` tokens. A shard that is no grid of its own is a span of ``grid``, under a
    ``(1, 1, tokens)`` stand-in."""
    if math.prod(grid) != tokens * world:
        return None
    own = shard_grid(grid, world)
    if own is not None:
        return own, Shard(world, tokens, whole=tuple(grid))
    return (1, 1, tokens), Shard(world, tokens, (index * tokens, (index + 1) * tokens), tuple(grid))
