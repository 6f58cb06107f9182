"""Rotary tables that nest (JoyImage's ``((cos, sin), text)``): gathered to merged tokens
tensor by tensor, as the same tensors are when passed flat; and tables no module of the
model makes (CogVideoX's, from its pipeline), put in the blocks' order at each block's call
(``FamilySpec.block_rope``; JoyImage's: tests/adapters/test_joyimage.py)."""

from __future__ import annotations

import torch

import toma
from tests.cases import tiled_and_raster
from tests.tiny_models import cogvideox_inputs, make_cogvideox
from toma.adapters.merging import MergedCall, _gather_rotary
from toma.adapters.spec import Rotary
from toma.adapters.state import PlanCache
from toma.config import ToMAConfig

GRID = (1, 4, 4)
N, EXTRA, TEXT, D = 16, 3, 5, 6


def merged_call(tiled: bool = False) -> MergedCall:
    """A call's merge at ratio 0.5, batch 2, each sample with its own plan."""
    cache = PlanCache(ToMAConfig(ratio=0.5, tile_size=2))
    cache.begin_forward(GRID, 0.5)
    plan = cache.get(torch.randn(2, N, 8, generator=torch.Generator().manual_seed(0)), GRID, group=GRID, ratio=0.5)
    assert not torch.equal(plan.dest_tokens[0], plan.dest_tokens[1])
    return MergedCall(plan, tiled, EXTRA, N)


def tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(rows, D, generator=g) for rows in (EXTRA + N, EXTRA + N, TEXT))


def test_shared_nested_tables_gather_as_the_same_tensors_passed_flat():
    cos, sin, text = tables()
    call = merged_call()
    nested = Rotary("image_rotary_emb", None, shared=True, items=(0,))
    flat = Rotary("flat_rotary_emb", None, shared=True, items=(0, 1))  # the plan memoizes by name
    _, got, samples = _gather_rotary(nested, call, (), {"image_rotary_emb": ((cos, sin), text)})
    _, _, flat_samples = _gather_rotary(flat, call, (), {"flat_rotary_emb": (cos, sin, text)})
    assert samples is not None and len(samples) == 2  # plans of their own: one call per sample
    assert got["image_rotary_emb"] is samples[0]
    dest = call.plan.dest_tokens
    for b, ((c, s), t) in enumerate(samples):
        assert t is text  # not an image item: passes as it is
        assert torch.equal(c, flat_samples[b][0]) and torch.equal(s, flat_samples[b][1])
        # brute force: the conditioning rows whole, then the rows of the sample's destinations
        assert torch.equal(c, torch.cat([cos[:EXTRA], torch.stack([cos[EXTRA + int(i)] for i in dest[b]])]))


def test_per_batch_nested_tables_gather_each_tensor_and_pass_none():
    cos, sin, _ = tables()
    call = merged_call()
    seen = []

    def gather(table, dest):
        seen.append(table)
        return table[dest]

    rotary = Rotary("rope", 1, gather=gather, items=(0,))
    args, _, samples = _gather_rotary(rotary, call, ("x", ((cos, (sin, None)), None)), {})
    assert samples is None  # one call for the batch
    (c, (s, none)), text = args[1]
    assert none is None and text is None
    assert [t is u for t, u in zip(seen, (cos, sin))] == [True, True]
    assert torch.equal(c, cos[call.plan.dest_tokens]) and torch.equal(s, sin[call.plan.dest_tokens])


def test_flat_tables_gather_as_before():
    # a family with tensor items (QwenImage's (image, text)) takes the same path as ever
    cos, _, text = tables()
    call = merged_call()
    rotary = Rotary("image_rotary_emb", None, shared=True, items=(0,))
    _, _, samples = _gather_rotary(rotary, call, (), {"image_rotary_emb": (cos, text)})
    for b, (c, t) in enumerate(samples):
        assert t is text
        assert torch.equal(c, torch.cat([cos[:EXTRA], cos[EXTRA:][call.plan.dest_tokens[b]]]))


def test_cogvideox_unmerged_blocks_in_tile_order_keep_the_pipelines_positions(monkeypatch):
    # CogVideoX-5B's tables come from the pipeline in raster order. Blocks 0 and 1 run
    # unmerged on tokens in tile order, block 2 merged (as the default skips the first 5):
    # each block must get the tables in tile order. Against raster order (the same plans),
    # attention sums its keys in another order, a few float32 ulps per op, under 1e-5
    # through this model; gathering them by raster index in the merged block only left the
    # unmerged blocks ~5e-2 off
    model, kw = make_cogvideox(layers=3), cogvideox_inputs(2, 1, 16, 16)
    toma.apply_toma(model, ratio=0.5, blocks={"transformer_blocks": (2,)})
    tiled, raster = tiled_and_raster(model, kw, monkeypatch)
    torch.testing.assert_close(tiled, raster, rtol=1e-4, atol=1e-5)
