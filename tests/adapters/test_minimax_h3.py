"""MiniMax H3 beyond the conformance suite (its row is in tests/tiny_models.py): the packed
sequence's prefix (text, keyframe rows, audio) passes whole, the generated video's timestep
counts the steps, and layouts whose last rows are not one video grid run unmerged."""

from __future__ import annotations

import math
import warnings

import torch

import toma
from tests.tiny_models import FAMILIES, minimax_h3_inputs
from toma.adapters.families.minimax_h3 import SPEC

FAM = FAMILIES["minimax-h3"]
GRID = (2, 8, 10)  # 2 latent frames of 16x20 latents, 2x2 patches


def keyframe_inputs(batch: int = 1, audio_t: float = 0.4) -> dict:
    """The fl2va layout: [text; a first-frame keyframe's 80 rows; audio; 160 video rows], the
    keyframe at timestep 0.9, the audio at ``audio_t``, the video at 0.7."""
    return minimax_h3_inputs(batch, 2, 16, 20, audio_t=audio_t, anchors=("first",))


def inputs_of(module: torch.nn.Module, model, kw) -> list[torch.Tensor]:
    """The hidden states ``module`` gets at each call of one forward."""
    seen = []
    handle = module.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    try:
        FAM.output(model, kw)
    finally:
        handle.remove()
    return seen


def test_text_keyframe_and_audio_rows_pass_whole_and_only_the_video_merges():
    model, kw = FAM.make(), keyframe_inputs()
    length, n = kw["position_ids"].shape[0], math.prod(GRID)
    prefix = length - n  # 5 text + 80 keyframe + 6 audio rows
    assert prefix == 5 + 80 + 6 and kw["hidden_states"].shape[1] == 80 + n
    block = model.transformer_blocks[0]
    plain_q, plain_ff = inputs_of(block.attn.to_q, model, kw), inputs_of(block.ff.net[0].proj, model, kw)
    patch = toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    merged_q, merged_ff = inputs_of(block.attn.to_q, model, kw), inputs_of(block.ff.net[0].proj, model, kw)
    assert patch.cache.base_grid == GRID  # the keyframe's rows are not the grid's
    kept = patch.cache.layout(*GRID, ratio=0.5).num_merged
    assert kept < n
    for plain, merged in ((plain_q, merged_q), (plain_ff, merged_ff)):
        assert plain[0].shape[1] == length and merged[0].shape[1] == prefix + kept
    # the first block's attention input: nothing merged has reached the prefix yet, so its
    # rows are the unmerged model's, bitwise and in place; the video's are merged ones
    assert torch.equal(merged_q[0][:, :prefix], plain_q[0][:, :prefix])
    assert not torch.equal(merged_q[0][:, prefix:], plain_q[0][:, prefix : prefix + kept])


def test_ratio_zero_and_remove_are_bitwise_with_keyframe_and_audio_rows():
    model, kw = FAM.make(), keyframe_inputs(batch=2)
    ref = model(**kw)
    toma.apply_toma(model, ratio=0.0, **FAM.every_part())
    same = model(**kw)
    assert torch.equal(same.sample, ref.sample) and torch.equal(same.audio_sample, ref.audio_sample)
    toma.remove_toma(model)
    toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    merged = model(**kw)
    assert not torch.equal(merged.sample, ref.sample) and torch.isfinite(merged.audio_sample).all()
    assert toma.remove_toma(model)
    back = model(**kw)
    assert torch.equal(back.sample, ref.sample) and torch.equal(back.audio_sample, ref.audio_sample)


def test_the_generated_videos_timestep_counts_the_steps():
    # timestep holds the call's distinct noise levels, sorted: the audio's 0.4 comes before the
    # video's 0.7. Read as the first value, an audio step with the video's level unchanged
    # would count as a new denoising step and leave the step window
    kw = keyframe_inputs(audio_t=0.4)
    assert kw["timestep"].tolist() == [0.4000000059604645, 0.699999988079071, 0.8999999761581421]
    assert SPEC.timestep(kw).tolist() == [0.699999988079071]
    model = FAM.make()
    # two calls of the first step (the audio's level moving), then the video's next step
    calls = [keyframe_inputs(audio_t=0.4), keyframe_inputs(audio_t=0.3)]
    calls.append({**calls[1], "timestep": torch.tensor([0.3, 0.5, 0.9])})
    base = [FAM.output(model, c) for c in calls]
    toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    merged = [FAM.output(model, c) for c in calls]
    toma.remove_toma(model)
    toma.apply_toma(model, ratio=0.5, stop_step=1, **FAM.every_part())  # the first step only
    windowed = [FAM.output(model, c) for c in calls]
    for i in range(2):
        assert torch.equal(windowed[i], merged[i]) and not torch.equal(windowed[i], base[i])
    assert torch.equal(windowed[2], base[2])


def warned_output(model, kw) -> tuple[torch.Tensor, list[str]]:
    """Two calls of the patched ``model`` on ``kw``: the output and toma's warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = FAM.output(model, kw)
        FAM.output(model, kw)
    return out, [str(w.message) for w in caught if "ToMA" in str(w.message)]


def test_position_ids_that_are_not_one_grid_run_unmerged_with_one_warning():
    model, kw = FAM.make(), FAM.inputs(1)
    ids = kw["position_ids"].clone()
    ids[-3:, 2] = ids[-3:, 2].flip(0)  # the last row's columns out of order
    kw["position_ids"] = ids
    reference = FAM.output(model, kw)
    toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    out, messages = warned_output(model, kw)
    assert len(messages) == 1 and "do not span a 2x8x10 grid" in messages[0]
    assert torch.equal(out, reference)


def test_a_layout_whose_last_rows_are_not_video_runs_unmerged_with_one_warning():
    # the audio after the video: the video rows are not a suffix, so no plan may take them
    model, kw = FAM.make(), FAM.inputs(1)
    text, n, audio = 5, math.prod(GRID), 6
    kw["video_indices"] = torch.arange(text, text + n)
    kw["audio_indices"] = torch.arange(text + n, text + n + audio)
    tags = torch.ones(text + n + audio, dtype=torch.long)
    tags[text : text + n], tags[text + n :] = 0, 2
    kw["token_tags"] = tags
    reference = FAM.output(model, kw)
    toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    out, messages = warned_output(model, kw)
    assert len(messages) == 1 and "no run of video_indices ends the packed sequence" in messages[0]
    assert torch.equal(out, reference)


def test_tile_order_computes_what_raster_order_does_for_video_and_audio(monkeypatch):
    # the packed sequence's video rows run in tile order between the first block and proj_out,
    # with the per-row inputs (positions, timestep indices, tags) reordered alike; the audio
    # head reads rows that never move. Against every site merging from raster order: the same
    # plans, attention summing keys in another order (float32 ulps, under 1e-5 here)
    from toma.adapters.state import PlanCache

    model, kw = FAM.make(), minimax_h3_inputs(1, 2, 16, 16, audio_t=0.4, anchors=("first",))
    toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    real, used = PlanCache.tile_order_layout, []
    monkeypatch.setattr(
        PlanCache, "tile_order_layout", lambda self, *a, **k: used.append(real(self, *a, **k)) or used[-1]
    )
    tables = []
    handle = model.rope.register_forward_hook(lambda m, a, out: tables.append(out[0]))
    with torch.no_grad():
        tiled = model(**kw)
    assert used and all(layout is not None for layout in used)
    monkeypatch.setattr(PlanCache, "tile_order_layout", lambda self, *a, **k: None)
    with torch.no_grad():
        raster = model(**kw)
    handle.remove()
    torch.testing.assert_close(tiled.sample, raster.sample, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(tiled.audio_sample, raster.audio_sample, rtol=1e-4, atol=1e-5)
    # the rope made its tables from the reordered position_ids: the prefix's rows in place,
    # the video's in tile order (2x2 tiles on 8x8 rows per frame)
    prefix = kw["position_ids"].shape[0] - 2 * 64
    assert torch.equal(tables[0][:prefix], tables[1][:prefix]) and not torch.equal(tables[0], tables[1])
    assert torch.equal(tables[0][prefix : prefix + 2], tables[1][[prefix, prefix + 1]])  # a tile's top row
    assert torch.equal(tables[0][prefix + 2], tables[1][prefix + 8])  # then its second row
