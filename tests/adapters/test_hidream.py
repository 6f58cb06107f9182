"""HiDream's own cases: non-square images (their tokens padded to ``max_resolution``'s
count, the padding's keys zeroed by a mask) merge with the mask fitted to the merged
tokens; patchified calls with a mask of their own run bitwise unmerged, with one warning;
the mixture-of-experts MLPs see the merged tokens, and the text after them whole."""

from __future__ import annotations

import warnings

import pytest
import torch

import toma
from tests.tiny_models import FAMILIES, hidream_inputs
from toma.core.masks import slice_image_first_mask

FAM = FAMILIES["hidream"]


def patchified(kw: dict, model: torch.nn.Module) -> dict:
    """The call with its latents patchified by the model, and the mask and ids that go with them."""
    tokens, masks, sizes, ids = model.patchify(kw["hidden_states"])
    masks = torch.ones(tokens.shape[:2]) if masks is None else masks
    return {**kw, "hidden_states": tokens, "hidden_states_masks": masks, "img_sizes": sizes, "img_ids": ids}


def test_patchified_calls_with_their_own_mask_run_unmerged_with_one_warning():
    model = FAM.make()
    kw = patchified(hidream_inputs(2, 8, 8), model)
    ref = FAM.output(model, kw)
    patch = toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [FAM.output(model, kw) for _ in range(2)]
    said = [str(w.message) for w in caught if "ToMA" in str(w.message)]
    assert len(said) == 1 and "hidden_states_masks" in said[0], said
    assert not patch.cache._plans  # nothing merged
    assert all(torch.equal(out, ref) for out in outs)


def test_an_image_first_mask_keeps_its_last_positions():
    mask = torch.tensor([[1.0, 1, 1, 1, 0, 0, 1], [1, 1, 1, 1, 0, 1, 1]])  # 4 image positions, then 3
    assert torch.equal(slice_image_first_mask(mask, 4, 2), mask[:, 2:])
    square = mask[:, None, :, None] * mask[:, None, None, :]  # one row per query
    assert torch.equal(slice_image_first_mask(square, 4, 1), square[:, :, 3:, 3:])
    with pytest.raises(ValueError, match="kept"):
        slice_image_first_mask(mask, 4, 5)


class Spy:
    """A processor that records the hidden states and key mask of each call, then runs the real one."""

    def __init__(self, processor, calls: list) -> None:
        self.processor, self.calls = processor, calls

    def __call__(self, attn, hidden_states, hidden_states_masks=None, **kwargs):
        self.calls.append((hidden_states, hidden_states_masks))
        return self.processor(attn, hidden_states, hidden_states_masks, **kwargs)


def test_a_non_square_image_merges_with_its_padding_mask_fitted():
    # 6x10 tokens padded to 256 (max_resolution 32x32 latents over 2x2 patches): each merged
    # attention gets K image tokens, then the pad tokens and the text whole, and a key mask
    # of as many positions whose first K are the image's ones and the rest the model's own
    model, kw = FAM.make(), hidream_inputs(2, 6, 10)
    n, pad = 60, model.max_seq - 60
    ref = FAM.output(model, kw)
    given: dict[str, list] = {}  # what each attention module gets, before ToMA's hook merges it
    seen: dict[str, list] = {}  # what its processor gets
    for stack in ("double_stream_blocks", "single_stream_blocks"):
        attn = getattr(model, stack)[1].block.attn1
        attn.register_forward_pre_hook(lambda mod, args, stack=stack: given.setdefault(stack, args[:2]) and None)
        attn.processor = Spy(attn.processor, seen.setdefault(stack, []))
    patch = toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    out = FAM.output(model, kw)
    [k] = {p.num_merged for _, p in patch.cache._plans.values()}
    assert k < n
    for stack, [(x, mask)] in seen.items():
        x0, mask0 = given[stack]
        assert x.shape[1] == x0.shape[1] - n + k == mask.shape[1]
        assert torch.equal(mask[:, :k], torch.ones(2, k)) and torch.equal(mask[:, k:], mask0[:, n:])
        assert torch.equal(x[:, k:], x0[:, n:])  # the padding (and the single blocks' text) whole
        assert mask0[:, n : n + pad].abs().sum() == 0  # the padding's keys are the ones zeroed
    # merging moves a non-square output about as much as a square one's (0.13 of 1.9 here)
    assert out.shape == ref.shape and 0 < (out - ref).abs().max() < 0.25 * ref.abs().max()


def test_the_experts_see_the_merged_image_then_the_text_whole():
    model, kw = FAM.make(), hidream_inputs(1, 8, 8)
    seen: dict[str, int] = {}
    for stack in ("double_stream_blocks", "single_stream_blocks"):
        gate = getattr(model, stack)[1].block.ff_i.gate
        gate.register_forward_pre_hook(lambda mod, args, stack=stack: seen.setdefault(stack, args[0].shape[1]) and None)
    FAM.output(model, kw)
    full = dict(seen)
    seen.clear()
    patch = toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    FAM.output(model, kw)
    [k] = {p.num_merged for _, p in patch.cache._plans.values()}
    n, text = 64, full["single_stream_blocks"] - 64
    assert full["double_stream_blocks"] == n and text == 5 + 3 + 3  # T5, the last Llama layer's, this block's
    assert k < n and seen == {"double_stream_blocks": k, "single_stream_blocks": k + text}
