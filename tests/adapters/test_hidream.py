"""HiDream's own cases: non-square images (padded to ``max_resolution``'s token count with
masked keys) and patchified calls with their own mask run bitwise unmerged, with one warning
that says why; the mixture-of-experts MLPs see the merged tokens, and the text after them whole."""

from __future__ import annotations

import warnings

import pytest
import torch

import toma
from tests.tiny_models import FAMILIES, hidream_inputs

FAM = FAMILIES["hidream"]


def patchified(kw: dict, model: torch.nn.Module) -> dict:
    """The call with its latents patchified by the model, and the mask and ids that go with them."""
    tokens, masks, sizes, ids = model.patchify(kw["hidden_states"])
    masks = torch.ones(tokens.shape[:2]) if masks is None else masks
    return {**kw, "hidden_states": tokens, "hidden_states_masks": masks, "img_sizes": sizes, "img_ids": ids}


@pytest.mark.parametrize("kind, words", [("non-square", "non-square"), ("patchified", "hidden_states_masks")])
def test_unmergeable_calls_run_unmerged_with_one_warning(kind, words):
    model = FAM.make()
    kw = hidream_inputs(2, 6, 10) if kind == "non-square" else patchified(hidream_inputs(2, 8, 8), model)
    ref = FAM.output(model, kw)
    patch = toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [FAM.output(model, kw) for _ in range(2)]
    said = [str(w.message) for w in caught if "ToMA" in str(w.message)]
    assert len(said) == 1 and words in said[0], said
    assert not patch.cache._plans  # nothing merged
    assert all(torch.equal(out, ref) for out in outs)


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
