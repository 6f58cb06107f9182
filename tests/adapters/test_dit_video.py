"""HunyuanVideo and CogVideoX on the adapter engine, on tiny models with random weights."""

from __future__ import annotations

import warnings

import pytest
import torch

import toma
from tests.cases import check_tile_order_matches_raster

from tests.tiny_models import (  # noqa: E402
    TEXT_DIM,
    cogvideox_inputs,
    hunyuan_inputs,
    make_cogvideox,
    make_hunyuan,
)

HUNYUAN_ALL = {"blocks": {"transformer_blocks": range(2), "single_transformer_blocks": range(2)}}
COG_ALL = {"blocks": {"transformer_blocks": range(3)}}

# case -> (family, model maker, inputs(batch, frames, latent height, latent width), every block,
# latent frames per token)
FAMILIES = {
    "hunyuanvideo": ("hunyuanvideo", make_hunyuan, hunyuan_inputs, HUNYUAN_ALL, 1),
    "cogvideox": ("cogvideox", make_cogvideox, cogvideox_inputs, COG_ALL, 1),
    "cogvideox1.5": (
        "cogvideox",
        lambda: make_cogvideox(patch_size_t=2),
        lambda *a, **k: cogvideox_inputs(*a, patch_t=2, **k),
        COG_ALL,
        2,
    ),
}


def run(model, **kw):
    with torch.no_grad():
        return model(**kw).sample


def attention_modules(model):
    """The blocks' attentions (not the text refiner's), in call order."""
    stacks = ("transformer_blocks.", "single_transformer_blocks.")
    return [m for name, m in model.named_modules() if name.startswith(stacks) and name.endswith((".attn", ".attn1"))]


def count_queries(model):
    """Token counts reaching ``to_q`` of every block's attention, in call order."""
    seen: list[int] = []
    handles = [
        m.to_q.register_forward_hook(lambda mod, a, o: seen.append(a[0].shape[1])) for m in attention_modules(model)
    ]
    return seen, handles


def twice(counts: list[int]) -> list[int]:
    """Counts of a batch of 2 whose samples have plans of their own: a call per sample."""
    return [c for c in counts for _ in range(2)]


def remove_all(handles):
    for handle in handles:
        handle.remove()


def test_hunyuan_merges_video_tokens_only():
    model = make_hunyuan()
    kw = hunyuan_inputs(1, 4, 12, 16, text=6)  # 4 x 6 x 8 tokens in 2 x 4 x 4 tiles
    patch = toma.apply_toma(model, ratio=0.5, merge_mlp=True, tile_size=4, **HUNYUAN_ALL)
    queries, handles = count_queries(model)
    text: list[int] = []
    mlp: list[int] = []
    handles += [
        b.attn.add_q_proj.register_forward_hook(lambda m, a, o: text.append(a[0].shape[1]))
        for b in model.transformer_blocks
    ]
    handles += [
        b.ff.net[0].register_forward_hook(lambda m, a, o: mlp.append(a[0].shape[1])) for b in model.transformer_blocks
    ]
    run(model, **kw)
    remove_all(handles)
    layout = patch.cache.layout(4, 6, 8)
    assert (layout.tt, layout.th, layout.tw) == (1, 4, 4) and layout.num_merged == 96  # 2-D tiles by default
    # dual-stream blocks project video alone, single-stream blocks [video; text] together
    assert queries == [96, 96, 96 + 6, 96 + 6]
    assert text == [6, 6] and mlp == [96, 96]  # text whole; the video MLP merged
    assert [p.name for p in patch.patched] == [
        "transformer_blocks.0.attn",
        "transformer_blocks.0.ff",
        "transformer_blocks.1.attn",
        "transformer_blocks.1.ff",
        "single_transformer_blocks.0.attn",
        "single_transformer_blocks.1.attn",
    ]


@pytest.mark.parametrize("case", ["cogvideox", "cogvideox1.5"])
def test_cogvideox_merges_video_tokens_only(case):
    _, make, inputs, blocks, patch_t = FAMILIES[case]
    model = make()
    kw = inputs(1, 4, 12, 16, text=5)  # (4 / patch_t) x 6 x 8 tokens
    patch = toma.apply_toma(model, ratio=0.5, merge_mlp=True, **blocks)
    queries, handles = count_queries(model)
    mlp: list[int] = []
    handles += [
        b.ff.net[0].register_forward_hook(lambda m, a, o: mlp.append(a[0].shape[1])) for b in model.transformer_blocks
    ]
    run(model, **kw)
    remove_all(handles)
    kept = patch.cache.layout(4 // patch_t, 6, 8).num_merged
    assert kept == 4 // patch_t * 24
    assert queries == [5 + kept] * 3  # [text; merged video], the text whole
    assert mlp == [5 + kept] * 3  # the MLP's [text; video] sequence, its video merged


def test_default_blocks_skip_the_first_five():
    model = make_hunyuan(layers=12, single=20)
    patch = toma.apply_toma(model, ratio=0.5)
    attn = [p.name for p in patch.patched]
    assert attn == [f"transformer_blocks.{i}.attn" for i in range(5, 12)] + [
        f"single_transformer_blocks.{i}.attn" for i in range(5, 20)
    ]
    model = make_cogvideox(layers=12)
    assert [p.name for p in toma.apply_toma(model, ratio=0.5).patched] == [
        f"transformer_blocks.{i}.attn1" for i in range(5, 12)
    ]


@pytest.mark.parametrize("case", FAMILIES)
@pytest.mark.parametrize("frames,h,w", [(1, 12, 16), (3, 10, 14), (5, 8, 20)])
@pytest.mark.parametrize("tile_frames", [None, 2])  # the default 2-D tiles, and 2-frame tiles that pad odd counts
def test_frames_and_grids_the_tiles_do_not_divide(case, frames, h, w, tile_frames):
    family, make, inputs, blocks, patch_t = FAMILIES[case]
    frames *= patch_t  # CogVideoX 1.5 patches 2 latent frames into one token
    model, kw = make(), inputs(2, frames, h, w)
    ref = run(model, **kw)
    patch = toma.apply_toma(model, ratio=0.5, tile_frames=tile_frames, **blocks)
    queries, handles = count_queries(model)
    out = run(model, **kw)
    remove_all(handles)
    assert out.shape == ref.shape and torch.isfinite(out).all() and not torch.equal(out, ref)
    kept = patch.cache.layout(frames // patch_t, h // 2, w // 2).num_merged
    assert kept < frames // patch_t * (h // 2) * (w // 2)
    text = kw["encoder_hidden_states"].shape[1]
    joint = [kept, kept, kept + text, kept + text] if family == "hunyuanvideo" else [text + kept] * 3
    assert queries == twice(joint)  # the two samples have plans of their own: one call each


@pytest.mark.parametrize("case", FAMILIES)
@pytest.mark.parametrize("tile_frames", [None, 2])
def test_tile_order_matches_raster_order(case, monkeypatch, tile_frames, tile_orders):
    # tokens reordered once per forward compute what per-site raster merging computes
    _, make, inputs, blocks, patch_t = FAMILIES[case]
    model, kw = make(), inputs(2, 4 * patch_t, 16, 16)
    toma.apply_toma(model, ratio=0.5, merge_mlp=True, tile_frames=tile_frames, **blocks)
    check_tile_order_matches_raster(model, kw, monkeypatch, run, tile_orders)


def recorded_tables(model, attn, kw):
    """The rotary tables each call of ``attn``'s processor receives in one forward."""
    seen = []
    original = attn.processor

    class Recording:  # a class: Attention passes a processor only the keywords its __call__ names
        def __call__(
            self, attn_, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None
        ):
            seen.append(image_rotary_emb)
            return original(attn_, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

    attn.processor = Recording()
    run(model, **kw)
    attn.processor = original
    return seen


@pytest.mark.parametrize("case", FAMILIES)
def test_rotary_rows_are_the_destinations(case):
    family, make, inputs, blocks, patch_t = FAMILIES[case]
    model, kw = make(), inputs(2, 4 * patch_t, 8, 16)  # 4 x 4 x 8 tokens: 4 tiles, in tile order
    patch = toma.apply_toma(model, ratio=0.5, **blocks)
    attn = attention_modules(model)[-1]
    seen = recorded_tables(model, attn, kw)
    [plan] = [p for _, p in patch.cache._plans.values()]
    toma.remove_toma(model)  # the rotary module's own output again: raster order
    full = model.rope(kw["hidden_states"]) if family == "hunyuanvideo" else kw["image_rotary_emb"]
    # the processor takes one table for the batch: one call per sample, with that sample's rows
    assert len(seen) == 2
    for b, (cos, sin) in enumerate(seen):
        assert cos.shape == (plan.num_merged, full[0].shape[-1])
        assert torch.equal(cos, full[0][plan.dest_tokens[b]]) and torch.equal(sin, full[1][plan.dest_tokens[b]])


def test_hunyuan_shared_batch_plan_runs_one_call():
    model = make_hunyuan()
    kw = hunyuan_inputs(2, 2, 8, 8)
    patch = toma.apply_toma(model, ratio=0.5, share_batch_plan=True, **HUNYUAN_ALL)
    attn = model.transformer_blocks[0].attn
    seen = recorded_tables(model, attn, kw)
    [plan] = [p for _, p in patch.cache._plans.values()]
    assert len(seen) == 1 and seen[0][0].shape == (plan.num_merged, 8)


def test_hunyuan_text_padding_stays_masked():
    # padded text tokens are masked out of every attention, merged or not: their values
    # cannot reach the video (masked keys weigh exactly 0)
    model = make_hunyuan()
    kw = hunyuan_inputs(2, 2, 16, 16, text=6, padded=2)
    patch = toma.apply_toma(model, ratio=0.5, **HUNYUAN_ALL)
    queries, handles = count_queries(model)
    out = run(model, **kw)
    remove_all(handles)
    kept = patch.cache.layout(2, 8, 8).num_merged
    assert queries == twice([kept, kept, kept + 6, kept + 6])  # merged, padded text and all
    changed = dict(kw, encoder_hidden_states=kw["encoder_hidden_states"].clone())
    changed["encoder_hidden_states"][1, -2:] = 100.0
    torch.testing.assert_close(run(model, **changed), out, rtol=0, atol=1e-6)
    changed["encoder_hidden_states"][1, 0] = 100.0  # a real text token does reach the video
    assert not torch.allclose(run(model, **changed)[1], out[1], rtol=0, atol=1e-3)


def test_hunyuan_mask_that_does_not_fit_runs_unmerged_with_one_warning(monkeypatch):
    from toma.adapters.families import hunyuanvideo

    monkeypatch.setattr(hunyuanvideo, "_joint_mask", lambda mask, tokens, kept: None)
    model = make_hunyuan()
    kw = hunyuan_inputs(2, 2, 8, 8)
    ref = run(model, **kw)
    # 4x4 tiles divide the grid, where calls that run unmerged in tile order are bitwise
    toma.apply_toma(model, ratio=0.5, tile_size=4, blocks={"transformer_blocks": [0]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(model, **kw)
        run(model, **kw)
    messages = [str(w.message) for w in caught if "ToMA" in str(w.message)]
    assert messages == ["ToMA: Attention got an attention mask it cannot fit to merged tokens; such calls run unmerged"]
    assert torch.equal(out, ref)


def test_hunyuan_token_replace_merges_in_raster_order(tile_orders):
    # image-to-video modulates the first frame's tokens by their raster place
    model = make_hunyuan(in_channels=8, image_condition_type="token_replace")
    g = torch.Generator().manual_seed(2)
    kw = dict(hunyuan_inputs(2, 3, 8, 16), hidden_states=torch.randn(2, 8, 3, 8, 16, generator=g))
    ref = run(model, **kw)
    toma.apply_toma(model, ratio=0.5, **HUNYUAN_ALL)
    queries, handles = count_queries(model)
    out = run(model, **kw)
    remove_all(handles)
    assert tile_orders == [] and torch.isfinite(out).all() and not torch.equal(out, ref)
    assert queries[0] < 3 * 4 * 8  # merged all the same


def test_hunyuan_set_attention_backend_reaches_merged_attention(monkeypatch):
    from diffusers.models.transformers import transformer_hunyuan_video as module

    model, kw = make_hunyuan(), hunyuan_inputs(1, 2, 16, 16)
    seen = []
    real = module.dispatch_attention_fn
    monkeypatch.setattr(
        module,
        "dispatch_attention_fn",
        lambda *a, backend=None, **k: seen.append((a[0].shape[1], backend)) or real(*a, backend=backend, **k),
    )
    ref = run(model, **kw)
    patch = toma.apply_toma(model, ratio=0.5, **HUNYUAN_ALL)
    model.set_attention_backend("_native_math")
    seen.clear()
    merged = run(model, **kw)
    kept = patch.cache.layout(2, 8, 8).num_merged
    assert [n for n, _ in seen] == [kept + 6] * 4  # [merged video; text] keys in every block
    assert all(str(b) == "AttentionBackendName._NATIVE_MATH" for _, b in seen)
    assert not torch.allclose(merged, ref, rtol=1e-4, atol=1e-5)


def test_cogvideox_runs_its_own_processor_after_set_attention_backend():
    # CogVideoX's processor calls torch's SDPA itself (diffusers routes it through no
    # dispatcher), so set_attention_backend is accepted and the merged call still runs it
    from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0

    model, kw = make_cogvideox(), cogvideox_inputs(1, 2, 16, 16)
    ref = run(model, **kw)
    patch = toma.apply_toma(model, ratio=0.5, **COG_ALL)
    model.set_attention_backend("_native_math")
    calls = []
    real = CogVideoXAttnProcessor2_0.__call__
    for attn in attention_modules(model):
        assert type(attn.processor) is CogVideoXAttnProcessor2_0

    def spy(self, attn, hidden_states, *a, **k):
        calls.append(hidden_states.shape[1])
        return real(self, attn, hidden_states, *a, **k)

    CogVideoXAttnProcessor2_0.__call__ = spy
    try:
        merged = run(model, **kw)
    finally:
        CogVideoXAttnProcessor2_0.__call__ = real
    assert calls == [patch.cache.layout(2, 8, 8).num_merged] * 3
    assert not torch.allclose(merged, ref, rtol=1e-4, atol=1e-5)


def test_cogvideox_pipeline_round_trip(tmp_path):
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline
    from transformers import T5Config, T5EncoderModel

    from tests.tiny_pipelines import merged_round_trip, tiny_clip_tokenizer

    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(
        down_block_types=("CogVideoXDownBlock3D",) * 3,
        up_block_types=("CogVideoXUpBlock3D",) * 3,
        block_out_channels=(8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    )
    pipe = CogVideoXPipeline(
        tokenizer=tiny_clip_tokenizer(tmp_path / "tok"),
        text_encoder=T5EncoderModel(T5Config(vocab_size=60, d_model=32, d_ff=32, d_kv=8, num_layers=1, num_heads=2)),
        vae=vae,
        transformer=make_cogvideox(text_dim=32),
        scheduler=CogVideoXDDIMScheduler(),
    )
    pipe.save_pretrained(tmp_path / "pipe")  # loading back puts the text encoder in eval mode (no dropout)
    pipe = CogVideoXPipeline.from_pretrained(tmp_path / "pipe", local_files_only=True)
    kw = dict(height=64, width=48, num_frames=5, num_inference_steps=2, max_sequence_length=8, output_type="np")

    def generate():
        return pipe("a red fox", generator=torch.Generator().manual_seed(0), **kw).frames

    # 5 frames x 64x48 px -> 2 x 16x12 latent (the tiny VAE quarters) -> 2 x 8x6 tokens, 48
    # kept; CFG's batch of 2 has a plan per sample, so one call per sample of [8 text; 48]
    merged_round_trip(pipe, generate, [(1, 8 + 48)] * 4, blocks={"transformer_blocks": range(3)})


def test_hunyuan_pipeline_round_trip(tmp_path):
    # Llama's tokenizer cannot be built offline: the one-letter CLIP tokenizer stands in,
    # with a template that adds nothing (crop_start 0)
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline
    from transformers import CLIPTextModel, LlamaConfig, LlamaModel

    from tests.tiny_pipelines import clip_config, merged_round_trip, tiny_clip_tokenizer, tiny_hunyuan_video_vae

    torch.manual_seed(0)
    vae = tiny_hunyuan_video_vae()
    llama = LlamaModel(
        LlamaConfig(
            vocab_size=60,
            hidden_size=TEXT_DIM,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    pipe = HunyuanVideoPipeline(
        tokenizer=tiny_clip_tokenizer(tmp_path / "tok"),
        text_encoder=llama,
        tokenizer_2=tiny_clip_tokenizer(tmp_path / "tok2"),
        text_encoder_2=CLIPTextModel(clip_config(max_position_embeddings=77)),
        vae=vae,
        transformer=make_hunyuan(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
    )
    pipe.save_pretrained(tmp_path / "pipe")
    pipe = HunyuanVideoPipeline.from_pretrained(tmp_path / "pipe", local_files_only=True)
    kw = dict(
        height=64,
        width=48,
        num_frames=5,
        num_inference_steps=2,
        max_sequence_length=12,
        output_type="np",
        prompt_template={"template": "{}", "crop_start": 0},
    )

    def generate():
        return pipe("a red fox", generator=torch.Generator().manual_seed(0), **kw).frames

    # 5 frames x 64x48 px -> 2 x 16x12 latent -> 2 x 8x6 tokens, 48 kept; 12 text tokens,
    # the padded ones masked; guidance-distilled, so one sample per step
    merged_round_trip(pipe, generate, [(1, 48)] * 2, blocks=HUNYUAN_ALL["blocks"])


def test_cogvideox_2b_without_rotary_merges():
    # CogVideoX-2B adds sin-cos positions at the patch embedding and passes no rotary tables
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        time_embed_dim=8,
        text_embed_dim=16,
        num_layers=2,
        sample_width=16,
        sample_height=16,
        sample_frames=9,
        patch_size=2,
        max_text_seq_length=8,
    ).eval()
    # its sin-cos table covers the text it was built for: the pipeline pads the prompt to max_text_seq_length
    kw = {k: v for k, v in cogvideox_inputs(2, 3, 16, 16, text=8).items() if k != "image_rotary_emb"}
    ref = run(model, **kw)
    patch = toma.apply_toma(model, ratio=0.5, blocks={"transformer_blocks": range(2)})
    queries, handles = count_queries(model)
    out = run(model, **kw)
    remove_all(handles)
    # no table to split by sample: one call for the batch
    assert queries == [8 + patch.cache.layout(3, 8, 8).num_merged] * 2
    assert torch.isfinite(out).all() and not torch.equal(out, ref)
    toma.remove_toma(model)
    assert torch.equal(run(model, **kw), ref)


@pytest.mark.parametrize("arch", ["tiny-hunyuanvideo", "tiny-cogvideox"])
def test_bench_runs_the_video_archs(tmp_path, capsys, arch):
    import json

    from toma.tools.cli import main

    rc = main(
        [
            "bench",
            "--arch",
            arch,
            "--depth",
            "2",
            "--frames",
            "9",
            "--resolution",
            "64",
            "--ratios",
            "0.5",
            "--methods",
            "none,toma,ideal",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--out",
            str(tmp_path),
            "--name",
            "v",
            "--no-progress",
        ]
    )
    assert rc == 0
    report = json.loads((tmp_path / "v.json").read_text())
    assert {r["method"] for r in report["results"]} == {"none", "toma", "ideal"}
    assert "3 latent frames" in capsys.readouterr().out
