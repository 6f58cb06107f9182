"""Mochi beyond the conformance suite (its row is in tests/tiny_models.py): the video stream
of its asymmetric joint attention merges, each sample keeps its own valid text keys after
the merged video keys, proportional attention runs through toma's equal of its processor,
and what it refuses."""

from __future__ import annotations

import warnings

import pytest
import torch

import toma
from tests.cases import check_exact_on_duplicates, clustered_tokens, force, sdpa_keys
from tests.tiny_models import FAMILIES, make_mochi, mochi_inputs
from toma.adapters import attention as A

FAM = FAMILIES["mochi"]
TEXT, PADDED = 6, 2


def run(model, kw):
    with torch.no_grad():
        return model(**kw).sample


def toma_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "ToMA" in str(w.message)]


@pytest.mark.parametrize("proportional", [False, True])
def test_ratio_zero_and_remove_are_bitwise_and_each_sample_keeps_its_valid_text(proportional, monkeypatch):
    model, kw = FAM.make(), FAM.inputs(2)  # 3 x 4 x 4 video tokens; the second sample pads 2 of 6 text tokens
    processors = [block.attn1.processor for block in model.transformer_blocks]
    ref = run(model, kw)
    toma.apply_toma(model, ratio=0.0, **FAM.every_part())
    assert torch.equal(run(model, kw), ref)
    patch = toma.apply_toma(model, ratio=0.5, proportional_attention=proportional, **FAM.every_part())
    assert [t.name for t in patch.patched] == [f"transformer_blocks.{i}.{s}" for i in range(2) for s in ("attn1", "ff")]
    keys = sdpa_keys(monkeypatch)
    out = run(model, kw)
    kept = patch.cache.layout(*FAM.grid, ratio=0.5).num_merged
    assert kept == 24  # 48 tokens at ratio 0.5
    # the caption pooling of the timestep embedding (its text and a pooled token) first; then,
    # a plan per sample and one rotary table per call, each block's attention once per sample,
    # on its merged video tokens and its valid text tokens (the processor drops the padding;
    # toma's biased equal of it masks the padding out of the keys)
    text = [TEXT, TEXT] if proportional else [TEXT, TEXT - PADDED]
    assert keys == [TEXT + 1] + [kept + t for t in text] * 2
    # merging half the tokens of random tiny blocks moves the output by a visible share of
    # its range, and keeps it finite and of its shape
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert 1e-3 < (out - ref).abs().max() < ref.abs().max()
    # the merged attentions' processors were wrapped (to take the key bias); remove puts them back
    assert [type(block.attn1.processor).__name__ for block in model.transformer_blocks] == ["BiasedProcessor"] * 2
    toma.remove_toma(model)
    assert [block.attn1.processor for block in model.transformer_blocks] == processors
    assert torch.equal(run(model, kw), ref)


@pytest.mark.parametrize("form", A.FORMS)
def test_proportional_attention_is_exact_on_duplicate_tokens(form, monkeypatch):
    # a 4x8 frame in two 4x4 tiles, each holding one token 9 times and 7 others once (a token
    # is a 2x2 patch of 4 channels: equal patches embed alike), no rotation (the class's
    # zero frequencies): with the log(mass) bias on the merged video keys, before the valid
    # text's, the merged model computes the unmerged one to fp32 rounding, and without it
    # does not, by every form the backend's rule can pick
    force(monkeypatch, form)
    model = FAM.make()
    with torch.no_grad():
        model.pos_frequencies.zero_()
    patches = clustered_tokens(2, channels=16).reshape(4, 8, 4, 2, 2)  # (h, w, c, ph, pw)
    kw = mochi_inputs(1, 1, 8, 16, padded=0)
    kw["hidden_states"] = patches.permute(2, 0, 3, 1, 4).reshape(1, 4, 8, 16).unsqueeze(2)
    check_exact_on_duplicates(model, kw, run, **FAM.options)


def test_the_biased_attention_computes_the_processors_own_under_a_zero_bias():
    # toma's equal of the processor, with every log mass 0 (a bias that changes nothing),
    # gives the processor's outputs, text rows in its order too, for a mask with gaps in it
    # (the processor writes the valid tokens' outputs first, then zeros): the same maths,
    # one masked call in place of one per sample (fp32 rounding: 1e-6 of these ~1 outputs)
    from toma.adapters.attention import KeyBias
    from toma.adapters.families.mochi import BiasedProcessor

    model = FAM.make()
    attn = model.transformer_blocks[0].attn1
    g = torch.Generator().manual_seed(3)
    video = torch.randn(2, 24, 16, generator=g)
    text = torch.randn(2, TEXT, 16, generator=g)
    mask = torch.tensor([[1, 0, 1, 1, 0, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    rotary = model.rope(model.pos_frequencies, 2, 3, 4, dtype=torch.float32)
    with torch.no_grad():
        own = attn.processor(attn, video, text, mask, rotary)
        biased = BiasedProcessor(attn.processor)(attn, video, text, mask, rotary, KeyBias(torch.zeros(1, 24), True))
    for a, b in zip(biased, own):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # sample 0's 4 valid tokens' rows, then two rows of zeros (through the text's output projection)
    assert torch.equal(own[1][0, -1], own[1][0, -2]) and not torch.equal(own[1][0, -3], own[1][0, -2])


@pytest.mark.parametrize("proportional", [False, True])
def test_padded_text_changes_nothing_merged(proportional):
    # the processor drops each sample's padded text from its keys, merged or not: their
    # values change nothing (they matter where the mask keeps them)
    model, kw = FAM.make(), FAM.inputs(2)
    toma.apply_toma(model, ratio=0.5, proportional_attention=proportional, **FAM.options)
    out = run(model, kw)
    changed = kw["encoder_hidden_states"].clone()
    changed[1, -PADDED:] = 100.0
    assert torch.equal(run(model, {**kw, "encoder_hidden_states": changed}), out)
    kept = {**kw, "encoder_hidden_states": changed, "encoder_attention_mask": torch.ones(2, TEXT, dtype=torch.bool)}
    assert not torch.allclose(run(model, kept)[1], out[1], atol=1e-3)


def test_checkpointing_with_trainable_rotary_runs_unmerged_with_the_reason():
    # one gather of the rotary rows serves every merged block of a forward, which a
    # checkpointed block's recomputation would miss: such training forwards run unmerged
    # (the gradients the unpatched model's), with one warning; frozen frequencies merge
    model, kw = make_mochi(trainable_rotary=True), FAM.inputs(2)
    model.enable_gradient_checkpointing()
    model.zero_grad(set_to_none=True)
    model(**kw).sample.square().mean().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    patch = toma.apply_toma(model, ratio=0.5, **FAM.options)
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(**kw).sample.square().mean().backward()
    [message] = toma_warnings(caught)
    assert "pos_frequencies" in message and "gradient checkpointing" in message
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))
    model.pos_frequencies.requires_grad_(False)
    model(**kw).sample.square().mean().backward()
    assert patch.cache._plans


def test_another_processor_merges_without_the_bias_said_once():
    # a processor other than Mochi's own takes no key bias toma can reach: merged calls run
    # without it, with a warning once per merged attention (not per call)
    from diffusers.models.attention_processor import MochiAttnProcessor2_0

    class Custom(MochiAttnProcessor2_0):
        pass

    model, kw = FAM.make(), FAM.inputs(2)
    for block in model.transformer_blocks:
        block.attn1.processor = Custom()
    patch = toma.apply_toma(model, ratio=0.5, proportional_attention=True, **FAM.options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(model, kw)
        run(model, kw)
    messages = toma_warnings(caught)
    assert len(messages) == 2 and len(set(messages)) == 1
    assert "proportional attention is off" in messages[0] and "Custom" in messages[0]
    assert patch.cache._plans


def test_merge_crossattn_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="merge_crossattn=True: mochi has no cross-attention"):
        toma.apply_toma(FAM.make(), ratio=0.5, merge_crossattn=True)


def test_the_bench_arch_calls_the_published_layout_and_merges():
    # the published config narrowed so it builds in a second: make_inputs' call (12 latent
    # channels, 19 frames as 4 latent frames, the T5 prompt with its mask) runs, the
    # default placement, scaled to the blocks built, merges, and set_timestep makes its
    # timestep rise over the run, as the pipeline's does
    import dataclasses

    from toma.tools.archs import ARCHS, build_model, call_denoiser, default_placement, make_inputs, set_timestep

    arch = ARCHS["mochi"]
    narrow = {"num_attention_heads": 2, "attention_head_dim": 32, "pooled_projection_dim": 32, "text_embed_dim": 32}
    tiny = dataclasses.replace(arch, config={**arch.config, **narrow}, text_dim=32, text_tokens=8)
    model = build_model(tiny, depth=24)
    kw = make_inputs(tiny, 128, batch=1)
    assert kw["hidden_states"].shape == (1, 12, 4, 16, 28) and kw["encoder_attention_mask"].all()
    ts = [float(set_timestep(tiny, kw, step, 4)["timestep"][0]) for step in range(4)]
    assert ts == sorted(ts) and ts[0] == 0.0
    patch = toma.apply_toma(model, ratio=0.5, **default_placement(tiny, model))
    with torch.no_grad():
        out = call_denoiser(tiny, model, set_timestep(tiny, kw, 1, 4))[0]
    assert out.shape == (1, 12, 4, 16, 28) and patch.cache._plans
