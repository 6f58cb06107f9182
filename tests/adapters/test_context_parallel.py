"""ToMA under diffusers' context parallelism (Ulysses, ring, both), on CPU processes.

The cases run in tests/cp_worker.py, its ranks forked after one import, with gloo at ``OMP_NUM_THREADS=1``:
one spawn of 2 processes (Ulysses 2, ring 2) and one of 4 (Ulysses 2 x ring 2), each
running every case of its size; the tests here read what each rank recorded. The rules
themselves (which shards merge, what is refused) are also tested in this process.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import toma
from tests.compat_cells import families
from toma.adapters.parallel import refusal, shard_grid, spread_leads, spread_order, unsplit
from toma.config import ToMAConfig
from toma.core.plan import build_plan
from toma.core.tiling import (
    from_tiles,
    layout_index,
    lead_spans,
    lead_target,
    make_layout,
    make_span_layout,
    shard_target,
    slot_raster_index,
    to_tiles,
    token_mask,
)

WORKER = Path(__file__).parents[1] / "cp_worker.py"
SPAWN_SECONDS = 240  # about 30 s (2 processes) and 20 s (4) on the 2-core CI machine; the rest is load
FAMILIES = ("flux", "flux2", "wan", "qwenimage", "ltx", "ltx2")
# merged self-attention calls per forward
MERGED_CALLS = {"flux": 4, "flux2": 4, "wan": 2, "qwenimage": 2, "ltx": 2, "ltx2": 2, "minimax-h3": 2}
# Tiles are local, so on tile-aligned shards CP + ToMA computes single-process ToMA's
# maths: only the order of float sums differs (attention split by heads or by key chunks,
# whose partial results ring attention recombines through their log-sum-exps).
REORDERING = 1e-5
# the shard grids of the cases' calls (tests/cp_worker.py ``inputs``): 4-row bands of 8
# columns; Wan's 3 frames of 8x8 over 2 ranks are 12-row bands across a frame boundary,
# its 4 frames over 4 ranks one frame each; LTX's and LTX-2's 2 frames of 8x8, one frame or 4 rows
IMAGES = {"flux": (1, 4, 8), "flux2": (1, 4, 8), "qwenimage": (1, 4, 8)}
SHARDS = {
    2: {**IMAGES, "wan": (1, 12, 8), "ltx": (1, 8, 8), "ltx2": (1, 8, 8)},
    4: {**IMAGES, "wan": (1, 8, 8), "ltx": (1, 4, 8), "ltx2": (1, 4, 8)},
}
GRIDS = {  # the whole token grids of those calls
    2: {
        "flux": (1, 8, 8),
        "flux2": (1, 8, 8),
        "qwenimage": (1, 8, 8),
        "wan": (3, 8, 8),
        "ltx": (2, 8, 8),
        "ltx2": (2, 8, 8),
    },
    4: {
        "flux": (1, 16, 8),
        "flux2": (1, 16, 8),
        "qwenimage": (1, 16, 8),
        "wan": (4, 8, 8),
        "ltx": (2, 8, 8),
        "ltx2": (2, 8, 8),
    },
}
MODES = {2: ("ulysses", "ring"), 4: ("both",)}


def spawn(world: int, out: Path) -> dict[int, dict]:
    """Every rank's records of one run of the worker over ``world`` forked processes."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(WORKER.parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, str(WORKER), "--world", str(world), str(out)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=SPAWN_SECONDS)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the worker over {world} processes ran past {SPAWN_SECONDS} s:\n{(e.stderr or '')[-4000:]}")
    if proc.returncode:
        pytest.fail(f"the worker over {world} processes failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """World size -> rank -> case -> record; each world size spawned once, when first needed."""
    cache: dict[int, dict[int, dict]] = {}

    def get(world: int) -> dict[int, dict]:
        if world not in cache:
            cache[world] = spawn(world, tmp_path_factory.mktemp(f"cp{world}"))
        return cache[world]

    return get


def records(runs, world: int, name: str) -> list[dict]:
    """Case ``name``'s record on every rank, each checked to have run."""
    ranks = runs(world)
    found = [ranks[r].get(name) for r in sorted(ranks)]
    assert all(found), f"case {name} missing from a rank's records"
    for rank, record in enumerate(found):
        assert record["ok"], f"rank {rank}: {record['error']}\n{record.get('trace', '')}"
    return found


def merged_length(grid: list[int]) -> int:
    """Tokens left from one shard of ``grid`` at ratio 0.5 with the default tiles."""
    t, h, w = grid
    return make_layout(h, w, (1, *ToMAConfig().tile), 0.5, t=t).num_merged


def check_lengths(family: str, recs: list[dict]) -> None:
    """Every rank's self-attention ran on the same merged length, the one its shard's
    layout keeps, in every merged call."""
    queries = {r["cp_queries"] for r in recs}
    assert len(queries) == 1, f"ranks saw different query counts: {[r['cp_queries'] for r in recs]}"
    assert len({r["kept"] for r in recs}) == 1
    world, tokens, span, whole, _ = recs[0]["shard"]
    kept = recs[0]["kept"]
    if span is None:  # a grid of its own: its layout's
        assert kept == merged_length(recs[0]["grid"])
    else:  # the documented rule: together, within P - 1 of what one process keeps of the whole grid
        assert merged_length(whole) - (world - 1) <= world * kept <= merged_length(whole)
    assert recs[0]["cp_queries_unmerged"] - recs[0]["cp_queries"] == MERGED_CALLS[family] * (tokens - kept)


CASES = [
    (world, family, mode, order)
    for world in (2, 4)
    for family in FAMILIES
    for mode in MODES[world]
    for order in (("cp_first", "toma_first") if world == 2 or family == "wan" else ("cp_first",))
]


@pytest.mark.parametrize("world,family,mode,order", CASES)
def test_aligned_shards_merge_as_one_process(runs, world, family, mode, order):
    recs = records(runs, world, f"aligned/{family}/{mode}/{order}")
    for rank, r in enumerate(recs):
        assert r["unmerged_cp_gap"] <= REORDERING, "diffusers' own CP differs from one process here"
        assert r["shard"][0] == world and r["shard"][2] is None and r["grid"] == list(SHARDS[world][family])
        assert r["gap_to_single"] <= REORDERING, f"rank {rank}"
        assert r["gap_to_unmerged_cp"] > 1e-3, "nothing merged"
        assert r["removed_equals_unmerged_cp"], "remove_toma under CP is not unmerged CP"
        assert r["warnings"] == []
    check_lengths(family, recs)
    # the shards' merged lengths add up to single-process ToMA's
    assert world * merged_length(recs[0]["grid"]) == merged_length(list(GRIDS[world][family]))


@pytest.mark.parametrize("case,family", [("batch2/flux/ulysses", "flux"), ("batch2/wan/ring", "wan")])
def test_two_samples_merge_as_one_process(runs, case, family):
    recs = records(runs, 2, case)
    for r in recs:
        assert r["gap_to_single"] <= REORDERING and r["gap_to_unmerged_cp"] > 1e-3 and r["removed_equals_unmerged_cp"]
    assert len({r["cp_queries"] for r in recs}) == 1


def check_spread_lengths(recs: list[dict]) -> None:
    """MiniMax H3's shards: each holds its part of the prefix (text, audio), spread over the
    ranks, then its run of the video; every rank's merged sequence has the same length, and
    together they keep within P - 1 of what one process keeps of the whole video."""
    world, _, _, whole, leads = recs[0]["shard"]
    assert [r["shard"][4] for r in recs] == [leads] * world and max(leads) - min(leads) <= 1
    assert [r["shard"][2] for r in recs] == [list(span) for span in lead_spans(tuple(leads), math.prod(whole))]
    assert len({lead + r["kept"] for lead, r in zip(leads, recs)}) == 1, "ranks merged to different lengths"
    assert len({r["cp_queries"] for r in recs}) == 1
    assert merged_length(whole) - (world - 1) <= sum(r["kept"] for r in recs) <= merged_length(whole)
    for r in recs:
        assert r["cp_queries_unmerged"] - r["cp_queries"] == MERGED_CALLS["minimax-h3"] * (r["shard"][1] - r["kept"])


@pytest.mark.parametrize(
    "world,mode,order",
    [
        (2, "ulysses", "cp_first"),
        (2, "ulysses", "toma_first"),
        (2, "ring", "cp_first"),
        (2, "ring", "toma_first"),
        (4, "both", "cp_first"),
    ],
)
def test_minimax_h3_spread_shards_merge_as_one_process(runs, world, mode, order):
    # diffusers splits MiniMax H3's packed [text; audio; video] sequence as it is; toma moves
    # its rows at the call so that each rank gets an equal part of the prefix, then a run
    # of the video (8 prefix rows and 2 frames of 8x8: one frame, or 4 rows, per rank).
    # The video runs are tile-aligned, so this is single-process ToMA's maths; outputs come
    # back in the model's order, as the modality indices were moved with the rows
    recs = records(runs, world, f"aligned/minimax-h3/{mode}/{order}")
    for r in recs:
        assert r["unmerged_cp_gap"] <= REORDERING, "diffusers' own CP differs from one process here"
        assert r["gap_to_single"] <= REORDERING and r["gap_to_unmerged_cp"] > 1e-3
        assert r["removed_equals_unmerged_cp"] and r["warnings"] == []
    assert recs[0]["shard"][4] == [8 // world] * world
    check_spread_lengths(recs)


@pytest.mark.parametrize("world,mode", [(2, "ulysses"), (2, "ring"), (4, "both")])
def test_minimax_h3_uneven_prefix_merges_to_equal_lengths(runs, world, mode):
    # 9 prefix rows and a 9x7 video: the ranks hold 5 and 4 prefix rows (3, 2, 2, 2 at P=4),
    # so their video runs differ in length and each keeps what brings it to the common length
    recs = records(runs, world, f"unaligned/minimax-h3/{mode}")
    assert recs[0]["shard"][3] == [1, 9, 7] and recs[0]["shard"][4] == ([5, 4] if world == 2 else [3, 2, 2, 2])
    for r in recs:
        assert r["gap_to_unmerged_cp"] > 1e-3 and r["removed_equals_unmerged_cp"] and r["warnings"] == []
    check_spread_lengths(recs)


@pytest.mark.parametrize("world,mode", [(2, "ulysses"), (2, "ring"), (4, "both")])
def test_ltx2_tables_from_the_pipelines_coords_follow_each_shard(runs, world, mode):
    # LTX-2 with video_coords (its pipelines pass them): diffusers splits the rope's output,
    # whose rows toma put in each shard's tile order; the audio stream passes whole (the
    # calls run with isolate_modalities, as diffusers 0.42.1's plan needs: tests/cp_worker.py)
    recs = records(runs, world, f"coords/ltx2/{mode}")
    for r in recs:
        assert r["gap_to_single"] <= REORDERING and r["gap_to_unmerged_cp"] > 1e-3
        assert r["removed_equals_unmerged_cp"] and r["warnings"] == []
    check_lengths("ltx2", recs)


@pytest.mark.parametrize("world,mode", [(2, "ulysses"), (2, "ring"), (4, "both")])
def test_unaligned_shards_merge_to_equal_lengths(runs, world, mode):
    # Wan's 6-row frames in 9-row bands: a tile spans a frame boundary
    recs = records(runs, world, f"unaligned/wan/{mode}")
    assert recs[0]["grid"] == [1, 9, 8]
    for r in recs:
        assert r["gap_to_unmerged_cp"] > 1e-3 and r["removed_equals_unmerged_cp"] and r["warnings"] == []
    check_lengths("wan", recs)


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_unaligned_flux_bands_merge_to_equal_lengths(runs, mode):
    recs = records(runs, 2, f"unaligned/flux/{mode}")  # 3-row bands of a 6x8 grid
    assert recs[0]["grid"] == [1, 3, 8]
    for r in recs:
        assert r["gap_to_unmerged_cp"] > 1e-3 and r["removed_equals_unmerged_cp"]
    check_lengths("flux", recs)


MIDROW = [(2, family, mode) for family in FAMILIES for mode in MODES[2]] + [(4, "flux", "both"), (4, "wan", "both")]


@pytest.mark.parametrize("world,family,mode", MIDROW)
def test_mid_row_shards_merge_to_equal_lengths(runs, world, family, mode):
    # a 9x8 grid: 4.5 rows per rank at P=2, 2.25 at P=4; tiles the cuts go through are masked
    recs = records(runs, world, f"midrow/{family}/{mode}")
    assert [r["shard"][2] for r in recs] == [
        [i * recs[0]["shard"][1], (i + 1) * recs[0]["shard"][1]] for i in range(world)
    ]
    assert recs[0]["shard"][3] == [1, 9, 8]
    for r in recs:
        assert r["gap_to_unmerged_cp"] > 1e-3 and r["removed_equals_unmerged_cp"] and r["warnings"] == []
    check_lengths(family, recs)


@pytest.mark.parametrize("world,mode", [(2, "ulysses"), (2, "ring"), (4, "both")])
def test_flux_reads_the_whole_ids_so_shards_within_a_row_merge(runs, world, mode):
    recs = records(runs, world, f"subrow/flux/{mode}")  # 4 tokens per rank of a 1 x 4P grid
    for r in recs:
        assert r["gap_to_unmerged_cp"] > 1e-3 and r["removed_equals_unmerged_cp"] and r["warnings"] == []
    check_lengths("flux", recs)


@pytest.mark.parametrize("world,mode", [(2, "ulysses"), (2, "ring"), (4, "both")])
def test_flux_from_a_shard_alone(runs, world, mode):
    # ids sliced from a longer tensor: each rank reads the grid from its own shard's ids,
    # which a shard of 2.25 or 4.5 rows can tell and one within a row cannot, alike on every rank
    recs = records(runs, world, f"midrow-sliced/flux/{mode}")
    assert recs[0]["shard"][3] == [1, 9, 8]
    for r in recs:
        assert r["gap_to_unmerged_cp"] > 1e-3 and r["warnings"] == []
    check_lengths("flux", recs)
    for r in records(runs, world, f"subrow-sliced/flux/{mode}"):
        assert r["equals_unmerged_cp"], "a forward that merges nothing must be unmerged CP's, bitwise"
        assert any("context parallelism" in w and "unmerged" in w for w in r["warnings"]), r["warnings"]


@pytest.mark.parametrize("world,mode", [(2, "ulysses"), (2, "ring"), (4, "both")])
def test_kontext_references_under_cp_run_unmerged_on_every_rank(runs, world, mode):
    # the reference's tokens are split with the image's; every rank reads the whole ids and
    # sees them, so none merges (one merging alone would break the exchanges' equal lengths)
    for r in records(runs, world, f"kontext/flux/{mode}"):
        assert r["equals_unmerged_cp"]
        assert any("conditioning" in w and "context parallelism" in w for w in r["warnings"]), r["warnings"]


@pytest.mark.parametrize("world,mode", [(2, "ulysses"), (2, "ring"), (4, "both")])
@pytest.mark.parametrize("family", ["wan", "flux", "ltx2", "minimax-h3"])
def test_proportional_attention_under_cp_merges_as_one_process(runs, world, mode, family):
    # Under CP the backend rule folds the bias into the keys (one more channel; the values'
    # extra channel is 0): ring attention's exchanges carry it with the keys and Ulysses'
    # with the heads, so each rank's keys keep their own log masses. A float mask would be
    # applied by ring attention to every rank's keys alike: wrong. Tile-aligned shards, so
    # the same maths as one process up to float reordering.
    for r in records(runs, world, f"proportional/{family}/{mode}/compare"):
        assert r["gap_to_single"] <= REORDERING and r["gap_to_unmerged_cp"] > 1e-3


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_shard_modes_are_refused(runs, world):
    for r in records(runs, world, "anything/wan/cp_first"):
        assert r["raised"] == "apply_toma" and "context parallelism" in r["error"] and "_anything" in r["error"]


@pytest.mark.parametrize("case", ["triton/wan/ulysses/aligned", "triton/wan/ring/midrow"])
def test_triton_path_under_cp(runs, case):
    # the kernels (Triton's interpreter) on each rank's shard, a grid and a span; on CPU
    # every rank's device is "cpu", so this shows the path runs, not which GPU it picks
    recs = records(runs, 2, case)
    for r in recs:
        assert r["kernels"] == ["merge", "plan", "unmerge"] and r["kernel_devices"] == ["cpu"]
        # the kernels compute the torch path's maths in another order: fp32 rounding
        assert r["gap_to_torch_path"] <= REORDERING
        assert r["gap_to_unmerged_cp"] > 1e-3 and r["removed_equals_unmerged_cp"]
    check_lengths("wan", recs)
    if case.endswith("aligned"):
        assert all(r["gap_to_single"] <= REORDERING for r in recs)


# ---- the rules, in this process ----


def _runs_of(grid: tuple[int, int, int], world: int) -> list[list[tuple[int, int, int]]]:
    t, h, w = grid
    tokens = [(f, r, c) for f in range(t) for r in range(h) for c in range(w)]
    n = len(tokens) // world
    return [tokens[i * n : (i + 1) * n] for i in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_grid_against_enumerated_shards(world):
    for t in (1, 2, 3, 5):
        for h in (1, 2, 3, 4, 6):
            for w in (1, 2, 3, 5, 8):
                grid = shard_grid((t, h, w), world)
                if t * h * w % world:
                    assert grid is None
                    continue
                shards = _runs_of((t, h, w), world)
                n = len(shards[0])
                whole_frames = all(len({f for f, _, _ in s}) * h * w == n for s in shards)
                rows = [sorted({(f, r) for f, r, _ in s}) for s in shards]
                whole_rows = all(len(rs) * w == n for rs in rows) and len(rows[0]) >= 2
                if whole_frames:
                    assert grid == (n // (h * w), h, w)
                elif whole_rows:
                    assert grid == (1, n // w, w)
                else:
                    assert grid is None, (t, h, w, world)


def _cp(ring: int = 1, ulysses: int = 1, **extra):
    return SimpleNamespace(
        ring_degree=ring, ulysses_degree=ulysses, ulysses_anything=False, ring_anything=False, **extra
    )


def test_refusals_name_context_parallelism():
    plain, proportional = ToMAConfig(), ToMAConfig(proportional_attention=True)
    assert refusal("wan", None, proportional) is None
    assert refusal("wan", _cp(ulysses=2), proportional) is None
    assert refusal("wan", _cp(ring=2), plain) is None
    assert refusal("wan", _cp(ring=2), proportional) is None  # the key channel travels with the keys
    assert refusal("wan", _cp(ring=2, ulysses=2), proportional) is None
    uneven = SimpleNamespace(ring_degree=2, ulysses_degree=1, ulysses_anything=False, ring_anything=True)
    for reason in (
        refusal("sd3", _cp(ulysses=2), plain),
        refusal("unet", _cp(ring=2), plain),
        refusal("flux", uneven, plain),
    ):
        assert reason is not None and "context parallelism" in reason


def test_apply_toma_and_forward_refuse_a_family_without_cp_support():
    # diffusers' SD3 has no _cp_plan; a user could pass one to enable_parallelism. The
    # parallel config is what toma reads, so it is set by hand here (no process group).
    from tiny_models import make_sd3, sd3_inputs

    model = make_sd3()
    model._parallel_config = SimpleNamespace(context_parallel_config=_cp(ulysses=2))
    with pytest.raises(ValueError, match="context parallelism"):
        toma.apply_toma(model, 0.5)
    model = make_sd3()
    toma.apply_toma(model, 0.5, blocks={"transformer_blocks": range(4)})
    model._parallel_config = SimpleNamespace(context_parallel_config=_cp(ulysses=2))
    with pytest.raises(ValueError, match="context parallelism"), torch.no_grad():
        model(**sd3_inputs(1, 16, 16))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_spread_prefix_against_enumeration(world):
    # a packed sequence [prefix; image] cut into equal shards after toma's move: each shard
    # holds a contiguous part of the prefix (sizes within one), then a contiguous run of the
    # image, and every row is in exactly one shard
    for prefix in range(0, 7):
        for tokens in range(1, 13):
            leads = spread_leads(prefix, tokens, world)
            n, fits = (prefix + tokens) // world, (prefix + tokens) % world == 0
            if not fits or -(-prefix // world) >= n:
                assert leads is None, (prefix, tokens, world)
                continue
            assert sum(leads) == prefix and max(leads) - min(leads) <= 1
            order = spread_order(leads, tokens)
            assert sorted(order.tolist()) == list(range(prefix + tokens))
            spans = lead_spans(leads, tokens)
            for r, shard in enumerate(order.view(world, n).tolist()):
                lead, (start, stop) = leads[r], spans[r]
                assert shard[:lead] == list(range(sum(leads[:r]), sum(leads[: r + 1])))
                assert shard[lead:] == list(range(prefix + start, prefix + stop))


@pytest.mark.parametrize("grid", [(1, 9, 7), (2, 8, 8), (3, 5, 6)])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_lead_target_keeps_equal_lengths_within_the_rule(grid, world):
    t, h, w = grid
    for prefix in range(0, 12):
        leads = spread_leads(prefix, t * h * w, world)
        if leads is None:
            continue
        for ratio in (0.25, 0.5, 0.75):
            spans, keep = lead_target(h, w, (1, 4, 4), ratio, leads, t=t)
            layouts = [
                make_span_layout(h, w, (1, 4, 4), ratio, span, t=t, target=keep - lead)
                for lead, span in zip(leads, spans)
            ]
            assert {lead + lay.num_merged for lead, lay in zip(leads, layouts)} == {keep}
            whole = make_layout(h, w, (1, 4, 4), ratio, t=t).num_merged
            if max(lead + lay.num_tiles for lead, lay in zip(leads, layouts)) <= (whole + prefix) // world:
                assert whole - (world - 1) <= sum(lay.num_merged for lay in layouts) <= whole
            if prefix == 0:  # no prefix: the equal-shard rule
                assert keep == shard_target(h, w, (1, 4, 4), ratio, world, t=t)


# ---- span layouts (shards cut inside a row), against enumeration ----

SPAN_GRIDS = [(1, 5, 4), (1, 9, 8), (2, 5, 7), (3, 6, 8)]


def _spans(tokens: int) -> list[tuple[int, int]]:
    return [(a, b) for a in range(0, tokens, 3) for b in range(a + 1, tokens + 1, 5)]


@pytest.mark.parametrize("grid", SPAN_GRIDS)
def test_span_layout_tiles_and_slots_against_enumeration(grid):
    t, h, w = grid
    tile = (1, 4, 4)
    whole = make_layout(h, w, tile, 0.5, t=t)
    tile_of = {
        (f * h + r) * w + c: (f * whole.gh + r // 4) * whole.gw + c // 4
        for f in range(t)
        for r in range(h)
        for c in range(w)
    }
    for start, stop in _spans(t * h * w):
        layout = make_span_layout(h, w, tile, 0.5, (start, stop), t=t)
        counts: dict[int, int] = {}
        for token in range(start, stop):
            counts[tile_of[token]] = counts.get(tile_of[token], 0) + 1
        assert layout.tiles == tuple(sorted(counts)) and layout.num_tokens == stop - start
        assert layout.keep == tuple(
            max(1, min(p, math.floor(p * 0.5 + 0.5))) for p in (counts[i] for i in layout.tiles)
        )
        mask = token_mask(layout)
        slots = slot_raster_index(layout).view(layout.num_tiles, layout.tile_area)
        assert mask.sum(1).tolist() == [counts[i] for i in layout.tiles]
        seen = sorted(int(v) for v in slots[mask])
        assert seen == list(range(stop - start)), "every token of the span in exactly one real slot"
        for row, number in enumerate(layout.tiles):
            assert all(tile_of[int(v) + start] == number for v in slots[row][mask[row]])
        x = torch.randn(2, stop - start, 3)
        assert torch.equal(from_tiles(to_tiles(x, layout), layout), x)


@pytest.mark.parametrize("grid", SPAN_GRIDS)
@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_span_shards_keep_equal_lengths_within_the_rule(grid, world):
    t, h, w = grid
    if t * h * w % world:
        return
    n = t * h * w // world
    for ratio in (0.25, 0.5, 0.75):
        target = shard_target(h, w, (1, 4, 4), ratio, world, t=t)
        layouts = [
            make_span_layout(h, w, (1, 4, 4), ratio, (r * n, (r + 1) * n), t=t, target=target) for r in range(world)
        ]
        assert {lay.num_merged for lay in layouts} == {target}
        for lay in layouts:
            real = token_mask(lay).sum(1).tolist()
            assert all(1 <= k <= p for k, p in zip(lay.keep, real))
        whole = make_layout(h, w, (1, 4, 4), ratio, t=t).num_merged
        touched = max(lay.num_tiles for lay in layouts)
        if touched <= whole // world:  # else every tile keeping one is more than the rule allows
            assert whole - (world - 1) <= world * target <= whole


def test_a_span_of_whole_tiles_merges_as_its_own_grid():
    # rows 4..11 of a 12x8 grid with 4x4 tiles: the span layout's tiles are the 8x8 grid's
    x = torch.randn(2, 64, 8)
    span = make_span_layout(12, 8, (4, 4), 0.5, (32, 96))
    own = make_layout(8, 8, (4, 4), 0.5)
    assert span.keep == own.keep
    plans = [
        build_plan(
            to_tiles(x, lay, layout_index(lay).gather_index),
            lay,
            x.dtype,
            selection="facility",
            temperature=0.1,
            index=layout_index(lay),
        )
        for lay in (span, own)
    ]
    torch.testing.assert_close(plans[0].merge(x), plans[1].merge(x), rtol=0, atol=1e-6)  # gather vs view: same sums
    assert torch.equal(plans[0].dest_tokens, plans[1].dest_tokens)


def test_unsplit_finds_the_whole_tensor_of_a_chunk_view_only():
    whole = torch.arange(24.0).view(12, 2) + 0
    for world in (2, 3, 4):
        for index, shard in enumerate(whole.chunk(world)):
            assert unsplit(shard, world, index, 0) is whole
            assert unsplit(shard, world, (index + 1) % world, 0) is None  # another rank's chunk
    grid = torch.arange(48.0).view(4, 4, 3)  # Flux's CPU ids: a reshape (a view) of their grid
    ids = grid.reshape(16, 3)
    for index, shard in enumerate(ids.chunk(2)):
        assert torch.equal(unsplit(shard, 2, index, 0), ids)
    expanded = whole[None].expand(3, -1, -1)  # FLUX.2's (B, N, 4) ids, a view of (N, 4)
    assert unsplit(expanded.chunk(2, dim=1)[1], 2, 1, 1) is whole
    assert unsplit(whole.chunk(2)[0].clone(), 2, 0, 0) is None  # a copy
    assert unsplit(torch.cat([whole, whole])[:12].chunk(2)[0], 2, 0, 0) is None  # a slice of a longer tensor


@pytest.mark.parametrize("family", families("context_parallel"))
def test_each_family_the_matrix_marks_merges_under_context_parallelism(runs, family):
    # docs/compatibility.md's ✔ cells: tile-aligned shards over two Ulysses ranks merge as one
    # process does (a family in toma.adapters.parallel.SUPPORTED that tests/cp_worker.py cannot
    # build has no records, and fails here)
    recs = records(runs, 2, f"aligned/{family}/ulysses/cp_first")
    assert len(recs) == 2
    for r in recs:
        assert r["gap_to_single"] <= REORDERING and r["gap_to_unmerged_cp"] > 1e-3
        assert r["removed_equals_unmerged_cp"] and r["warnings"] == []
