"""Unmerging into the residual stream (:mod:`toma.adapters.residual`) on UNet blocks."""

from __future__ import annotations

import pytest
import torch

import toma
from tests.tiny_models import make_sd15_unet, make_sdxl_unet, unet_inputs
from toma.adapters import unet as unet_adapter
from toma.tools.opcount import count_kernels

OPTIONS = [
    {},
    {"merge_crossattn": True, "merge_mlp": True},
    {"share_batch_plan": True, "merge_mlp": True},  # shared weights repeated per batch for baddbmm
    {"proportional_attention": True},
]


def run(unet, **kw):
    with torch.no_grad():
        return unet(**kw).sample


def patched_run(unet, kw, options, fused: bool, monkeypatch) -> tuple[torch.Tensor, int, int]:
    """Output, kernel count and merged sub-modules of a ToMA forward, with the blocks' fused
    residual forward or (``fused=False``) with each sub-module unmerging on its own."""
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(unet_adapter, "fusable", lambda block: False)
        patch = toma.apply_toma(unet, ratio=0.5, **options)
        out = run(unet, **kw)
        kernels = sum(count_kernels(lambda: run(unet, **kw)).values())
        toma.remove_toma(unet)
    return out, kernels, len(patch.patched)


@pytest.mark.parametrize("options", OPTIONS)
def test_fused_residual_add_matches_separate_add_with_one_kernel_less_per_merge(options, monkeypatch):
    unet = make_sdxl_unet()
    kw = unet_inputs(2, 16, 16, True)
    fused, fused_kernels, merged = patched_run(unet, kw, options, True, monkeypatch)
    separate, separate_kernels, _ = patched_run(unet, kw, options, False, monkeypatch)
    # the same sums, in one kernel instead of two: at most a float32 rounding per add apart
    # (bitwise equal with the CPU's BLAS here), carried through a few blocks of the net
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5)
    # each merged sub-module's unmerge and the block's add are one baddbmm; a plan shared by
    # the batch also skips the broadcast matmul's copy of its weights
    assert separate_kernels - fused_kernels >= merged > 0


def test_each_merged_sub_module_adds_its_own_residual(monkeypatch):
    unet = make_sd15_unet()
    kw = unet_inputs(1, 16, 16, False)
    base = count_kernels(lambda: run(unet, **kw))
    patch = toma.apply_toma(unet, ratio=0.5, merge_crossattn=True, merge_mlp=True)
    ops = count_kernels(lambda: run(unet, **kw))
    merged = len(patch.patched)
    assert ops["baddbmm.default"] == merged
    plans = 1  # one merged level: one plan, whose scores add the similarities to their transpose
    assert base["add.Tensor"] - ops["add.Tensor"] == merged - plans
    toma.remove_toma(unet)
    assert torch.equal(run(unet, **kw), run(make_sd15_unet(), **kw))


@pytest.mark.parametrize("merge_mlp", [False, True])
def test_feed_forward_chunking_with_and_without_a_merged_mlp(merge_mlp, monkeypatch):
    # a block that keeps its chunking (its MLP unmerged) runs its own forward; one whose
    # merged MLP took the chunking over runs the fused one: both as without chunking
    unet = make_sd15_unet()
    kw = unet_inputs(1, 16, 16, False)
    options = {"merge_mlp": merge_mlp}
    plain, _, _ = patched_run(unet, kw, options, True, monkeypatch)
    blocks = [m for m in unet.modules() if hasattr(m, "set_chunk_feed_forward")]
    for block in blocks:
        block.set_chunk_feed_forward(1, dim=1)
    chunked, _, _ = patched_run(unet, kw, options, True, monkeypatch)
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-5)
    assert all(b._chunk_size == 1 for b in blocks)


def test_a_step_that_merges_nothing_is_the_block_bitwise():
    # outside the step window no sub-module merges: every add is the block's own, in its order
    unet = make_sdxl_unet()
    kw = unet_inputs(2, 16, 16, True)
    ref = run(unet, **kw)
    toma.apply_toma(unet, ratio=0.5, merge_crossattn=True, merge_mlp=True, start_step=1)
    assert torch.equal(run(unet, **kw), ref)
    toma.remove_toma(unet)


def test_ideal_unmerges_into_the_residual_add_exactly(monkeypatch):
    from toma.tools import baselines

    unet = make_sdxl_unet()
    kw = unet_inputs(2, 16, 16, True)
    outs = []
    for fused in (True, False):
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(unet_adapter, "fusable", lambda block: False)
            baselines.apply_ideal(unet, 0.5, merge_mlp=True)
            outs.append((run(unet, **kw), sum(count_kernels(lambda: run(unet, **kw)).values())))
            baselines.remove_baseline(unet)
    (fused_out, fused_kernels), (separate_out, separate_kernels) = outs
    assert torch.equal(fused_out, separate_out)  # the same adds of the same values
    assert fused_kernels < separate_kernels


def test_only_blocks_whose_forward_it_reproduces_are_fused():
    from diffusers.models.attention import BasicTransformerBlock

    from toma.adapters.residual import fusable

    def block(cls=BasicTransformerBlock, **kw):
        return cls(dim=16, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=8, **kw)

    class Scaled(BasicTransformerBlock):  # a forward of its own, with diffusers' signature
        def forward(
            self,
            hidden_states,
            attention_mask=None,
            encoder_hidden_states=None,
            encoder_attention_mask=None,
            timestep=None,
            cross_attention_kwargs=None,
            class_labels=None,
            added_cond_kwargs=None,
        ):
            return 2 * super().forward(
                hidden_states,
                attention_mask,
                encoder_hidden_states,
                encoder_attention_mask,
                timestep,
                cross_attention_kwargs,
                class_labels,
                added_cond_kwargs,
            )

    class Plain(BasicTransformerBlock):  # a subclass that keeps diffusers' forward
        pass

    assert fusable(block()) and fusable(block(Plain))
    assert not fusable(block(Scaled))
    assert not fusable(block(norm_type="ada_norm_zero", num_embeds_ada_norm=10))
    assert not fusable(block(positional_embeddings="sinusoidal", num_positional_embeddings=64))
