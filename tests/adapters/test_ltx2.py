"""LTX-2 beyond the conformance suite (its row is in tests/tiny_models.py): the audio stream
passes whole, the video-to-audio attention sees every video token, the "split" rotary layout
runs in tile order, the pipelines' ``video_coords`` merge as the model's own positions, and
the calls that keep raster order or run unmerged."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import toma
from tests.cases import tiled_and_raster
from tests.tiny_models import FAMILIES, ltx2_inputs, make_ltx2
from toma.adapters.base import Hook, register_innermost, remove_hook
from toma.adapters.state import PlanCache

FAM = FAMILIES["ltx2"]
AUDIO = 7  # audio tokens of ltx2_inputs
OPTIONS = {**FAM.every_part(), "ratio": 0.5}


def outputs(model, kw) -> tuple[torch.Tensor, torch.Tensor]:
    """The video and the audio prediction."""
    with torch.no_grad():
        out = model(**kw)
    return out.sample, out.audio_sample


def token_counts(model, kw) -> dict[str, list[int]]:
    """Per linear layer of the blocks' attentions and MLPs: the token count of its input at
    each call (inside toma's hooks where the model is patched)."""
    seen: dict[str, list[int]] = {}
    handles = []
    for name, layer in model.transformer_blocks.named_modules():
        if isinstance(layer, torch.nn.Linear):
            handles.append(
                layer.register_forward_pre_hook(
                    lambda mod, args, name=name: seen.setdefault(name, []).append(args[0].shape[1])
                )
            )
    try:
        outputs(model, kw)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_the_audio_stream_passes_whole_and_video_to_audio_sees_every_video_token():
    model, kw = FAM.make(), FAM.inputs(1)
    n = math.prod(FAM.grid)
    plain = token_counts(model, kw)
    patch = toma.apply_toma(model, **OPTIONS)
    merged = token_counts(model, kw)
    k = patch.cache.layout(*FAM.grid, ratio=0.5).num_merged
    assert k < n and plain.keys() == merged.keys()
    for name, counts in plain.items():
        site, layer = name.split(".")[1:3]  # without the block index
        if site in ("attn1", "ff") or (site in ("attn2", "audio_to_video_attn") and layer not in ("to_k", "to_v")):
            assert counts == [n] and merged[name] == [k], name  # the merged video sites, queries and outputs
        else:  # the audio stream, the text keys, the audio keys, video-to-audio's video keys
            assert merged[name] == counts, name
    assert plain["0.video_to_audio_attn.to_k"] == [n] and plain["0.audio_attn1.to_q"] == [AUDIO]


def test_ratio_zero_and_remove_are_bitwise_for_both_streams():
    model, kw = FAM.make(), FAM.inputs(2)
    video, audio = outputs(model, kw)
    toma.apply_toma(model, **{**OPTIONS, "ratio": 0.0})
    assert all(torch.equal(a, b) for a, b in zip(outputs(model, kw), (video, audio)))
    toma.apply_toma(model, **OPTIONS)
    merged_video, merged_audio = outputs(model, kw)
    assert merged_audio.shape == audio.shape and torch.isfinite(merged_audio).all()
    # the audio hears the merged video through video-to-audio attention's (whole) keys
    assert not torch.equal(merged_video, video) and not torch.equal(merged_audio, audio)
    toma.remove_toma(model)
    assert all(torch.equal(a, b) for a, b in zip(outputs(model, kw), (video, audio)))


class CallSpy(Hook):
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def pre_forward(self, module, *args, **kwargs):
        self.calls.append(kwargs["query_rotary_emb"])
        return args, kwargs


def test_the_split_rotary_layout_runs_in_tile_order(monkeypatch):
    # "split" tables are (B, H, N, D/2): both rotary modules' follow the tokens at dim -2,
    # and each merged site gets the rows of its destinations there
    model, kw = make_ltx2(rope_type="split"), ltx2_inputs(2, 4, 8, 8)
    reference = FAM.output(model, kw)
    patch = toma.apply_toma(model, **OPTIONS)
    tiled, raster = tiled_and_raster(model, kw, monkeypatch)
    assert (tiled - reference).abs().max() > 1e-3
    torch.testing.assert_close(tiled, raster, rtol=1e-4, atol=1e-5)
    monkeypatch.undo()
    coords = model.rope.prepare_video_coords(2, 4, 8, 8, "cpu")
    whole = {"attn1": model.rope(coords), "audio_to_video_attn": model.cross_attn_rope(coords[:, 0:1])}
    assert whole["attn1"][0].ndim == 4 and whole["attn1"][0].shape[2] == 4 * 8 * 8
    calls: dict[str, list] = {}
    for path in whole:
        register_innermost(model.transformer_blocks[0].get_submodule(path), CallSpy(calls.setdefault(path, [])), "spy")
    FAM.output(model, kw)
    for path in whole:
        remove_hook(model.transformer_blocks[0].get_submodule(path), "spy")
    [(_, plan)] = patch.cache._plans.values()
    dest = plan.dest_tokens
    assert not torch.equal(dest[0], dest[1])
    for path, tables in whole.items():
        [got] = calls[path]
        for full, merged in zip(tables, got):
            assert merged.shape == (2, full.shape[1], dest.shape[1], full.shape[3])
            for b in range(2):
                assert torch.equal(merged[b], full[b][:, dest[b]]), path


def test_the_pipelines_video_coords_merge_as_the_models_own_positions():
    model = FAM.make()
    kw, with_coords = FAM.inputs(2), ltx2_inputs(2, 4, 6, 8, coords=True)
    reference = FAM.output(model, with_coords)
    toma.apply_toma(model, **OPTIONS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merged = FAM.output(model, with_coords)
    assert torch.equal(merged, FAM.output(model, kw))
    assert (merged - reference).abs().max() > 1e-3


def test_a_timestep_per_token_merges_in_raster_order(monkeypatch):
    # image-to-video gives the conditioning frame's tokens their own timestep: the forward
    # modulates tokens in raster order, so they stay in it, and still merge
    model, kw = FAM.make(), FAM.inputs(2)
    # as LTX2ImageToVideoPipeline calls it: the audio's timestep one per sample
    per_token = {**kw, "timestep": torch.full((2, math.prod(FAM.grid)), 500.0), "audio_timestep": kw["timestep"]}
    reference = FAM.output(model, per_token)
    toma.apply_toma(model, **OPTIONS)
    tiled = FAM.output(model, kw)
    real, used = PlanCache.tile_order_layout, []
    monkeypatch.setattr(PlanCache, "tile_order_layout", lambda self, *a, **k: used.append(1) or real(self, *a, **k))
    merged = FAM.output(model, per_token)
    assert used == []  # never in tile order
    assert (merged - reference).abs().max() > 1e-3
    # one timestep for all tokens: what the batch timestep computes, up to float32 ulps of
    # the per-token modulation's matmuls and raster-order attention sums
    torch.testing.assert_close(merged, tiled, rtol=1e-4, atol=1e-5)


def test_tokens_beyond_the_grid_run_unmerged_with_one_warning():
    # the condition pipeline appends keyframe tokens (and their coordinates) to the grid's
    model = FAM.make()
    kw = ltx2_inputs(2, 4, 6, 8, coords=True)
    extra = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(5))
    kw["hidden_states"] = torch.cat([kw["hidden_states"], extra], dim=1)
    kw["video_coords"] = torch.cat([kw["video_coords"], kw["video_coords"][:, :, :4]], dim=2)
    reference = FAM.output(model, kw)
    toma.apply_toma(model, **OPTIONS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = FAM.output(model, kw)
        FAM.output(model, kw)
    messages = [str(w.message) for w in caught if "ToMA" in str(w.message)]
    assert len(messages) == 1 and "num_frames x height x width" in messages[0]
    assert torch.equal(out, reference)


@pytest.mark.parametrize("keyword", ["video_self_attention_mask", "video_keyframes_mask"])
def test_inputs_laid_over_the_raster_sequence_keep_raster_order(keyword, monkeypatch):
    model, kw = FAM.make(), FAM.inputs(2)
    n = math.prod(FAM.grid)
    value = torch.ones(2, n, n) if keyword == "video_self_attention_mask" else torch.zeros(2, n, 1)
    toma.apply_toma(model, **OPTIONS)
    real, used = PlanCache.tile_order_layout, []
    monkeypatch.setattr(PlanCache, "tile_order_layout", lambda self, *a, **k: used.append(1) or real(self, *a, **k))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = FAM.output(model, {**kw, keyword: value})
    assert used == [] and torch.isfinite(out).all()
    messages = [str(w.message) for w in caught if "ToMA" in str(w.message)]
    if keyword == "video_self_attention_mask":  # attn1 cannot fit it to merged keys: it runs unmerged
        assert len(messages) == len(model.transformer_blocks)  # once per merged attn1
        assert all("attention mask over its unmerged tokens" in m for m in messages)
    else:
        assert messages == []


def test_the_ltx23_layout_merges_with_spatio_temporal_guidance(monkeypatch):
    # LTX-2.3's config: gated attention, prompt modulation of the cross-attention, the
    # perturbed processor (STG skips block 1's self-attention for the second sample), split
    # rotary tables, prompts already at the streams' widths; the bias reaches the perturbed
    # processor's dispatch too
    config = {
        "gated_attn": True,
        "cross_attn_mod": True,
        "audio_gated_attn": True,
        "audio_cross_attn_mod": True,
        "perturbed_attn": True,
        "use_prompt_embeddings": False,
        "rope_type": "split",
    }
    model, kw = make_ltx2(**config), ltx2_inputs(2, 4, 8, 8)
    g = torch.Generator().manual_seed(3)
    kw["encoder_hidden_states"] = torch.randn(2, 5, 16, generator=g)
    kw["audio_encoder_hidden_states"] = torch.randn(2, 5, 8, generator=g)
    kw.update(sigma=kw["timestep"] / 1000, use_cross_timestep=True, spatio_temporal_guidance_blocks=[1])
    kw["perturbation_mask"] = torch.tensor([1.0, 0.0])
    video, audio = outputs(model, kw)
    toma.apply_toma(model, **{**OPTIONS, "ratio": 0.0})
    assert all(torch.equal(a, b) for a, b in zip(outputs(model, kw), (video, audio)))
    toma.apply_toma(model, **OPTIONS, proportional_attention=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no site runs unmerged, the bias is not dropped
        tiled, raster = tiled_and_raster(model, kw, monkeypatch)
    assert (tiled - video).abs().max() > 1e-3
    torch.testing.assert_close(tiled, raster, rtol=1e-4, atol=1e-5)
    monkeypatch.undo()
    toma.remove_toma(model)
    assert all(torch.equal(a, b) for a, b in zip(outputs(model, kw), (video, audio)))
