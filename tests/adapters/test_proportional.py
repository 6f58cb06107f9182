"""Proportional attention: merged keys weighted by the tokens they stand for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import AttnProcessor2_0

import toma
from tests.cases import clustered_tokens
from tests.tiny_models import make_sd15_unet, unet_inputs
from toma.config import ToMAConfig
from toma.core.plan import build_plan
from toma.core.tiling import make_layout, to_tiles


@pytest.mark.parametrize("temperature", [0.0, 0.001])
def test_bias_makes_merged_attention_exact_on_duplicate_tokens(temperature):
    # 8 distinct values per tile and k = 8 destinations: merging loses nothing, and full
    # attention over the 16 tokens equals merged attention with a log(multiplicity) bias
    tiles = 3
    x = clustered_tokens(tiles)
    layout = make_layout(4, 4 * tiles, (4, 4), 0.5)
    plan = build_plan(to_tiles(x, layout), layout, x.dtype, selection="facility", temperature=temperature)
    masses = plan.log_mass.exp().reshape(tiles, 8)
    for t in range(tiles):
        assert sorted(masses[t].tolist()) == pytest.approx([1.0] * 7 + [9.0], abs=1e-4)

    q = x[:, None]  # one head
    full = F.scaled_dot_product_attention(q, q, q)[:, 0]
    m = plan.merge(x)[:, None]
    biased = plan.unmerge(F.scaled_dot_product_attention(m, m, m, attn_mask=plan.log_mass[:, None, None, :])[:, 0])
    plain = plan.unmerge(F.scaled_dot_product_attention(m, m, m)[:, 0])
    torch.testing.assert_close(biased, full, atol=1e-5, rtol=1e-5)
    assert (plain - full).abs().max() > 1e-2  # without the bias the repeated value is under-weighted


class _Recorder(AttnProcessor2_0):
    """diffusers' SDPA processor that records the attention mask it is given."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kw):
        self.seen.append(None if attention_mask is None else (attention_mask, attn.heads, hidden_states.shape[1]))
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, **kw)


def record_masks(unet, part: str) -> list:
    seen: list = []
    for name, module in unet.named_modules():
        if name.endswith(part) and "down_blocks.0" in name:
            module.set_processor(_Recorder(seen))
    return seen


@pytest.mark.parametrize("proportional", [True, False])
def test_unet_self_attention_gets_the_mass_bias(proportional):
    unet = make_sd15_unet()
    self_seen, cross_seen = record_masks(unet, "attn1"), record_masks(unet, "attn2")
    patch = toma.apply_toma(unet, ratio=0.5, merge_crossattn=True, proportional_attention=proportional)
    with torch.no_grad():
        unet(**unet_inputs(2, 16, 16, False))
    assert cross_seen == [None]  # cross-attention keys are text: nothing to weight
    if not proportional:
        assert self_seen == [None]
        return
    # 256 tokens at the top level -> 128 merged; one bias per merged key, laid out
    # (B * heads, 1, K) as diffusers' processors take it without repeating it per head
    [(mask, heads, tokens)] = self_seen
    [plan] = [p for _, p in patch.cache._plans.values() if p.num_merged == 128]
    assert tokens == 128 and mask.shape == (2 * heads, 1, 128)
    expected = plan.log_mass.repeat_interleave(heads, dim=0)[:, None, :]  # one plan per batch element
    assert plan.log_mass.shape[0] == 2 and torch.equal(mask, expected)


def test_proportional_attention_is_validated():
    with pytest.raises(TypeError, match="proportional_attention must be True, False or None"):
        ToMAConfig(proportional_attention=1)


@pytest.mark.parametrize("proportional", [None, True, False])
def test_flux_bias_covers_image_keys_only(proportional, monkeypatch):
    from diffusers.models.transformers import transformer_flux

    from tests.tiny_models import flux_inputs, make_flux

    masks = []
    real = transformer_flux.dispatch_attention_fn

    def recording(query, key, value, attn_mask=None, **kw):
        masks.append((attn_mask, key.shape[1]))
        return real(query, key, value, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(transformer_flux, "dispatch_attention_fn", recording)
    model = make_flux()
    patch = toma.apply_toma(model, ratio=0.5, proportional_attention=proportional)
    with torch.no_grad():
        model(**flux_inputs(2, 8, 8, text=5))
    # block 0 of each stack runs unmerged (default blocks); the merged double-stream and
    # single-stream block run once per sample (one rotary table per call, a plan per sample)
    merged = [(mask, keys) for mask, keys in masks if keys < 5 + 64]
    assert len(merged) == 4 and len(masks) == 6
    plans = [plan for _, plan in patch.cache._plans.values()]
    for mask, keys in masks:
        if proportional is False or keys == 5 + 64:  # None means on, on CPU
            assert mask is None
            continue
        assert mask.shape == (1, 1, 1, keys) and keys == 5 + 32
        assert torch.equal(mask[:, 0, 0, :5], torch.zeros(1, 5))  # text keys are not merged
        assert any(torch.equal(mask[0, 0, 0, 5:], plan.log_mass[b]) for plan in plans for b in range(2))
