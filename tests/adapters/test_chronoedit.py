"""ChronoEdit beyond the conformance suite (its row is in tests/tiny_models.py): Wan's blocks
on an edit's two frames, the pipeline's switch from the reasoning clip to its two end frames,
proportional attention, and what it refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import toma
from tests.cases import check_exact_on_duplicates, clustered_tokens, sdpa_keys
from tests.tiny_models import FAMILIES, chronoedit_inputs, make_chronoedit

FAM = FAMILIES["chronoedit"]


def run(model, kw):
    with torch.no_grad():
        return model(**kw).sample


def test_ratio_zero_and_remove_are_bitwise_and_half_the_tokens_merge(monkeypatch):
    # the pipeline's call: 2 x 6 x 8 tokens (an input and an edited frame), image embeddings
    # before the 512 text tokens
    model, kw = make_chronoedit(image=True), chronoedit_inputs(2, 2, 12, 16, text=512, image=3)
    ref = run(model, kw)
    toma.apply_toma(model, ratio=0.0, **FAM.every_part())
    assert torch.equal(run(model, kw), ref)
    patch = toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    assert [t.name for t in patch.patched] == [f"blocks.{i}.{s}" for i in range(2) for s in ("attn1", "attn2", "ffn")]
    keys = sdpa_keys(monkeypatch)
    out = run(model, kw)
    kept = patch.cache.layout(*FAM.grid, ratio=0.5).num_merged
    assert kept == 48  # 96 tokens at ratio 0.5
    # self-attention's keys are the merged tokens; cross-attention's the 512 text tokens and,
    # in a call of their own, the 3 image embeddings, whatever merges
    assert sorted(set(keys)) == [3, kept, 512]
    # merging half the tokens of random tiny blocks moves the output by a visible share of
    # its range, and keeps it finite and of its shape
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert 1e-3 < (out - ref).abs().max() < ref.abs().max()
    toma.remove_toma(model)
    assert torch.equal(run(model, kw), ref)


def test_the_reasoning_clip_and_its_end_frames_get_plans_of_their_own():
    # with temporal reasoning, the pipeline's first steps see 5 latent frames, the rest the
    # clip's first and last: the two-frame calls merge with a plan of their grid, exactly
    # as on a model that never saw the clip
    model = FAM.make()
    clip, ends = chronoedit_inputs(2, 5, 12, 16), chronoedit_inputs(2, 2, 12, 16)
    patch = toma.apply_toma(model, ratio=0.5, **FAM.options)
    run(model, clip)
    assert {key[1] for key in patch.cache._plans} == {(5, 6, 8)}
    after = run(model, ends)
    assert {key[1] for key in patch.cache._plans} == {(2, 6, 8)}
    fresh = FAM.make()
    toma.apply_toma(fresh, ratio=0.5, **FAM.options)
    assert torch.equal(run(fresh, ends), after)


def test_proportional_attention_is_exact_on_duplicate_tokens():
    # a 4x8 frame in two 4x4 tiles, each holding one token 9 times and 7 others once, no
    # rotation: with the log(mass) bias in the self-attention's mask the merged model
    # computes the unmerged one to fp32 rounding, and without it does not
    # (a token is a 1x2x2 patch of the 8 latent and condition channels: equal patches embed alike)
    model = FAM.make()
    patches = clustered_tokens(2, channels=32).reshape(4, 8, 8, 2, 2)  # (h, w, c, ph, pw)
    kw = chronoedit_inputs(1, 1, 8, 16)
    kw["hidden_states"] = patches.permute(2, 0, 3, 1, 4).reshape(1, 8, 1, 8, 16)
    model.rope.register_forward_hook(lambda m, args, out: (torch.ones_like(out[0]), torch.zeros_like(out[1])))
    check_exact_on_duplicates(model, kw, run, **FAM.options)


def test_context_parallelism_is_refused_with_the_reason():
    # toma follows Wan's _cp_plan, not ChronoEdit's (which lacks the per-token timestep's
    # split): the patched forward refuses rather than merge a shard as the whole. The
    # parallel config is what toma reads, so it is set by hand here (no process group).
    model, kw = FAM.make(), FAM.inputs(1)
    toma.apply_toma(model, ratio=0.5, **FAM.options)
    cp = SimpleNamespace(ring_degree=1, ulysses_degree=2, ulysses_anything=False, ring_anything=False)
    model._parallel_config = SimpleNamespace(context_parallel_config=cp)
    with pytest.raises(ValueError, match="does not merge chronoedit under context parallelism"):
        run(model, kw)


def test_the_bench_arch_calls_the_published_layout_and_merges():
    # the published config narrowed so it builds in a second: make_inputs' call (36 input
    # channels, 257 CLIP tokens before the 512 of the prompt, 2 latent frames) runs, and the
    # default placement, scaled to the blocks built, merges
    import dataclasses

    from toma.tools.archs import ARCHS, build_model, call_denoiser, default_placement, make_inputs, set_timestep

    arch = ARCHS["chronoedit"]
    narrow = {"num_attention_heads": 2, "attention_head_dim": 32, "ffn_dim": 64, "text_dim": 32}
    narrow |= {"image_dim": 16, "added_kv_proj_dim": 64}
    tiny = dataclasses.replace(arch, config={**arch.config, **narrow}, text_dim=32)
    model = build_model(tiny, depth=20)
    kw = make_inputs(tiny, 128, batch=1)
    assert kw["hidden_states"].shape == (1, 36, 2, 16, 28) and kw["encoder_hidden_states_image"].shape[1] == 257
    patch = toma.apply_toma(model, ratio=0.5, **default_placement(tiny, model))
    with torch.no_grad():
        out = call_denoiser(tiny, model, set_timestep(tiny, kw, 1, 4))[0]
    assert out.shape == (1, 16, 2, 16, 28) and patch.cache._plans
