"""FramePack's own case: the video stream is ``[history; generated]``; each merged call
merges the generated latents' tokens at its end, and the packed history passes whole,
as does the model's key mask over it (cut to the merged keys, the text padding kept)."""

from __future__ import annotations

import pytest
import torch

import toma
from tests.cases import clustered_tokens, force
from tests.tiny_models import FAMILIES, framepack_inputs
from toma.adapters import attention as A

FAM = FAMILIES["framepack"]


class Spy:
    """A processor that records the video stream and the mask of each call, then runs the real one."""

    def __init__(self, processor, calls: list) -> None:
        self.processor, self.calls = processor, calls

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        self.calls.append((hidden_states, attention_mask))
        return self.processor(attn, hidden_states, encoder_hidden_states, attention_mask, **kwargs)


def test_the_history_passes_whole_and_the_generated_tokens_merge():
    model, kw = FAM.make(), framepack_inputs(2, 3, 16, 16)  # 3 x 8 x 8 generated tokens
    n = 3 * 8 * 8
    history = 3 * 64 + 2 * 16 + 1 * 4  # clean (3 frames at 1x), 2x (4 -> 2 frames), 4x (4 -> 1)
    given: dict[str, tuple] = {}  # what each attention module gets, before ToMA's hook merges it
    seen: dict[str, list] = {}  # what its processor gets
    for stack in ("transformer_blocks", "single_transformer_blocks"):
        attn = getattr(model, stack)[1].attn
        attn.register_forward_pre_hook(
            lambda mod, args, kwargs, stack=stack: given.setdefault(stack, (kwargs["hidden_states"],)) and None,
            with_kwargs=True,
        )
        attn.processor = Spy(attn.processor, seen.setdefault(stack, []))
    patch = toma.apply_toma(model, ratio=0.5, proportional_attention=False, merge_mlp=True, **FAM.options)
    FAM.output(model, kw)
    [k] = {p.num_merged for _, p in patch.cache._plans.values()}
    assert k < n
    for stack, calls in seen.items():  # one call per sample: a rotary table for the batch, a plan each
        [x0] = given[stack]
        assert len(calls) == 2
        for b, (x, mask) in enumerate(calls):
            assert x0.shape[1] == history + n and x.shape[1] == history + k
            assert torch.equal(x[:, :history], x0[b : b + 1, :history])  # the history, bitwise
            text = mask.shape[-1] - history - k  # the image embedding's 3 tokens and the prompt's 6
            assert text == 3 + 6 and mask[..., : history + k].all()
            assert mask.all() == (b == 0)  # the second sample's last 2 text tokens stay masked


@pytest.mark.parametrize("form", A.FORMS)
def test_the_bias_is_exact_on_duplicate_tokens_behind_the_history(form, monkeypatch):
    # two 4x4 tiles of one token 9 times and 7 others are the generated tokens (rotary
    # tables of cos 1, sin 0 rotate nothing): merged attention with the log(mass) bias, the
    # history's keys before the merged ones and the text's after at log mass 0, computes the
    # unmerged one, by every form
    force(monkeypatch, form)
    model, kw = FAM.make(), framepack_inputs(1, 1, 8, 16)  # 1 x 4 x 8 generated tokens
    model.x_embedder.register_forward_hook(lambda m, args, out: clustered_tokens(2, channels=out.shape[-1]))
    model.rope.register_forward_hook(lambda m, args, out: (torch.ones_like(out[0]), torch.zeros_like(out[1])))
    ref = FAM.output(model, kw)
    outs = {}
    for proportional in (True, False):
        options = {"blocks": {"transformer_blocks": [0], "single_transformer_blocks": []}}
        toma.apply_toma(model, ratio=0.5, tile_size=4, proportional_attention=proportional, **options)
        outs[proportional] = FAM.output(model, kw)
        toma.remove_toma(model)
    torch.testing.assert_close(outs[True], ref, rtol=1e-4, atol=1e-5)
    assert (outs[False] - ref).abs().max() > 1e-3
