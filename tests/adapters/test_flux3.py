"""FLUX.3: the image's own blocks and the single-stream blocks merge the image; references
run unmerged. The conformance suite (tests/adapters/test_conformance.py) runs its table row."""

from __future__ import annotations

import warnings

import pytest
import torch

import toma
from tests.cases import check_exact_on_duplicates, clustered_tokens, force
from tests.tiny_models import flux3_inputs, make_flux3
from toma.adapters import attention as A

OPTIONS = {"blocks": {"mode_blocks.image": range(2), "single_transformer_blocks": range(2)}}


def run(model, kw):
    with torch.no_grad():
        return model(**kw).sample


def test_each_merged_attention_sees_the_merged_image_and_the_whole_text(monkeypatch):
    # in call order: the text's own 2 blocks (5 tokens, untouched), the image's 2 blocks
    # (64 tokens merged to 32), the 2 single-stream blocks (5 text + 32)
    from diffusers.models.transformers import transformer_flux3 as module

    queries: list[int] = []
    real = module.dispatch_attention_fn
    monkeypatch.setattr(
        module, "dispatch_attention_fn", lambda q, *a, **k: queries.append(q.shape[1]) or real(q, *a, **k)
    )
    model = make_flux3()
    toma.apply_toma(model, ratio=0.5, **OPTIONS)
    run(model, flux3_inputs(1, 8, 8))
    assert queries == [5, 5, 32, 32, 5 + 32, 5 + 32]
    # FLUX.3's pipeline scales the image's row and column ids by 0.5 (image_rope_scale): the
    # same 8x8 grid (read by the span, it was 4x4 and merged a quarter of the tokens' worth)
    queries.clear()
    kw = flux3_inputs(1, 8, 8)
    kw["img_ids"] = kw["img_ids"] * torch.tensor([1.0, 0.5, 0.5, 1.0])
    run(model, kw)
    assert queries == [5, 5, 32, 32, 5 + 32, 5 + 32]


def test_the_step_distilled_flow_map_model_merges_alike(monkeypatch):
    # flux-3-image-klein (16 steps, no guidance) is a flow map: its forward also takes the
    # timestep each step jumps to, embedded beside the timestep's; the tokens merge alike
    from diffusers.models.transformers import transformer_flux3 as module

    queries: list[int] = []
    real = module.dispatch_attention_fn
    monkeypatch.setattr(
        module, "dispatch_attention_fn", lambda q, *a, **k: queries.append(q.shape[1]) or real(q, *a, **k)
    )
    model = make_flux3(flow_map=True)
    kw = {**flux3_inputs(1, 8, 8), "target_timestep": torch.full((1,), 0.25)}
    ref = run(model, kw)
    toma.apply_toma(model, ratio=0.5, **OPTIONS)
    queries.clear()
    out = run(model, kw)
    assert queries == [5, 5, 32, 32, 5 + 32, 5 + 32]
    assert out.shape == ref.shape and torch.isfinite(out).all() and not torch.equal(out, ref)
    toma.remove_toma(model)
    assert torch.equal(run(model, kw), ref)


def test_a_call_with_references_runs_unmerged_and_says_why():
    model = make_flux3()
    kw = flux3_inputs(2, 8, 8, references=1)
    ref = run(model, kw)
    toma.apply_toma(model, ratio=0.5, **OPTIONS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(model, kw)
    assert torch.equal(out, ref)
    assert [str(w.message) for w in caught if "ToMA" in str(w.message) and "references" in str(w.message)]
    plain = flux3_inputs(2, 8, 8)  # and the same patch merges a call without them
    assert not torch.equal(run(model, plain), run(make_flux3(), plain))


@pytest.mark.parametrize("form", A.FORMS)
def test_proportional_attention_is_exact_on_duplicate_tokens(form, monkeypatch):
    # two 4x4 tiles, each holding one token 9 times and 7 others once, rotary tables of no
    # rotation: the 8 destinations of ratio 0.5 keep one of each, and with the log(mass)
    # bias (the text's keys first, log mass 0, in the single-stream blocks) every merged
    # attention computes what the unmerged one does, to fp32 rounding
    force(monkeypatch, form)
    model = make_flux3()
    model.pos_embed.register_forward_hook(lambda m, args, out: (torch.ones_like(out[0]), torch.zeros_like(out[1])))
    kw = flux3_inputs(1, 4, 8)
    kw["hidden_states"] = clustered_tokens(2)
    check_exact_on_duplicates(model, kw, run, **OPTIONS)


def test_the_modular_pipeline_merges_and_removal_is_exact(tmp_path, monkeypatch):
    # FLUX.3 has a modular pipeline only: apply_toma takes it as it takes a pipeline (its
    # transformer component), through the blocks' own text encoding (a tiny Qwen3-VL, one
    # layer's states for the text_encoder_out_layers stack), latents and guidance passes
    import numpy as np
    from diffusers.models.transformers import transformer_flux3 as module

    from tests.tiny_pipelines import tiny_flux3_modular_pipeline

    pipe = tiny_flux3_modular_pipeline(tmp_path / "tok", make_flux3())

    def generate():
        images = pipe(
            prompt="a red fox",
            height=64,
            width=64,
            num_inference_steps=2,
            text_encoder_out_layers=(1,),
            generator=torch.Generator().manual_seed(0),
            output="images",
        )
        return np.stack([np.asarray(image) for image in images])

    queries: list[int] = []
    real = module.dispatch_attention_fn
    monkeypatch.setattr(
        module, "dispatch_attention_fn", lambda q, *a, **k: queries.append(q.shape[1]) or real(q, *a, **k)
    )
    ref = generate()
    unmerged, queries[:] = list(queries), []
    patch = toma.apply_toma(pipe, ratio=0.5, **OPTIONS)
    assert patch is toma.get_toma(pipe.transformer)
    merged = generate()
    # 64 px: 16x16 packed tokens; 2 steps x (prompt, negative prompt) passes, each: the
    # text's 2 blocks, the image's 2 (256 -> 128), the 2 single-stream ones ([text; image])
    text = unmerged[0]
    assert unmerged == ([text] * 2 + [256] * 2 + [text + 256] * 2) * 4
    assert queries == ([text] * 2 + [128] * 2 + [text + 128] * 2) * 4
    assert merged.shape == ref.shape and not np.array_equal(merged, ref)
    toma.remove_toma(pipe)
    assert np.array_equal(generate(), ref)
