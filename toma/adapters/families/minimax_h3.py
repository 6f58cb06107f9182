"""MiniMax H3 (``MiniMaxH3Transformer3DModel``): one stack of blocks on a packed video + audio sequence.

The forward projects each modality and scatters its rows into one packed sequence with
``index_copy``: ``[text; keyframe or reference rows; audio; generated video]`` in every
layout diffusers' modular pipeline builds (``t2va``, ``fl2va``, ``ref2va``), the generated
video last. ``transformer_blocks`` then run on that whole sequence: each block modulates it
per row (AdaLN parameters looked up per ``(timestep, modality)``), then runs its attention
and its SwiGLU MLP, each with a gated residual. Both merge the last ``N`` rows, the
generated video's (``text_first``); everything before them (text, conditioning frames,
audio) passes whole, as text does. The per-row modulation is applied outside the merged
sub-modules, so it never sees merged rows.

The rotary tables come from ``rope`` over ``position_ids`` ``(S, 3)``, as ``(cos, sin)``
``(S, D)`` in the packed order; the processor applies one table to the whole batch
(``Rotary(shared=True)``). The grid is read from the call: the generated video is the run
of ``video_indices`` that ends the sequence, and its frames, rows and columns are where the
``(t, h, w)`` of its ``position_ids`` change (one host read, again only when the layout's
tensors change). The batch is a replication axis (one layout for every sample). The model
passes no attention mask; proportional attention is a key bias into the processor's
dispatched attention (the prefix's keys first, log mass 0).

Between the blocks the video rows run in tile order (``FamilySpec.packed``): the packed
sequence's last ``N`` rows are reordered where it enters the first block and back where it
reaches ``proj_out``, the prefix in place. The per-row inputs follow them at the call
(``position_ids``, so that ``rope`` makes its tables in that order, and ``timestep_indices``
and ``token_tags``, so that the per-row modulation and ``norm_out`` see each row's own);
``audio_proj_out`` reads only the audio rows, which never move.

Under context parallelism diffusers splits the packed sequence where it enters the first
block, as it stands: the first shard would hold all the prefix. The model is indifferent
to the order of its packed rows as long as every per-row input follows them, so in
forwards that merge, the call's rows are moved instead (:func:`spread`,
``Packed.spread_rows``): each shard then holds an equal part of the prefix (within one
row), then a run of the video in raster order, and the modality indices point at the rows'
new places, so that the outputs come back in the model's order. Each shard's video run is
a span of the whole grid whose keep brings every shard to the same merged length
(:func:`toma.core.tiling.lead_target`).
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import InMask, Packed, Spread, TEXT_FIRST
from toma.adapters.attention import key_bias
from toma.adapters.spec import FamilySpec, Grid, Rotary, Site, skip_first
from toma.adapters.grids import tensor_version

# rotary_emb is (cos, sin), each (S, D) over the packed sequence: the video's rows last
_ROTARY = Rotary("rotary_emb", 1, shared=True)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    return [
        # the block calls attn(norm_hidden_states, rotary_emb, attention_mask)
        Site("attn", "attn", layout=TEXT_FIRST, rotary=_ROTARY, bias=InMask(("attention_mask", 2), key_bias)),
        Site("ff", "mlp", layout=TEXT_FIRST),
    ]


def target_rows(video_indices: torch.Tensor, length: int) -> int:
    """How many rows end a packed sequence of ``length`` rows as one run of ``video_indices``
    (the generated video's: conditioning rows come earlier, before the audio)."""
    tail = video_indices.flip(0)
    expected = torch.arange(length - 1, length - 1 - tail.numel(), -1)
    match = tail == expected
    return int(match.numel() if bool(match.all()) else int(match.to(torch.int8).argmin()))


def packed_grid(position_ids: torch.Tensor, tokens: int) -> Grid | str:
    """The ``(t, h, w)`` grid of the last ``tokens`` rows of ``position_ids`` ``(S, 3)``, read
    from where their coordinates change (frame-major, then row-major, as the pipeline packs
    them), or why they are not one grid."""
    pos = position_ids[-tokens:]
    t, h = pos[:, 0], pos[:, 1]
    per_frame = int((t == t[0]).to(torch.int8).argmin()) or tokens  # rows before the first other time
    width = int((h[:per_frame] == h[0]).to(torch.int8).argmin()) or per_frame
    frames, height = tokens // per_frame, per_frame // width
    if frames * per_frame != tokens or height * width != per_frame:
        return f"the last {tokens} rows of position_ids are not frames of one size"
    grid = pos.reshape(frames, height, width, 3)
    regular = (
        bool((grid[..., 0] == grid[:, :1, :1, 0]).all())  # one time per frame
        and bool((grid[..., 1] == grid[:1, :, :1, 1]).all())  # one height coordinate per row
        and bool((grid[..., 2] == grid[:1, :1, :, 2]).all())  # one width coordinate per column
    )
    if not regular:
        return f"the last {tokens} rows of position_ids do not span a {frames}x{height}x{width} grid"
    return frames, height, width


class PackedVideoGrid:
    """Reads the generated video's grid from a MiniMax H3 call (see the module docstring);
    one per patched model. The pipeline passes the same layout tensors at every step, so
    they are read (a host sync) once while they come back unchanged."""

    def __init__(self) -> None:
        self._known: tuple | None = None  # (video_indices, its version, position_ids, its version, result)

    def __call__(self, model: torch.nn.Module, call: dict) -> Grid | str | None:
        hidden, ids, video = call.get("hidden_states"), call.get("position_ids"), call.get("video_indices")
        if not all(isinstance(t, torch.Tensor) for t in (hidden, ids, video)):
            return "a MiniMax H3 call without hidden_states, position_ids and video_indices gives no token grid"
        known = self._known
        if (
            known is not None
            and known[0] is video
            and known[1] == tensor_version(video)
            and known[2] is ids
            and known[3] == tensor_version(ids)
        ):
            found = known[4]
        else:
            found = self._read(video, ids)
            self._known = (video, tensor_version(video), ids, tensor_version(ids), found)
        if isinstance(found, tuple) and hidden.shape[1] < found[0] * found[1] * found[2]:
            return f"hidden_states hold {hidden.shape[1]} video rows, fewer than the generated video's"
        return found

    @staticmethod
    def _read(video: torch.Tensor, ids: torch.Tensor) -> Grid | str:
        if ids.ndim != 2 or ids.shape[-1] != 3:
            return f"position_ids of shape {tuple(ids.shape)} are not (S, 3)"
        tokens = target_rows(video.detach().cpu(), ids.shape[0])
        if tokens == 0:
            return "no run of video_indices ends the packed sequence, so no generated video is its last rows"
        return packed_grid(ids.detach().cpu(), tokens)


def target_timestep(call: dict) -> torch.Tensor | None:
    """The generated video's timestep: ``timestep`` holds the distinct noise levels of the
    call (audio and conditioning rows have their own), and the last row is the video's."""
    timestep, index = call.get("timestep"), call.get("timestep_indices")
    if not isinstance(timestep, torch.Tensor) or not isinstance(index, torch.Tensor) or not index.numel():
        return timestep
    return timestep.index_select(0, index[-1:].to(timestep.device))


class PackedRows(Spread):
    """The packed rows of a MiniMax H3 call, spread over context-parallel shards."""

    def length(self, call: dict) -> int:
        return call["position_ids"].shape[0]

    def rows(self, model: torch.nn.Module, call: dict, order: torch.Tensor) -> dict:
        return spread(model, call, order)


def spread(model: torch.nn.Module, call: dict, order: torch.Tensor) -> dict:
    """The call's packed layout with its row ``i`` the model's row ``order[i]`` (under context
    parallelism, :class:`PackedRows`): the per-row tensors are permuted, and the indices
    that scatter each modality's rows into the sequence (and read the outputs back from it)
    point at the rows' new places, so that the outputs keep the model's order."""
    device = call["position_ids"].device
    order = order.to(device)
    where = torch.argsort(order)  # each row's new place
    moved = {name: call[name].index_select(0, order) for name in ("position_ids", "timestep_indices", "token_tags")}
    for name in ("video_indices", "audio_indices", "text_indices"):
        moved[name] = where.index_select(0, call[name].to(device))
    return moved


SPEC = FamilySpec(
    name="minimax-h3",
    classes=("MiniMaxH3Transformer3DModel",),
    stacks=("transformer_blocks",),
    sites=_sites,
    grid=PackedVideoGrid,
    enter=("block", ""),
    leave="proj_out",  # after norm_out, which reads timestep_indices in the blocks' order
    stream=Packed(positions=("position_ids", "timestep_indices", "token_tags"), spread_rows=PackedRows()),
    timestep=target_timestep,
    default_blocks=skip_first(5),
    video=True,
    reference=(24, 42),  # the pipeline's 768x1344 canvas: 16x VAE, 2x2 patches
)
