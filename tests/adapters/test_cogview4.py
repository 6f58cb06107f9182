"""CogView4 beyond the conformance suite (its row is in tests/tiny_models.py): joint
[text; image] attention whose image part merges, rotary tables the model makes or its caller
passes, proportional attention through toma's equal of its processor, and what it refuses."""

from __future__ import annotations

import warnings

import pytest
import torch

import toma
from tests.cases import check_exact_on_duplicates, clustered_tokens, force, sdpa_keys
from tests.tiny_models import FAMILIES, cogview4_inputs
from toma.adapters import attention as A

FAM = FAMILIES["cogview4"]
TEXT = 5


def run(model, kw):
    with torch.no_grad():
        return model(**kw).sample


def training_processors(model) -> None:
    from diffusers.models.transformers.transformer_cogview4 import CogView4TrainingAttnProcessor

    for block in model.transformer_blocks:
        block.attn1.set_processor(CogView4TrainingAttnProcessor())


def toma_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "ToMA" in str(w.message)]


def test_ratio_zero_and_remove_are_bitwise_and_attention_sees_the_text_and_merged_tokens(monkeypatch):
    model, kw = FAM.make(), FAM.inputs(2)  # 8 x 10 image tokens, 5 text tokens
    processors = [block.attn1.processor for block in model.transformer_blocks]
    ref = run(model, kw)
    toma.apply_toma(model, ratio=0.0, **FAM.options)
    assert torch.equal(run(model, kw), ref)
    patch = toma.apply_toma(model, ratio=0.5, **FAM.options)
    assert [t.name for t in patch.patched] == ["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"]
    keys = sdpa_keys(monkeypatch)
    out = run(model, kw)
    kept = patch.cache.layout(*FAM.grid, ratio=0.5).num_merged
    assert kept == 40  # 80 tokens at ratio 0.5
    # a plan per sample and one rotary table per call: each block's attention runs once per
    # sample, on the whole text and the merged image tokens
    assert keys == [TEXT + kept] * 4
    # merging half the tokens of random tiny blocks moves the output by a visible share of
    # its range, and keeps it finite and of its shape
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert 1e-3 < (out - ref).abs().max() < ref.abs().max()
    # the merged attentions' processors were wrapped (to take the key bias); remove puts them back
    assert [type(block.attn1.processor).__name__ for block in model.transformer_blocks] == ["BiasedProcessor"] * 2
    toma.remove_toma(model)
    assert [block.attn1.processor for block in model.transformer_blocks] == processors
    assert torch.equal(run(model, kw), ref)


def test_tables_the_caller_passes_merge_as_the_models_own():
    # the forward takes image_rotary_emb from its caller instead of making it: the blocks
    # put those tables in their order too (block_rope), so the same tables give the same output
    model, kw = FAM.make(), FAM.inputs(2)
    tables = model.rope(kw["hidden_states"])
    toma.apply_toma(model, ratio=0.5, **FAM.options)
    own = run(model, kw)
    assert torch.equal(run(model, {**kw, "image_rotary_emb": tables}), own)


@pytest.mark.parametrize("form", A.FORMS)
def test_proportional_attention_is_exact_on_duplicate_tokens(form, monkeypatch):
    # two 4x4 tiles, each holding one token 9 times and 7 others once (a token is a 2x2 patch
    # of 4 channels: equal patches embed alike), identity rotary tables from the caller: with
    # the log(mass) bias on the merged keys, toma's joint attention computes the unmerged one
    # to fp32 rounding, and without it does not, by every form the backend's rule can pick
    force(monkeypatch, form)
    model = FAM.make()
    patches = clustered_tokens(2, channels=16).reshape(4, 8, 4, 2, 2)  # (h, w, c, ph, pw)
    kw = cogview4_inputs(1, 8, 16)
    kw["hidden_states"] = patches.permute(2, 0, 3, 1, 4).reshape(1, 4, 8, 16)
    kw["image_rotary_emb"] = (torch.ones(32, 8), torch.zeros(32, 8))
    check_exact_on_duplicates(model, kw, run, **FAM.options)


def test_the_text_padding_mask_is_folded_into_the_bias():
    # the second sample's last two text tokens are padding: under proportional attention (toma's
    # joint attention) they are hidden from every merged key set, so their values change nothing
    model, kw = FAM.make(), FAM.inputs(2)
    mask = torch.ones(2, TEXT)
    mask[1, -2:] = 0
    toma.apply_toma(model, ratio=0.5, proportional_attention=True, **FAM.options)
    out = run(model, {**kw, "attention_mask": mask})
    changed = kw["encoder_hidden_states"].clone()
    changed[1, -2:] = 100.0
    torch.testing.assert_close(run(model, {**kw, "encoder_hidden_states": changed, "attention_mask": mask}), out)
    assert not torch.allclose(run(model, {**kw, "encoder_hidden_states": changed}), out, atol=1e-3)


def test_another_processor_merges_without_the_bias_said_once():
    # the training processor takes no key bias toma can reach: merged calls run without it,
    # with a warning once per merged attention (not per call)
    model, kw = FAM.make(), FAM.inputs(2)
    training_processors(model)
    patch = toma.apply_toma(model, ratio=0.5, proportional_attention=True, **FAM.options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(model, kw)
        run(model, kw)
    messages = toma_warnings(caught)
    assert len(messages) == 2 and len(set(messages)) == 1
    assert "proportional attention is off" in messages[0] and "CogView4TrainingAttnProcessor" in messages[0]
    assert patch.cache._plans


@pytest.mark.parametrize("case", ["packed tables", "training masks"])
def test_calls_it_cannot_merge_run_unmerged_with_one_warning(case):
    model, kw = FAM.make(), FAM.inputs(2)
    training_processors(model)
    if case == "packed tables":  # the training processor packs samples, with one table each
        table = model.rope(kw["hidden_states"])
        kw["image_rotary_emb"] = [table, table]
        kw["attention_kwargs"] = {"batch_flag": torch.tensor([0, 1])}
        words = "list of image_rotary_emb"
    else:
        kw["attention_kwargs"] = {"latent_attn_mask": torch.ones(2, 80, dtype=torch.int32)}
        words = "latent_attn_mask"
    ref = run(model, kw)
    toma.apply_toma(model, ratio=0.5, **FAM.options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(model, kw)
        run(model, kw)
    [message] = toma_warnings(caught)
    assert words in message
    assert torch.equal(out, ref)


def test_merge_mlp_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="merge_mlp=True: cogview4 has no separate MLP"):
        toma.apply_toma(FAM.make(), ratio=0.5, merge_mlp=True)


def test_the_bench_arch_calls_the_published_layout_and_merges():
    # the published config narrowed so it builds in a second: make_inputs' call (latents, the
    # prompt, the size conditioning) runs, and the default placement, scaled to the blocks
    # built, merges
    import dataclasses

    from toma.tools.archs import ARCHS, build_model, call_denoiser, default_placement, make_inputs, set_timestep

    arch = ARCHS["cogview4"]
    narrow = {"num_attention_heads": 2, "attention_head_dim": 32, "text_embed_dim": 32, "time_embed_dim": 32}
    narrow |= {"condition_dim": 16}
    tiny = dataclasses.replace(arch, config={**arch.config, **narrow}, text_dim=32, text_tokens=16)
    model = build_model(tiny, depth=14)
    kw = make_inputs(tiny, 256, batch=1)
    assert kw["hidden_states"].shape == (1, 16, 32, 32) and kw["original_size"].tolist() == [[256.0, 256.0]]
    patch = toma.apply_toma(model, ratio=0.5, **default_placement(tiny, model))
    with torch.no_grad():
        out = call_denoiser(tiny, model, set_timestep(tiny, kw, 1, 4))[0]
    assert out.shape == (1, 16, 32, 32) and patch.cache._plans
