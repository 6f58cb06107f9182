"""Lumina 2's per-sample caption lengths (toma/adapters/families/lumina2.py); the rest is the
conformance suite's (tests/tiny_models.py's ``lumina2`` row)."""

from __future__ import annotations

import pytest
import torch

import toma
from toma.adapters.families import lumina2
from toma.adapters.base import PREFIX_HOOK_NAME, remove_hook
from tiny_models import FAMILIES, lumina2_inputs

FAM = FAMILIES["lumina2"]
PADDED = 2  # the second sample's caption is 2 tokens shorter: its image starts 2 tokens earlier


def alone(kw: dict, b: int) -> dict:
    """Sample ``b`` of a call on its own, its caption cut to its effective length (no mask needed)."""
    keep = int(kw["encoder_attention_mask"][b].sum())
    return {
        "hidden_states": kw["hidden_states"][b : b + 1],
        "timestep": kw["timestep"][b : b + 1],
        "encoder_hidden_states": kw["encoder_hidden_states"][b : b + 1, :keep],
        "encoder_attention_mask": kw["encoder_attention_mask"][b : b + 1, :keep],
    }


def test_roll_right_and_left_are_inverse_per_sample_rolls():
    x = torch.arange(2 * 5 * 3).view(2, 5, 3)
    shift = torch.tensor([0, 2])
    rolled = lumina2.roll_right(x, shift)
    assert torch.equal(rolled[0], x[0])
    assert torch.equal(rolled[1], torch.roll(x[1], 2, dims=0))
    assert torch.equal(lumina2.roll_left(rolled, shift), x)


def test_a_padded_sample_merges_as_it_does_alone():
    # in a batch whose captions differ in length, the shorter sample's image starts earlier
    # and its sequence ends in padding; rolled per block, it merges its image exactly as it
    # does alone (no padding, no mask): the same plan, and outputs equal up to the order
    # of float sums (attention over keys in another order: ~1e-7 an op, under 1e-5 here)
    model, kw = FAM.make(), lumina2_inputs(2, 16, 20, padded=PADDED)
    toma.apply_toma(model, ratio=0.5, merge_mlp=True, **FAM.options)
    batch = FAM.output(model, kw)
    for b in range(2):
        single = FAM.output(model, alone(kw, b))
        torch.testing.assert_close(batch[b : b + 1], single, rtol=0, atol=1e-5)
    # without the roll the padded sample's last N tokens are caption and padding, not its image
    for block in model.layers:
        remove_hook(block, PREFIX_HOOK_NAME)
    unaligned = FAM.output(model, kw)
    assert (unaligned[1] - batch[1]).abs().max() > 1e-2
    torch.testing.assert_close(unaligned[0], batch[0], rtol=0, atol=1e-5)  # no padding: as before


def test_padded_batches_remove_and_ratio_zero_bitwise():
    model, kw = FAM.make(), lumina2_inputs(2, 16, 20, padded=PADDED)
    ref = FAM.output(model, kw)
    toma.apply_toma(model, ratio=0.0, merge_mlp=True, **FAM.options)
    assert torch.equal(FAM.output(model, kw), ref)  # nothing merges: nothing rolls
    toma.remove_toma(model)
    toma.apply_toma(model, ratio=0.5, merge_mlp=True, **FAM.options)
    assert not torch.equal(FAM.output(model, kw), ref)
    toma.remove_toma(model)
    assert torch.equal(FAM.output(model, kw), ref)


def test_padded_checkpointed_gradients_equal_plain_ones():
    # a block recomputed under gradient checkpointing rolls its inputs again: the same
    # gradients as a plain backward (the same ops in the same order: equal within 1e-6)
    grads = []
    for checkpointing in (False, True):
        model, kw = FAM.make(), lumina2_inputs(2, 16, 20, padded=PADDED)
        model.train()
        if checkpointing:
            model.enable_gradient_checkpointing()
        toma.apply_toma(model, ratio=0.5, merge_mlp=True, **FAM.options)
        FAM.sample(model, kw).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    plain, checkpointed = grads
    assert plain.keys() == checkpointed.keys() and plain
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=1e-6, msg=name)


def test_keys_other_than_the_hidden_states_run_unmerged():
    # Site.self_keys: the processor takes its keys from encoder_hidden_states, which the
    # block passes as its own hidden states; a call that passes other keys is not merged
    model, kw = FAM.make(), FAM.inputs(2)
    toma.apply_toma(model, ratio=0.5, **FAM.options)
    merged = FAM.output(model, kw)
    attn = model.layers[1].attn
    forward = attn.forward

    def other_keys(*args, **kwargs):
        kwargs["encoder_hidden_states"] = kwargs["encoder_hidden_states"].clone()
        return forward(*args, **kwargs)

    attn.forward = other_keys
    with pytest.warns(UserWarning, match="other than its hidden states"):
        out = FAM.output(model, kw)
    assert not torch.equal(out, merged)
