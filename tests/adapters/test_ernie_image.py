"""ERNIE-Image's own cases: its sequence-first MLP merges (the conformance suite's projection
checks read batch-first calls), the pipeline's text padding merges as if it were not there
(with proportional attention too), and its default blocks."""

from __future__ import annotations

import warnings

import pytest
import torch

import toma
from tests.tiny_models import FAMILIES, ernie_image_inputs, make_ernie_image

FAM = FAMILIES["ernie-image"]


def test_the_sequence_first_mlp_sees_the_merged_image_then_the_text():
    model, kw = FAM.make(), FAM.inputs(2)
    text = kw["text_bth"].shape[1]
    patch = toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    seen = []
    for layer in model.layers:
        layer.mlp.gate_proj.register_forward_pre_hook(lambda m, a: seen.append(tuple(a[0].shape)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "feed-forward chunking?" warning: the call is taken whole
        FAM.output(model, kw)
    k = patch.cache.layout(1, 8, 10).num_merged
    assert k < 80 and seen == [(k + text, 2, 32)] * 2  # (K + T, B, C): sequence-first, the text whole


@pytest.mark.parametrize("proportional", [False, True])
def test_padded_text_merges_as_if_the_padding_were_not_there(proportional):
    # the pipeline pads each prompt to the longest (_pad_text) and the forward masks the
    # padding: a short prompt's sample merges, padded or not, alike (its plan, its rotary
    # angles, its text). Not bitwise: the sequences differ in length, so attention's sums
    # are blocked differently (float32 ulps, ~1e-7 an op); merging moves outputs by ~1e-2.
    # Under proportional attention the bias rides beside the processor's key mask
    model = FAM.make()
    toma.apply_toma(model, ratio=0.5, proportional_attention=proportional, **FAM.every_part())
    padded = ernie_image_inputs(2, 8, 10, text=7, padded=3)  # sample 1: 4 tokens, padded to 7
    alone = {**{k: v[1:] for k, v in padded.items()}, "text_bth": padded["text_bth"][1:, :4]}
    assert int(padded["text_lens"][1]) == 4
    garbage = padded["text_bth"].clone()
    garbage[1, 4:] = 100.0  # what the padding holds does not reach the output
    both = FAM.output(model, {**padded, "text_bth": garbage})
    torch.testing.assert_close(both[1:], FAM.output(model, alone), rtol=1e-4, atol=1e-5)
    plain = FAM.make()
    assert (FAM.output(plain, alone) - both[1:]).abs().max() > 1e-3  # merging moved it: the check can tell


def test_only_the_layers_merge_and_the_first_five_are_skipped_by_default():
    names = {t.name for t in toma.apply_toma(make_ernie_image(layers=12), ratio=0.5).patched}
    assert {name.split(".")[0] for name in names} == {"layers"}
    assert sorted({int(name.split(".")[1]) for name in names}) == list(range(5, 12))
