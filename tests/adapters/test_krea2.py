"""Krea 2 beyond the conformance suite (its row is in tests/tiny_models.py): the attention
mask its forward builds, sliced to the merged tokens, and its grid reader's refusals."""

from __future__ import annotations

import warnings

import torch

import toma
from tests.tiny_models import FAMILIES, krea2_inputs
from toma.adapters.base import Hook, register_innermost, remove_hook

FAM = FAMILIES["krea2"]
TEXT, PADDED = 5, 2


class MaskSpy(Hook):
    """Records the attention mask of each call of the module it is registered on."""

    def __init__(self, seen: list) -> None:
        self.seen = seen

    def pre_forward(self, module, *args, **kwargs):
        self.seen.append(kwargs.get("attention_mask"))
        return args, kwargs


def attention_masks(model, kw) -> list[torch.Tensor]:
    """The masks the blocks' attentions receive, inside toma's hooks where the model is patched."""
    seen, spied = [], [block.attn for block in model.transformer_blocks]
    for attn in spied:
        register_innermost(attn, MaskSpy(seen), "spy")
    FAM.output(model, kw)
    for attn in spied:
        remove_hook(attn, "spy")
    return seen


def test_the_forwards_mask_holds_over_the_image_for_any_text_mask():
    # why the slice is exact: the forward joins the text mask to ones over the image, so no
    # call can hide an image key (no structured mask reaches the blocks). If diffusers ever
    # takes a joint mask from the caller, this fails and the spec needs the grid's check
    model, kw = FAM.make(), krea2_inputs(2, 8, 10)
    kw["encoder_attention_mask"] = torch.rand(2, TEXT, generator=torch.Generator().manual_seed(0)) > 0.5
    masks = attention_masks(model, kw)
    assert len(masks) == len(model.transformer_blocks)
    for mask in masks:
        assert mask.shape == (2, 1, 1, TEXT + 80)
        assert torch.equal(mask[..., :TEXT], kw["encoder_attention_mask"][:, None, None, :])
        assert mask[..., TEXT:].all()


def test_merged_attention_takes_the_masks_slice_and_ratio_zero_is_bitwise():
    model, kw = FAM.make(), FAM.inputs(2)  # the second sample's last two text tokens padded
    full = attention_masks(model, kw)[0]
    reference = FAM.output(model, kw)
    toma.apply_toma(model, ratio=0.0, proportional_attention=False, **FAM.every_part())
    assert torch.equal(FAM.output(model, kw), reference)
    toma.remove_toma(model)
    patch = toma.apply_toma(model, ratio=0.5, proportional_attention=False, **FAM.every_part())
    kept = patch.cache.layout(*FAM.grid, ratio=0.5).num_merged
    masks = attention_masks(model, kw)
    # one table for the batch and a plan per sample: each block's attention runs once per sample
    assert kept < 80 and len(masks) == 2 * len(model.transformer_blocks)
    for i, mask in enumerate(masks):  # the sample's text part as the model's, K image keys, all kept
        b = i % 2
        assert torch.equal(mask, full[b : b + 1, ..., : TEXT + kept])
    assert not masks[1][0, 0, 0, TEXT - PADDED : TEXT].any()


def test_position_ids_that_do_not_span_the_tokens_run_unmerged_with_one_warning():
    model, kw = FAM.make(), FAM.inputs(2)
    ids = kw["position_ids"].clone()
    ids[TEXT + 7 :, 1] += 1  # the first row ends after 7 tokens: 12 rows of 7 for 80 tokens
    kw["position_ids"] = ids
    reference = FAM.output(model, kw)
    toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = FAM.output(model, kw)
        FAM.output(model, kw)
    messages = [str(w.message) for w in caught if "ToMA" in str(w.message)]
    assert len(messages) == 1 and "12x7 grid" in messages[0] and "80 image tokens" in messages[0]
    assert torch.equal(out, reference)


def test_positions_that_step_by_two_read_the_same_grid():
    # rows and columns 0, 2, 4, ...: still the 8x10 raster grid of the 80 tokens, which
    # merges as the unit-step one does (the old reader took the span, 15x19, and refused)
    model, kw = FAM.make(), FAM.inputs(2)
    toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    FAM.output(model, kw)
    unit = [p.dest for _, p in toma.get_toma(model).cache._plans.values()]
    ids = kw["position_ids"].clone()
    ids[TEXT:, 1:] *= 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        FAM.output(model, {**kw, "position_ids": ids})
    scaled = [p.dest for _, p in toma.get_toma(model).cache._plans.values()]
    assert unit and [d.shape for d in scaled] == [d.shape for d in unit]
