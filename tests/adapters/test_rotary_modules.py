"""Several rotary modules and sites per block (LTX-2's self-attention and audio-to-video
tables): each module's tables follow the tokens at its own sequence dimension, tables whose
tokens are the second-to-last dimension ("split" layout, heads first) gather as the
``(B, N, D)`` ones do, and two sites that take tables under one keyword each get their own
rows from the plan they share."""

from __future__ import annotations

import pytest
import torch

from toma.adapters.engine import RotaryToTileOrder, order_hooks
from toma.adapters.merging import MergedCall, _gather_rotary
from toma.adapters.spec import FamilySpec, RopeModule, Rotary, gather_rows, gather_token_rows
from toma.adapters.state import PlanCache, TileState
from toma.config import ToMAConfig

GRID = (1, 4, 4)
N, H, D = 16, 3, 5


def merged_call(tiled: bool = False) -> MergedCall:
    """A call's merge at ratio 0.5, batch 2, each sample with its own plan."""
    cache = PlanCache(ToMAConfig(ratio=0.5, tile_size=2))
    cache.begin_forward(GRID, 0.5)
    plan = cache.get(torch.randn(2, N, 8, generator=torch.Generator().manual_seed(0)), GRID, group=GRID, ratio=0.5)
    assert not torch.equal(plan.dest_tokens[0], plan.dest_tokens[1])
    return MergedCall(plan, tiled, 0, N)


@pytest.mark.parametrize("table_batch", [1, 2])
@pytest.mark.parametrize("dest_batch", [1, 2])
def test_split_tables_gather_the_destinations_rows(table_batch, dest_batch):
    g = torch.Generator().manual_seed(1)
    table = torch.randn(table_batch, H, N, D, generator=g)
    dest = torch.stack([torch.randperm(N, generator=g)[:7] for _ in range(dest_batch)])
    got = gather_token_rows(table, dest)
    batch = max(table_batch, dest_batch)
    assert got.shape == (batch, H, 7, D)
    for b in range(batch):  # brute force, row by row
        rows = table[0 if table_batch == 1 else b]
        idx = dest[0 if dest_batch == 1 else b]
        for h in range(H):
            assert torch.equal(got[b, h], torch.stack([rows[h, int(i)] for i in idx]))
    # the (B, N, D) layout is gather_rows'
    flat = table[:, 0]
    assert torch.equal(gather_token_rows(flat, dest), gather_rows(flat, dest))


def test_gather_token_rows_names_the_layouts_it_takes():
    with pytest.raises(ValueError, match=r"\(B, N, D\) or \(B, H, N, D\)"):
        gather_token_rows(torch.zeros(2, N), torch.zeros(1, 3, dtype=torch.long))


def test_two_sites_with_one_keyword_get_their_own_tables():
    # every block's site gathers its tables once per plan; two sites of a block that share
    # the plan and the keyword but get other tables (LTX-2's attn1 and audio-to-video
    # attention, query_rotary_emb both) must not get each other's: once they did
    call = merged_call()
    rotary = Rotary("query_rotary_emb", None, gather_rows)
    g = torch.Generator().manual_seed(2)
    first, second = torch.randn(2, N, D, generator=g), torch.randn(2, N, 2 * D, generator=g)
    _, a, _ = _gather_rotary(rotary, call, (), {"query_rotary_emb": first}, site="attn1")
    _, b, _ = _gather_rotary(rotary, call, (), {"query_rotary_emb": second}, site="audio_to_video_attn")
    dest = call.plan.dest_tokens
    assert torch.equal(a["query_rotary_emb"], gather_rows(first, dest))
    assert torch.equal(b["query_rotary_emb"], gather_rows(second, dest))
    # the next block's same site reuses its gather
    _, again, _ = _gather_rotary(rotary, call, (), {"query_rotary_emb": first}, site="attn1")
    assert again["query_rotary_emb"] is a["query_rotary_emb"]


class Ropes(torch.nn.Module):
    """Two rotary modules: one of (B, N, D) tables, one of (B, H, N, D) ones."""

    def __init__(self) -> None:
        super().__init__()
        self.rope = torch.nn.Identity()
        self.cross_rope = torch.nn.Identity()
        self.proj_in = torch.nn.Identity()
        self.norm_out = torch.nn.Identity()
        self.blocks = torch.nn.ModuleList()


def spec(tables) -> FamilySpec:
    return FamilySpec(
        name="toy",
        classes=("Ropes",),
        stacks=("blocks",),
        sites=lambda stack, block: [],
        grid=lambda model, call: GRID,
        enter=("output", "proj_in"),
        leave="norm_out",
        tables=tables,
    )


def test_tables_take_one_module_or_several():
    several = spec((RopeModule("rope", -2), RopeModule("cross_rope", -2)))
    model = Ropes()
    _, hooks = order_hooks(spec(()), model, PlanCache(ToMAConfig(ratio=0.5)))
    assert not [hook for _, hook in hooks if isinstance(hook, RotaryToTileOrder)]
    _, hooks = order_hooks(several, model, PlanCache(ToMAConfig(ratio=0.5)))
    rotary = {module: hook for module, hook in hooks if isinstance(hook, RotaryToTileOrder)}
    assert set(rotary) == {model.rope, model.cross_rope}
    assert all(hook.seq_dim == -2 for hook in rotary.values())


def test_each_layout_is_put_in_tile_order_at_its_token_dimension():
    # the same rows laid out (B, N, D) and (B, H, N, D): both in tile order at dim -2
    cache = PlanCache(ToMAConfig(ratio=0.5, tile_size=2))
    order = TileState(cache)
    order.layout = cache.tile_order_layout(GRID, torch.device("cpu"))
    assert order.layout is not None
    g = torch.Generator().manual_seed(3)
    flat = torch.randn(2, N, D, generator=g)
    split = torch.stack([flat * (h + 1) for h in range(H)], dim=1)  # (B, H, N, D)
    hook = RotaryToTileOrder(order, -2)
    (tiled_flat, tiled_split) = hook.post_forward(None, (flat, split))
    assert not torch.equal(tiled_flat, flat)
    assert torch.equal(tiled_flat, order.convert(flat, enter=True))  # the tokens' own order
    for h in range(H):
        assert torch.equal(tiled_split[:, h], tiled_flat * (h + 1))
