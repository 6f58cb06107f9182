"""Dual-stream MMDiTs with rotary positions on the engine (QwenImage, Flux.2), and the
engine's per-sample calls for processors that take one rotary table for the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxPosEmbed

from toma.adapters.base import HOOK_NAME, remove_hook
from toma.adapters.engine import FamilySpec, Rotary, Site, attach, find_targets
from toma.config import ToMAConfig
from toma.core.plan import PlanCache


# ------------------------------------------------------------------ the engine, on a toy model
class _SharedRotaryAttention(torch.nn.Module):
    """Joint attention over [text; image] that applies one ``(S, D)`` rotary table to the
    whole batch, as diffusers' ``apply_rotary_emb`` does (``cos[None, :, None, :]``)."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, image_rotary_emb):
        text = encoder_hidden_states.shape[1]
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(2)  # (B, S, heads, D) each
        q, k = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1), apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        o = self.out(o.transpose(1, 2).flatten(2))
        return o[:, text:], o[:, :text]


class _ToyBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.attn = _SharedRotaryAttention()

    def forward(self, hidden_states, encoder_hidden_states, image_rotary_emb):
        image, text = self.attn(self.norm(hidden_states), encoder_hidden_states, image_rotary_emb=image_rotary_emb)
        return hidden_states + image, encoder_hidden_states + text


class ToyMMDiT(torch.nn.Module):
    """Image tokens ``(B, h*w, 4)`` and text ``(B, T, 16)``; rotary rows for [text; image]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj_in = torch.nn.Linear(4, 16)
        self.rope = FluxPosEmbed(theta=10000, axes_dim=[4, 4])
        self.blocks = torch.nn.ModuleList([_ToyBlock() for _ in range(2)])
        self.norm_out = torch.nn.LayerNorm(16)

    def forward(self, hidden_states, encoder_hidden_states, height: int, width: int):
        text = encoder_hidden_states.shape[1]
        rows = torch.arange(height).repeat_interleave(width)
        cols = torch.arange(width).repeat(height)
        ids = torch.cat([torch.stack([torch.arange(text) + 100, torch.zeros(text)], 1), torch.stack([rows, cols], 1)])
        tables = self.rope(ids.float())
        x = self.proj_in(hidden_states)
        for block in self.blocks:
            x, encoder_hidden_states = block(x, encoder_hidden_states, tables)
        return self.norm_out(x)


def _toy_spec(shared: bool) -> FamilySpec:
    rotary = Rotary("image_rotary_emb", None, shared=True) if shared else Rotary("image_rotary_emb", None, _keep_text_gather)
    return FamilySpec(
        name="toy",
        classes=("ToyMMDiT",),
        stacks=("blocks",),
        sites=lambda stack, block: [Site("attn", "attn", rotary=rotary)],
        grid=lambda model, call: (1, call["height"], call["width"]),
        enter=("output", "proj_in"),
        leave="norm_out",
        rope=("rope", 0),
    )


def _keep_text_gather(table, dest):
    # the per-sample (Bp, S, D) tables a broadcasting processor would take
    text = table.shape[0] - 48
    return torch.cat([table[:text].expand(dest.shape[0], -1, -1), table[text:][dest]], dim=1)


def _toy_inputs(batch: int) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(batch, 48, 4, generator=g), "encoder_hidden_states": torch.randn(batch, 3, 16, generator=g),
            "height": 6, "width": 8}


def _patch_toy(model: torch.nn.Module, spec: FamilySpec, **options) -> list[torch.nn.Module]:
    config = ToMAConfig(ratio=0.5, blocks={"blocks": range(2)}, **options)
    targets, _ = find_targets(spec, model, config)
    return attach(spec, model, targets, PlanCache(config))


def test_shared_rotary_runs_each_sample_with_its_own_table():
    # a batch of 2 with a plan per sample: each sample's output is its batch-1 output
    model = ToyMMDiT()
    kw = _toy_inputs(2)
    with torch.no_grad():
        ref = model(**kw)
    hooked = _patch_toy(model, _toy_spec(shared=True))
    calls: list[tuple] = []
    handle = model.blocks[1].attn.qkv.register_forward_hook(lambda m, a, o: calls.append(tuple(a[0].shape[:2])))
    with torch.no_grad():
        both = model(**kw)
        alone = [model(**{**kw, **{k: kw[k][b : b + 1] for k in ("hidden_states", "encoder_hidden_states")}}) for b in range(2)]
    handle.remove()
    assert calls[:2] == [(1, 3 + 24)] * 2  # one call per sample, text whole and half the 48 image tokens
    assert not torch.allclose(both, ref, atol=1e-3)
    for b in range(2):
        torch.testing.assert_close(both[b : b + 1], alone[b], rtol=1e-5, atol=1e-6)
    for module in hooked:
        remove_hook(module, HOOK_NAME)
    with torch.no_grad():
        assert torch.equal(model(**kw), ref)


def test_shared_rotary_with_one_plan_for_the_batch_makes_one_call():
    model = ToyMMDiT()
    _patch_toy(model, _toy_spec(shared=True), share_batch_plan=True)
    calls: list[tuple] = []
    model.blocks[0].attn.qkv.register_forward_hook(lambda m, a, o: calls.append(tuple(a[0].shape[:2])))
    with torch.no_grad():
        model(**_toy_inputs(2))
    assert calls == [(2, 3 + 24)]


def test_per_sample_tables_break_a_shared_table_processor():
    # the check above fails without the mechanism: per-sample tables do not broadcast
    model = ToyMMDiT()
    _patch_toy(model, _toy_spec(shared=False))
    with pytest.raises(RuntimeError):
        with torch.no_grad():
            model(**_toy_inputs(2))


def test_rotary_needs_a_gather_unless_shared():
    with pytest.raises(ValueError, match="Rotary needs a gather function unless shared=True"):
        Rotary("image_rotary_emb", None)
