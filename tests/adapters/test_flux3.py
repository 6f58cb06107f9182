"""FLUX.3: the image's own blocks and the single-stream blocks merge the image; references
run unmerged. The conformance suite (tests/adapters/test_conformance.py) runs its table row."""

from __future__ import annotations

import warnings

import pytest
import torch

import toma
from tests.cases import check_exact_on_duplicates, clustered_tokens, force
from tests.tiny_models import flux3_inputs, make_flux3
from toma.adapters import attention as A

OPTIONS = {"blocks": {"mode_blocks.image": range(2), "single_transformer_blocks": range(2)}}


def run(model, kw):
    with torch.no_grad():
        return model(**kw).sample


def test_each_merged_attention_sees_the_merged_image_and_the_whole_text(monkeypatch):
    # in call order: the text's own 2 blocks (5 tokens, untouched), the image's 2 blocks
    # (64 tokens merged to 32), the 2 single-stream blocks (5 text + 32)
    from diffusers.models.transformers import transformer_flux3 as module

    queries: list[int] = []
    real = module.dispatch_attention_fn
    monkeypatch.setattr(
        module, "dispatch_attention_fn", lambda q, *a, **k: queries.append(q.shape[1]) or real(q, *a, **k)
    )
    model = make_flux3()
    toma.apply_toma(model, ratio=0.5, **OPTIONS)
    run(model, flux3_inputs(1, 8, 8))
    assert queries == [5, 5, 32, 32, 5 + 32, 5 + 32]


def test_a_call_with_references_runs_unmerged_and_says_why():
    model = make_flux3()
    kw = flux3_inputs(2, 8, 8, references=1)
    ref = run(model, kw)
    toma.apply_toma(model, ratio=0.5, **OPTIONS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(model, kw)
    assert torch.equal(out, ref)
    assert [str(w.message) for w in caught if "ToMA" in str(w.message) and "references" in str(w.message)]
    plain = flux3_inputs(2, 8, 8)  # and the same patch merges a call without them
    assert not torch.equal(run(model, plain), run(make_flux3(), plain))


@pytest.mark.parametrize("form", A.FORMS)
def test_proportional_attention_is_exact_on_duplicate_tokens(form, monkeypatch):
    # two 4x4 tiles, each holding one token 9 times and 7 others once, rotary tables of no
    # rotation: the 8 destinations of ratio 0.5 keep one of each, and with the log(mass)
    # bias (the text's keys first, log mass 0, in the single-stream blocks) every merged
    # attention computes what the unmerged one does, to fp32 rounding
    force(monkeypatch, form)
    model = make_flux3()
    model.pos_embed.register_forward_hook(lambda m, args, out: (torch.ones_like(out[0]), torch.zeros_like(out[1])))
    kw = flux3_inputs(1, 4, 8)
    kw["hidden_states"] = clustered_tokens(2)
    check_exact_on_duplicates(model, kw, run, **OPTIONS)
