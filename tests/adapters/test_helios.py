"""Helios' own case: every block sees ``[history; generated]``; each merged call merges the
generated latents' tokens at its end, the packed history passes whole, and the
self-attention, which scales the history's keys, is told the merged count of generated
tokens it splits them off by (``original_context_length``)."""

from __future__ import annotations

import pytest
import torch

import toma
from tests.cases import check_exact_on_duplicates, clustered_tokens, force
from tests.tiny_models import FAMILIES, helios_inputs
from toma.adapters import attention as A

FAM = FAMILIES["helios"]
HISTORY = 2 * 64 + 16 + 4  # short 2 x 8 x 8, mid 1 x 4 x 4, long 1 x 2 x 2 tokens at 16 x 16


def run(model, kw):
    with torch.no_grad():
        return model(**kw).sample


def test_the_history_passes_whole_and_the_count_follows_the_merge(monkeypatch):
    # 2 x 8 x 8 generated tokens, merged to 64 at ratio 0.5: each self-attention gets the
    # 148 history tokens whole before them and is told 64; the cross-attention and the MLP
    # get the merged tokens (with the history, unmerged by the block, where it passes them)
    from diffusers.models.transformers import transformer_helios as module

    seen = []
    real = module.HeliosAttnProcessor.__call__

    def spy(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None, count=None):
        if encoder_hidden_states is None:
            seen.append((hidden_states.shape[1], None if rotary_emb is None else rotary_emb.shape[1], count))
        return real(self, attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, count)

    spy.__module__ = module.__name__  # where toma wraps the dispatch the processor looks up
    monkeypatch.setattr(module.HeliosAttnProcessor, "__call__", spy)
    model, kw = FAM.make(), helios_inputs(2, 2, 16, 16)
    ref = run(model, kw)
    assert seen == [(HISTORY + 128, HISTORY + 128, 128)] * 2
    seen.clear()
    toma.apply_toma(model, ratio=0.5, merge_crossattn=True, merge_mlp=True, **FAM.options)
    out = run(model, kw)
    assert seen == [(HISTORY + 64, HISTORY + 64, 64)] * 2
    assert out.shape == ref.shape and 1e-3 < (out - ref).abs().max() < ref.abs().max()
    # without history the call is the generated tokens alone
    seen.clear()
    run(model, helios_inputs(2, 2, 16, 16, history=False))
    assert seen == [(64, 64, 64)] * 2


@pytest.mark.parametrize("form", A.FORMS)
def test_proportional_attention_is_exact_on_duplicate_tokens(form, monkeypatch):
    # a 4x8 frame in two 4x4 tiles, each holding one token 9 times and 7 others once, no
    # rotation, after a packed history of distinct tokens whose keys the self-attention
    # scales: with the log(mass) bias (the history's keys at log mass 0) the merged
    # attention computes the unmerged one to fp32 rounding, which holds only if the scaled
    # keys are the history's alone, that is, if the call is told the merged count
    force(monkeypatch, form)
    model = FAM.make()
    tokens = clustered_tokens(2, channels=32).reshape(1, 1, 4, 8, 32).permute(0, 4, 1, 2, 3)
    model.patch_embedding.register_forward_hook(lambda m, args, out: tokens)
    # (B, cos channels + sin channels, t, h, w): cos 1, sin 0
    model.rope.register_forward_hook(
        lambda m, args, out: (
            (torch.arange(out.shape[1]) < out.shape[1] // 2).to(out).view(1, -1, 1, 1, 1).expand_as(out)
        )
    )
    check_exact_on_duplicates(model, helios_inputs(1, 1, 8, 16), run, **FAM.options)


def test_context_parallelism_is_refused_with_the_reason():
    # diffusers' _cp_plan for Helios splits each attention's and MLP's [history; generated]
    # input, which toma does not follow: the patched forward refuses it rather than merge a
    # shard as the whole. The parallel config is what toma reads, so it is set by hand here
    # (no process group).
    from types import SimpleNamespace

    model, kw = FAM.make(), helios_inputs(1, 1, 8, 8)
    toma.apply_toma(model, ratio=0.5, **FAM.options)
    cp = SimpleNamespace(ring_degree=1, ulysses_degree=2, ulysses_anything=False, ring_anything=False)
    model._parallel_config = SimpleNamespace(context_parallel_config=cp)
    with pytest.raises(ValueError, match="does not merge helios under context parallelism"):
        run(model, kw)
