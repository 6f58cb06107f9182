"""Ideogram 4 beyond the conformance suite (its row is in tests/tiny_models.py): the segment
mask its forward builds, sliced to the merged tokens; image tokens over several segments
(a structured mask) run unmerged; the unconditional transformer's image-only call merges."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import toma
from tests.tiny_models import FAMILIES, ideogram4_inputs
from toma.adapters.base import Hook, register_innermost, remove_hook

FAM = FAMILIES["ideogram4"]
TEXT, PADDED, GRID = 5, 2, (1, 8, 10)


class MaskSpy(Hook):
    """Records the attention mask and hidden states of each call of the module it is registered on."""

    def __init__(self, seen: list) -> None:
        self.seen = seen

    def pre_forward(self, module, *args, **kwargs):
        self.seen.append((kwargs.get("attention_mask"), args[0] if args else kwargs["hidden_states"]))
        return args, kwargs


def attention_calls(model, kw) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(mask, hidden states) of each call of the blocks' attentions, inside toma's hooks where patched."""
    seen, spied = [], [block.attention for block in model.layers]
    for attn in spied:
        register_innermost(attn, MaskSpy(seen), "spy")
    FAM.output(model, kw)
    for attn in spied:
        remove_hook(attn, "spy")
    return seen


def test_merged_attention_takes_the_segment_masks_slice():
    model, kw = FAM.make(), FAM.inputs(2)  # the second sample's prompt 2 tokens shorter: 2 left pads
    [(full, _), *_] = attention_calls(model, kw)
    s = TEXT + math.prod(GRID)
    assert full.shape == (2, 1, s, s) and full.dtype == torch.bool
    assert not full[1, 0, :PADDED, PADDED:].any() and full[1, 0, PADDED:, PADDED:].all()  # pads see only pads
    patch = toma.apply_toma(model, ratio=0.5, proportional_attention=False, **FAM.every_part())
    kept = patch.cache.layout(*GRID, ratio=0.5).num_merged
    calls = attention_calls(model, kw)
    # per-sample tables and a plan per sample: one call for the batch, on T + K tokens
    assert kept < math.prod(GRID) and len(calls) == len(model.layers)
    for mask, hidden in calls:
        assert hidden.shape[1] == TEXT + kept
        assert torch.equal(mask, full[..., : TEXT + kept, : TEXT + kept])


def test_image_tokens_in_two_segments_run_unmerged_with_one_warning():
    # several images packed in one row: the mask differs over the image, so no slice fits it
    model, kw = FAM.make(), FAM.inputs(2)
    segments = kw["segment_ids"].clone()
    segments[:, -7:] = 2
    kw["segment_ids"] = segments
    reference = FAM.output(model, kw)
    toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = FAM.output(model, kw)
        FAM.output(model, kw)
    messages = [str(w.message) for w in caught if "ToMA" in str(w.message)]
    assert len(messages) == 1 and "segment_ids that differ over the image" in messages[0]
    assert torch.equal(out, reference)


def test_image_tokens_that_do_not_end_the_sequence_run_unmerged_with_one_warning():
    model, kw = FAM.make(), FAM.inputs(1)
    order = torch.cat([torch.arange(TEXT, TEXT + 80), torch.arange(TEXT)])  # [image; text]
    kw = {k: (v[:, order] if k != "timestep" else v) for k, v in kw.items()}
    reference = FAM.output(model, kw)
    toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = FAM.output(model, kw)
    messages = [str(w.message) for w in caught if "ToMA" in str(w.message)]
    assert len(messages) == 1 and "not the last of the packed sequence" in messages[0]
    assert torch.equal(out, reference)


def test_the_unconditional_image_only_call_merges_and_removes_bitwise():
    model, kw = FAM.make(), ideogram4_inputs(2, 8, 10, image_only=True)
    assert kw["hidden_states"].shape[1] == math.prod(GRID)
    reference = FAM.output(model, kw)
    toma.apply_toma(model, ratio=0.0, **FAM.every_part())
    assert torch.equal(FAM.output(model, kw), reference)
    toma.remove_toma(model)
    patch = toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    kept = patch.cache.layout(*GRID, ratio=0.5).num_merged
    calls = attention_calls(model, kw)
    assert calls and all(hidden.shape[1] == kept for _, hidden in calls)
    out = FAM.output(model, kw)
    assert torch.isfinite(out).all() and not torch.equal(out, reference)
    assert toma.remove_toma(model) and torch.equal(FAM.output(model, kw), reference)


def layouts_used(monkeypatch, model, kw) -> tuple[torch.Tensor, list]:
    """The output of ``model`` on ``kw`` and the tile layouts its forwards asked for."""
    from toma.adapters.state import PlanCache

    real, used = PlanCache.tile_order_layout, []
    monkeypatch.setattr(
        PlanCache, "tile_order_layout", lambda self, *a, **k: used.append(real(self, *a, **k)) or used[-1]
    )
    out = FAM.output(model, kw)
    monkeypatch.setattr(PlanCache, "tile_order_layout", real)
    return out, used


def test_both_transformers_calls_run_in_tile_order_as_in_raster_order(monkeypatch):
    from toma.adapters.state import PlanCache

    model = FAM.make()
    toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    for kw in (FAM.inputs(2), ideogram4_inputs(2, 8, 10, image_only=True)):
        tiled, used = layouts_used(monkeypatch, model, kw)
        assert used and all(layout is not None for layout in used)
        monkeypatch.setattr(PlanCache, "tile_order_layout", lambda self, *a, **k: None)
        raster = FAM.output(model, kw)
        monkeypatch.undo()
        # the same plans and merges; attention sums keys in another order (float32 ulps)
        torch.testing.assert_close(tiled, raster, rtol=1e-4, atol=1e-5)


def test_a_per_token_timestep_keeps_raster_order_and_merges(monkeypatch):
    model, kw = FAM.make(), FAM.inputs(2)
    kw["timestep"] = torch.linspace(0.2, 0.4, kw["hidden_states"].shape[1]).expand(2, -1)  # (B, S)
    reference = FAM.output(model, kw)
    patch = toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    out, used = layouts_used(monkeypatch, model, kw)
    assert used == [] and patch.cache._plans  # raster order, merged
    assert torch.isfinite(out).all() and not torch.equal(out, reference)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_the_float_mask_is_built_once_per_forward_and_anew_for_another_mask(mode, monkeypatch):
    # with the bias, each merged call takes the segment mask and the log masses as one float
    # mask (B, 1, Sq, S): the merged layers of a plan build it once and share it, and the next
    # forward's mask (other segments, the plan kept for two steps) builds its own; under
    # inference_mode too (the benchmarks' mode), whose tensors keep no version counter
    from toma.adapters.attention import KeyBias

    built = []
    real = KeyBias._per_query
    monkeypatch.setattr(KeyBias, "_per_query", lambda self, bias: built.append(1) or real(self, bias))
    model, kw = FAM.make(), FAM.inputs(2)
    toma.apply_toma(model, ratio=0.5, proportional_attention=True, recompute_every=2, **FAM.every_part())
    with mode():
        first = model(**kw).sample
    assert len(built) == 1 and len(model.layers) > 1
    other = {**kw, "segment_ids": kw["segment_ids"].clone()}
    other["segment_ids"][0, :2] = 7  # sample 0's first two text slots now see only each other
    with mode():
        second = model(**other).sample  # the same plan: 2 steps a plan
    assert len(built) == 2
    for run, call in ((first, kw), (second, other)):  # each as a fresh patch computes it
        fresh = FAM.make()
        toma.apply_toma(fresh, ratio=0.5, proportional_attention=True, **FAM.every_part())
        assert torch.equal(run, FAM.output(fresh, call))
