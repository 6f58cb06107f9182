"""UNet adapter on tiny SDXL-like and SD-1.5-like models."""

from __future__ import annotations


import pytest
import torch

import toma
from tests.tiny_models import make_sd15_unet, make_sdxl_unet, unet_inputs
from toma.adapters.ledger import Ledger


def run(unet, **kw):
    with torch.no_grad():
        return unet(**kw).sample


def record_tokens(unet, part="attn1"):
    """Token counts reaching each ``part``'s query projection (inside the merged region)."""
    seen: list[int] = []
    handles = [
        m.to_q.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))
        for name, m in unet.named_modules()
        if name.endswith(part)
    ]
    return seen, handles


@pytest.mark.parametrize("maker,sdxl", [(make_sdxl_unet, True), (make_sd15_unet, False)])
def test_ratio_zero_and_remove_are_bitwise_identical(maker, sdxl):
    unet = maker()
    kw = unet_inputs(2, 16, 16, sdxl)
    ref = run(unet, **kw)
    toma.apply_toma(unet, ratio=0.0, merge_crossattn=True, merge_mlp=True)
    assert torch.equal(run(unet, **kw), ref)
    toma.apply_toma(unet, ratio=0.5, merge_crossattn=True, merge_mlp=True)
    assert not torch.equal(run(unet, **kw), ref)
    assert toma.remove_toma(unet) is True
    assert torch.equal(run(unet, **kw), ref)
    assert toma.remove_toma(unet) is False
    assert toma.get_toma(unet) is None


def test_sdxl_default_merges_highest_attention_level(sdxl_unet):
    patch = toma.apply_toma(sdxl_unet, ratio=0.5)
    assert patch.patched and all(p.downsample == 2 for p in patch.patched)
    assert all(p.name.endswith("attn1") for p in patch.patched)
    kw = unet_inputs(1, 16, 16, True)
    seen, handles = record_tokens(sdxl_unet)
    out = run(sdxl_unet, **kw)
    assert out.shape == kw["sample"].shape
    # every attention level is at downsample 2 here: 8x8 = 64 tokens, ratio 0.5 -> 32
    assert seen and all(n == 32 for n in seen)
    for h in handles:
        h.remove()


def test_sd15_levels_and_token_count(sd15_unet):
    kw = unet_inputs(1, 16, 16, False)
    patch = toma.apply_toma(sd15_unet, ratio=0.5, tile_size=4)
    assert {p.downsample for p in patch.patched} == {1}
    assert any("downsample 2" in s.reason for s in patch.skipped)  # the mid block
    seen, handles = record_tokens(sd15_unet)
    run(sd15_unet, **kw)
    assert sorted(set(seen)) == [64, 128]  # mid block unmerged (64), top level 256 -> 128
    toma.apply_toma(sd15_unet, ratio=0.75, levels=2)
    seen.clear()
    run(sd15_unet, **kw)
    assert sorted(set(seen)) == [16, 64]
    for h in handles:
        h.remove()


def test_options_merge_crossattn_queries_and_mlp(sd15_unet):
    kw = unet_inputs(1, 16, 16, False)
    patch = toma.apply_toma(sd15_unet, ratio=0.5, merge_attn=False, merge_crossattn=True, merge_mlp=True)
    parts = {p.name.rsplit(".", 1)[1] for p in patch.patched}
    assert parts == {"attn2", "ff"}
    seen, handles = record_tokens(sd15_unet, "attn2")
    ff_seen: list[int] = []
    handles += [
        m.net[0].register_forward_hook(lambda mod, a, o: ff_seen.append(a[0].shape[1]))
        for name, m in sd15_unet.named_modules()
        if name.endswith(".ff") and "down_blocks.0" in name
    ]
    run(sd15_unet, **kw)
    assert 128 in seen and ff_seen == [128]
    for h in handles:
        h.remove()


def test_mlp_levels_merge_the_mlp_of_the_named_levels_only(sd15_unet):
    # levels 1-2 merge attention; mlp_levels=(2,) merges the MLP at the deeper level only
    kw = unet_inputs(1, 16, 16, False)
    patch = toma.apply_toma(sd15_unet, ratio=0.5, levels=2, merge_mlp=True, mlp_levels=(2,))
    mlps = sorted(p.where for p in patch.patched if p.name.endswith(".ff"))
    attns = {p.where for p in patch.patched if p.name.endswith(".attn1")}
    assert attns == {"downsample 1", "downsample 2"} and set(mlps) == {"downsample 2"}
    ff_seen: dict[str, int] = {}
    handles = [
        m.net[0].register_forward_hook(lambda mod, a, o, name=name: ff_seen.__setitem__(name, a[0].shape[1]))
        for name, m in sd15_unet.named_modules()
        if name.endswith(".ff")
    ]
    run(sd15_unet, **kw)
    for h in handles:
        h.remove()
    # 16x16 tokens at level 1 stay whole in the MLP; level 2's 8x8 are halved
    assert ff_seen["down_blocks.0.attentions.0.transformer_blocks.0.ff"] == 256
    assert ff_seen["mid_block.attentions.0.transformer_blocks.0.ff"] == 32
    with pytest.raises(ValueError, match="attention level"):
        toma.apply_toma(sd15_unet, ratio=0.5, levels=5, merge_mlp=True, mlp_levels=(4,))


@pytest.mark.parametrize("h,w", [(16, 12), (10, 14), (9, 13)])
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_non_square_non_divisible_grids_and_batches(sd15_unet, h, w, batch):
    kw = unet_inputs(batch, h, w, False)
    ref = run(sd15_unet, **kw)
    patch = toma.apply_toma(sd15_unet, ratio=0.5)
    seen, handles = record_tokens(sd15_unet)
    out = run(sd15_unet, **kw)
    for hd in handles:
        hd.remove()
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert not torch.equal(out, ref)
    layout = patch.cache.layout(h, w)
    assert layout.num_merged in seen
    assert abs(layout.num_merged - h * w * 0.5) <= layout.num_tiles / 2 + 1
    toma.remove_toma(sd15_unet)
    assert torch.equal(run(sd15_unet, **kw), ref)


def test_batch_elements_get_their_own_plan(sd15_unet):
    kw = unet_inputs(2, 16, 16, False)
    other = unet_inputs(2, 16, 16, False, seed=7)["sample"]
    swap0 = {**kw, "sample": torch.stack([other[0], kw["sample"][1]])}
    toma.apply_toma(sd15_unet, ratio=0.5)
    base = run(sd15_unet, **kw)
    # per-element plans: element 1's output does not depend on element 0
    assert torch.allclose(base[1], run(sd15_unet, **swap0)[1], atol=1e-6)
    patch = toma.apply_toma(sd15_unet, ratio=0.5, share_batch_plan=True)
    shared = run(sd15_unet, **kw)
    plans = [p for _, p in patch.cache._plans.values()]
    assert plans and all(p.merge_w.shape[0] == 1 for p in plans)
    assert torch.allclose(shared[0], base[0], atol=1e-6)
    assert not torch.allclose(shared[1], run(sd15_unet, **swap0)[1], atol=1e-3)


def record_builds(patch) -> list[int]:
    """The step count at every fresh plan the patch's cache builds (filled as the model runs)."""
    built: list[int] = []
    original = patch.cache.get

    def counting_get(x, grid, group, **kw):
        before = dict(patch.cache._plans)
        plan = original(x, grid, group, **kw)
        if all(plan is not p for _, p in before.values()):
            built.append(patch.cache.step)
        return plan

    patch.cache.get = counting_get
    return built


def test_plan_reused_within_step_and_recomputed_across_steps(sd15_unet):
    kw = unet_inputs(1, 16, 16, False)
    patch = toma.apply_toma(sd15_unet, ratio=0.5, recompute_every=2)
    built = record_builds(patch)
    for t in (900, 800, 700, 600):
        run(sd15_unet, **{**kw, "timestep": torch.tensor(t)})
    assert built == [0, 2]  # one plan per group, refreshed every 2 steps
    run(sd15_unet, **{**kw, "timestep": torch.tensor(900)})  # a new run starts fresh
    assert built == [0, 2, 0]
    run(sd15_unet, **{**unet_inputs(1, 12, 16, False), "timestep": torch.tensor(800)})  # new grid
    assert built == [0, 2, 0, 0]


def test_two_calls_per_step_count_as_one_step(sd15_unet):
    # Wan's pipeline (and others) run the conditional and unconditional passes as two calls
    # with the same timestep. Each repeat used to start a new run: recompute_every > 1 then
    # rebuilt plans at every call, and step counts restarted at 0.
    kw = unet_inputs(1, 16, 16, False)
    patch = toma.apply_toma(sd15_unet, ratio=0.5, recompute_every=2)
    built, steps = record_builds(patch), []
    for t in (900, 900, 800, 800, 700, 700):
        run(sd15_unet, **{**kw, "timestep": torch.tensor(t)})
        steps.append(patch.cache.step)
    assert steps == [0, 0, 1, 1, 2, 2]
    assert built == [0, 2]


@pytest.mark.parametrize("every", [1, 2])
def test_step_window_merges_only_its_steps(sd15_unet, every):
    kw = unet_inputs(2, 16, 16, False)
    timesteps = (900, 900, 800, 800, 700, 700, 600, 600)  # two calls per step, as Wan's pipeline
    base = [run(sd15_unet, **{**kw, "timestep": torch.tensor(t)}) for t in timesteps]
    toma.apply_toma(sd15_unet, ratio=0.5)  # fresh plans at every call
    merged = [run(sd15_unet, **{**kw, "timestep": torch.tensor(t)}) for t in timesteps]
    toma.remove_toma(sd15_unet)
    patch = toma.apply_toma(sd15_unet, ratio=0.5, recompute_every=every, start_step=1, stop_step=3)
    assert "merging on denoising steps 1 to 2" in patch.summary()
    seen, handles = record_tokens(sd15_unet)
    windowed = []
    for t in timesteps:
        seen.clear()
        windowed.append(run(sd15_unet, **{**kw, "timestep": torch.tensor(t)}))
        # the first level's 16x16 tokens are halved inside the window only (the 8x8 level never)
        expected = [128, 64, 128, 128] if t in (800, 700) else [256, 64, 256, 256]
        assert seen == expected, (t, seen)
    for h in handles:
        h.remove()
    for i, t in enumerate(timesteps):
        if t in (800, 700):
            # inside the window the merge is ToMA's own; the window's first call builds
            # fresh plans whatever recompute_every, later ones reuse them when every > 1
            if every == 1 or i == 2:
                assert torch.equal(windowed[i], merged[i])
            assert not torch.allclose(windowed[i], base[i], atol=1e-4)
        else:
            assert torch.equal(windowed[i], base[i])  # outside: bitwise unmerged


@pytest.mark.parametrize("every,window", [(1, {}), (2, {}), (1, {"start_step": 1}), (1, {"stop_step": 5})])
def test_timestep_read_only_when_plans_outlive_a_step(sd15_unet, monkeypatch, every, window):
    # reading a GPU timestep synchronises with the host: fresh plans every step, with no
    # step window, don't need it
    reads = []
    monkeypatch.setattr("toma.adapters.base.timestep_value", lambda t: reads.append(t) or 1.0)
    toma.apply_toma(sd15_unet, ratio=0.5, recompute_every=every, **window)
    run(sd15_unet, **unet_inputs(1, 16, 16, False))
    assert len(reads) == (every > 1 or bool(window))


def test_patch_survives_dtype_and_device_moves():
    unet = make_sdxl_unet()
    kw = unet_inputs(2, 16, 16, True)
    toma.apply_toma(unet, ratio=0.5)
    unet.to("cpu").to(torch.bfloat16)
    kw16 = unet_inputs(2, 16, 16, True, dtype=torch.bfloat16)
    seen, handles = record_tokens(unet)
    out = run(unet, **kw16)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert seen and all(n == 32 for n in seen)
    for h in handles:
        h.remove()
    unet.to(torch.float32)
    assert toma.get_toma(unet) is not None
    ref = make_sdxl_unet()
    toma.remove_toma(unet)
    # bf16 round trip loses bits, so compare against a fresh model moved the same way
    ref.to(torch.bfloat16).to(torch.float32)
    assert torch.equal(run(unet, **kw), run(ref, **kw))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_close_to_fp32(dtype):
    unet = make_sd15_unet()
    toma.apply_toma(unet, ratio=0.5)
    out32 = run(unet, **unet_inputs(1, 16, 16, False))
    unet.to(dtype)
    out = run(unet, **unet_inputs(1, 16, 16, False, dtype=dtype)).float()
    assert torch.isfinite(out).all()
    assert (out - out32).abs().max() < 0.05 * out32.abs().max() + 0.05


def test_reapply_replaces_settings(sd15_unet):
    toma.apply_toma(sd15_unet, ratio=0.5)
    patch = toma.apply_toma(sd15_unet, ratio=0.25, selection="grid")
    assert toma.get_toma(sd15_unet) is patch and patch.config.ratio == 0.25
    hooks = [
        m for m in sd15_unet.modules() if getattr(m, "_diffusers_hook", None) and m._diffusers_hook.get_hook("toma")
    ]
    # the UNet (step hook), each merged sub-module, and each stack's first/last block (tile order)
    stacks = {p.name.rsplit(".transformer_blocks.", 1)[0] for p in patch.patched}
    ends = {id(b) for s in stacks for b in (sd15_unet.get_submodule(s).transformer_blocks[i] for i in (0, -1))}
    assert len(hooks) == 1 + len(patch.patched) + len(ends)
    text = str(patch)
    assert "ratio=0.25" in text and "selection=grid" in text and "merged  down_blocks.0" in text


def test_summary_lists_patched_and_skipped(sdxl_unet):
    patch = toma.apply_toma(sdxl_unet, ratio=0.5, merge_mlp=True)
    text = patch.summary()
    assert f"{len(patch.patched)} merged" in text
    for p in patch.patched:
        assert p.name in text


@pytest.mark.parametrize("selection", ["random", "grid"])
def test_ablation_selections_run(sd15_unet, selection):
    kw = unet_inputs(2, 16, 16, False)
    toma.apply_toma(sd15_unet, ratio=0.5, selection=selection)
    out = run(sd15_unet, **kw)
    assert out.shape == kw["sample"].shape and torch.isfinite(out).all()


def test_pipeline_object_resolves_to_unet(sd15_unet):
    class FakePipe:
        unet = sd15_unet

    patch = toma.apply_toma(FakePipe(), ratio=0.5)
    assert toma.get_toma(sd15_unet) is patch
    assert toma.remove_toma(FakePipe())


@pytest.mark.parametrize("flatten", [True, False], ids=["flattened-to-tile-order", "reordered-at-blocks"])
@pytest.mark.parametrize(
    "options", [{}, {"merge_crossattn": True, "merge_mlp": True}, {"merge_attn": False, "merge_mlp": True}]
)
def test_tile_order_stacks_match_raster_order(sdxl_unet, monkeypatch, options, flatten):
    # A stack run in tile order must compute what per-module raster merging computes: the
    # blocks only see their tokens permuted, so only float summation order may differ.
    # Transformer2DModel flattens its image straight into tile order; a stack that cannot
    # (another class) is reordered at its first block.
    kw = unet_inputs(2, 16, 16, True)
    ref = run(sdxl_unet, **kw)
    from toma.adapters import unet as unet_adapter

    if not flatten:
        monkeypatch.setattr(unet_adapter, "image_stack", lambda module: False)
    patch = toma.apply_toma(sdxl_unet, ratio=0.5, **options)
    conversions = []
    # the flattening is the UNet adapter's; reordering at blocks is the token order's, shared with the engine
    owner, name = (unet_adapter, "image_to_tile_order") if flatten else (toma.adapters.state, "tile_order")
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda x, lay: conversions.append(x.shape) or real(x, lay))
    tiled = run(sdxl_unet, **kw)
    # one conversion per merged stack of 2 blocks (down, mid, 2 up), not one per block
    stacks = {p.name.rsplit(".transformer_blocks.", 1)[0] for p in patch.patched}
    assert len(conversions) == len(stacks) == 4
    monkeypatch.setattr(toma.adapters.state.PlanCache, "tile_order_layout", lambda self, grid, device=None: None)
    raster = run(sdxl_unet, **kw)
    assert len(conversions) == 4  # the raster run converted nothing
    assert not torch.allclose(tiled, ref, rtol=1e-4, atol=1e-5)  # merging changed the output
    assert torch.allclose(tiled, raster, rtol=1e-4, atol=1e-5)
    toma.remove_toma(sdxl_unet)


def test_padded_grid_stays_in_raster_order(sd15_unet, monkeypatch, tile_orders):
    from toma.adapters import unet as unet_adapter

    calls = tile_orders
    monkeypatch.setattr(unet_adapter, "image_to_tile_order", lambda x, lay: calls.append(1))
    toma.apply_toma(sd15_unet, ratio=0.5)
    out = run(sd15_unet, **unet_inputs(1, 10, 14, False))  # 10x14 is not a whole number of 4x4 tiles
    assert calls == [] and torch.isfinite(out).all()


def test_remove_leaves_no_trace_on_modules(sdxl_unet):
    # diffusers leaves the wrapped forward behind as an instance attribute; a later class
    # swap (tomesd patches blocks that way) would then be ignored
    before = {name: set(vars(m)) for name, m in sdxl_unet.named_modules()}
    toma.apply_toma(sdxl_unet, ratio=0.5, merge_mlp=True)
    run(sdxl_unet, **unet_inputs(1, 16, 16, True))
    toma.remove_toma(sdxl_unet)
    assert {name: set(vars(m)) for name, m in sdxl_unet.named_modules()} == before


def test_block_outside_a_transformer_stack_reorders_its_own_tokens(sd15_unet):
    # a BasicTransformerBlock that is not in a `transformer_blocks` list gets no stack hooks
    import dataclasses

    from toma.adapters import unet as unet_adapter
    from toma.config import ToMAConfig
    from toma.adapters.state import PlanCache

    kw = unet_inputs(1, 16, 16, False)
    ref = run(sd15_unet, **kw)
    targets, _ = unet_adapter.find_targets(sd15_unet, ToMAConfig())
    loose = [dataclasses.replace(t, name=t.name.replace(".transformer_blocks.", ".blocks.")) for t in targets]
    hooked = unet_adapter.attach(sd15_unet, loose, PlanCache(ToMAConfig()), Ledger())
    assert {id(m) for m in hooked} == {id(sd15_unet)} | {id(t.module) for t in targets}
    out = run(sd15_unet, **kw)
    assert torch.isfinite(out).all() and not torch.equal(out, ref)
    from toma.adapters.base import HOOK_NAME, remove_hook

    for m in hooked:
        remove_hook(m, HOOK_NAME)
    assert torch.equal(run(sd15_unet, **kw), ref)


@pytest.mark.parametrize("make", [make_sdxl_unet, make_sd15_unet], ids=["linear-projection", "conv-projection"])
def test_flattening_into_tile_order_saves_two_copies_a_stack(monkeypatch, make):
    # Transformer2DModel's own flatten and unflatten copies write and read tile order, so the
    # reordering copies at a stack's first and last blocks are gone. With a linear projection
    # (SDXL) the model flattens with a view and unflattens with a copy: its linear on the
    # strided view ran as mm + add, and now as one addmm on contiguous tokens; 3 kernels fewer
    # per stack. With a conv projection (SD 1.x) the flattening is a view too: 1 fewer.
    # Same values through the same layers, rows permuted: equal up to a GEMM's row blocking.
    from toma.adapters import unet as unet_adapter
    from toma.tools.opcount import count_kernels

    sdxl = make is make_sdxl_unet
    kw = unet_inputs(2, 16, 16, sdxl)
    outs, kernels = [], []
    for flatten in (True, False):
        unet = make()
        stacks = [m for m in unet.modules() if type(m).__name__ == "Transformer2DModel"]
        with monkeypatch.context() as m:
            if not flatten:
                m.setattr(unet_adapter, "image_stack", lambda module: False)
            patch = toma.apply_toma(unet, ratio=0.5, levels=1 if sdxl else 2)  # every attention level
        assert all(unet_adapter.image_stack(s) for s in stacks)
        outs.append(run(unet, **kw))
        kernels.append(sum(count_kernels(lambda: run(unet, **kw)).values()))
        toma.remove_toma(unet)
        # the instance's methods are the class's again
        assert not any(
            "_operate_on_continuous_inputs" in vars(s) or "_get_output_for_continuous_inputs" in vars(s) for s in stacks
        )
    merged_stacks = {p.name.rsplit(".transformer_blocks.", 1)[0] for p in patch.patched}
    assert kernels[1] - kernels[0] == (3 if sdxl else 1) * len(merged_stacks) > 0
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


def test_image_stack_leaves_other_stacks_alone():
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    from toma.adapters.unet import image_stack

    class OwnFlatten(Transformer2DModel):
        def _operate_on_continuous_inputs(self, hidden_states):
            return super()._operate_on_continuous_inputs(hidden_states)

    kw = dict(num_attention_heads=2, attention_head_dim=4, in_channels=8, norm_num_groups=2, cross_attention_dim=8)
    assert image_stack(Transformer2DModel(**kw))
    assert not image_stack(OwnFlatten(**kw))  # a subclass's own flattening: the blocks reorder
    assert not image_stack(
        Transformer2DModel(
            num_attention_heads=2,
            attention_head_dim=4,
            in_channels=4,
            patch_size=2,
            sample_size=8,
            norm_type="ada_norm_single",
        )
    )  # patches
    assert not image_stack(torch.nn.Linear(2, 2))


def test_cross_attention_queries_merge_under_a_text_mask():
    # encoder_attention_mask masks text keys, which stay whole: cross-attention's merged
    # queries can use it as is. Such calls ran unmerged, silently. With every token its own
    # destination and hard assignment, merging is a permutation: the output is unpatched's.
    unet = make_sd15_unet()
    kw = unet_inputs(2, 16, 16, False)
    mask = torch.ones(2, kw["encoder_hidden_states"].shape[1])
    mask[:, -2:] = 0
    kw["encoder_attention_mask"] = mask
    ref = run(unet, **kw)
    patch = toma.apply_toma(unet, ratio=0.05, tile_size=2, temperature=0, merge_attn=False, merge_crossattn=True)
    torch.testing.assert_close(run(unet, **kw), ref, rtol=0, atol=1e-5)
    toma.remove_toma(unet)
    patch = toma.apply_toma(unet, ratio=0.5, merge_attn=False, merge_crossattn=True)
    queries = []
    patch.patched[0].module.to_q.register_forward_pre_hook(lambda m, a: queries.append(a[0].shape[1]))
    run(unet, **kw)
    assert queries[0] == patch.cache.layout(16, 16).num_merged == 128


def test_self_attention_with_a_mask_of_its_own_runs_unmerged_and_says_so():
    unet = make_sd15_unet()
    patch = toma.apply_toma(unet, ratio=0.5)
    attn1 = patch.patched[0].module
    x = torch.randn(2, 256, attn1.to_q.in_features)
    mask = torch.zeros(2, 1, 256)
    patch.cache.begin_forward((16, 16), None)
    with torch.no_grad(), pytest.warns(UserWarning, match="attention mask over its unmerged tokens"):
        out = attn1(x, attention_mask=mask)
    toma.remove_toma(unet)
    with torch.no_grad():
        assert torch.equal(out, attn1(x, attention_mask=mask))


def test_levels_past_the_models_attention_levels_are_refused(sd15_unet):
    # the tiny SD 1.5 UNet has two attention levels: levels=5 used to merge what levels=2
    # does, silently; it is an error naming levels and its range, leaving the model unpatched
    kw = unet_inputs(1, 16, 16, sdxl=False)
    with torch.no_grad():
        before = sd15_unet(**kw).sample
    for levels in (3, 5):
        with pytest.raises(
            ValueError, match=rf"levels must be in 1\.\.2: UNet2DConditionModel has 2 attention .*levels={levels}"
        ):
            toma.apply_toma(sd15_unet, ratio=0.5, levels=levels)
        assert toma.get_toma(sd15_unet) is None
    with torch.no_grad():
        assert torch.equal(sd15_unet(**kw).sample, before)
    assert toma.apply_toma(sd15_unet, ratio=0.5, levels=2).patched
