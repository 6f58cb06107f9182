"""Qwen-Image 2.1: the passes that decode from the prefix cache merge; the prefill does not.

The conformance suite (tests/adapters/test_conformance.py) runs its cached passes; here is
what is particular to them: the pipeline's loop (a prefill, then cached steps), the cached
prefix keys that lead the merged ones, and the padding mask over those keys.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import toma
from tests.cases import check_exact_on_duplicates, clustered_tokens, force
from tests.tiny_models import make_qwenimage21, qwenimage21_inputs
from toma.adapters import attention as A

OPTIONS = {"blocks": {"transformer_blocks": range(2)}}


def run(model, kw):
    with torch.no_grad():
        return model(**kw).sample


def prefill_then_cached(batch: int = 1, h: int = 8, w: int = 8, text: int = 7) -> tuple[dict, dict]:
    """The pipeline's first call (it fills a new cache) and a later one on that cache."""
    first = qwenimage21_inputs(batch, h, w, text, mode="extract")
    later = {**first, "kv_cache_mode": "cached", "timestep": torch.full((batch,), 0.3)}
    return first, later


@pytest.fixture
def dispatch_calls(monkeypatch):
    """(queries, keys) of every attention dispatch Qwen-Image 2.1's processor makes."""
    from diffusers.models.transformers import transformer_qwenimage21 as module

    calls: list[tuple[int, int]] = []
    real = module.dispatch_attention_fn

    def record(query, key, value, *args, **kwargs):
        calls.append((query.shape[1], key.shape[1]))
        return real(query, key, value, *args, **kwargs)

    monkeypatch.setattr(module, "dispatch_attention_fn", record)
    return calls


def test_the_prefill_runs_unmerged_and_the_cached_steps_merge(dispatch_calls):
    reference = make_qwenimage21()
    first, later = prefill_then_cached()
    ref_first, ref_later = run(reference, first), run(reference, later)
    ref_cache = first["kv_cache"]

    model = make_qwenimage21()
    first, later = prefill_then_cached()
    toma.apply_toma(model, ratio=0.5, **OPTIONS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dispatch_calls.clear()
        out_first = run(model, first)
    # the block-causal prefill is bitwise the unpatched one, and so is the cache it writes
    assert torch.equal(out_first, ref_first)
    assert all(
        torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        for a, b in zip(first["kv_cache"].layer_caches, ref_cache.layer_caches)
    )
    assert [str(w.message) for w in caught if "ToMA" in str(w.message) and "block-causal" in str(w.message)]
    assert all(queries <= 7 + 64 for queries, _ in dispatch_calls) and sum(q for q, _ in dispatch_calls) >= 2 * 71

    dispatch_calls.clear()
    out_later = run(model, later)
    # each block: the 32 merged target queries attend to the 7 cached prefix keys, then the 32 merged
    assert dispatch_calls == [(32, 7 + 32)] * 2
    assert out_later.shape == ref_later.shape and torch.isfinite(out_later).all()
    assert 1e-3 < (out_later - ref_later).abs().max() < ref_later.abs().max()

    toma.remove_toma(model)
    assert torch.equal(run(model, later), ref_later)


def test_ratio_zero_runs_the_pipeline_loop_bitwise():
    reference, model = make_qwenimage21(), make_qwenimage21()
    toma.apply_toma(model, ratio=0.0, **OPTIONS)
    loops = []
    for m in (reference, model):
        first, later = prefill_then_cached(batch=2)
        loops.append([run(m, first), run(m, later), run(m, {**later, "timestep": torch.full((2,), 0.1)})])
    assert all(torch.equal(a, b) for a, b in zip(*loops))


def test_cached_keys_the_padding_mask_hides_change_nothing_merged():
    # the prompt's last two tokens of sample 1 are padding: their cached keys and values are
    # hidden from every query (the mask slices exactly: its target part is all True), so
    # anything there changes no output; unmasked they do
    model = make_qwenimage21()
    toma.apply_toma(model, ratio=0.5, **OPTIONS)
    kw = qwenimage21_inputs(2, 8, 8)
    mask = kw["encoder_hidden_states_mask"].clone()
    mask[1, -2:] = False
    padded = {**kw, "encoder_hidden_states_mask": mask}
    out = run(model, padded)
    changed = qwenimage21_inputs(2, 8, 8)
    for layer in changed["kv_cache"].layer_caches:
        layer.k[1, -2:] = 50.0
        layer.v[1, -2:] = -50.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(run(model, {**changed, "encoder_hidden_states_mask": mask}), out)
    assert not [w for w in caught if "ToMA" in str(w.message)]  # merged, mask and all
    assert (run(model, changed)[1] - out[1]).abs().max() > 1e-2


def editing_inputs(mode: str) -> dict:
    """An editing call: 3 prompt tokens, a 4x4 condition image (4 encoder slots), 4 more
    tokens, then the 8x8 target (16 slots); latents are the condition's, then the target's.
    The encoder's sequence holds the condition's slots (11 rows), not the target's."""
    kw = qwenimage21_inputs(1, 8, 8, text=7, mode=mode)
    g = torch.Generator().manual_seed(3)
    kw["encoder_hidden_states"] = torch.randn(1, 11, kw["encoder_hidden_states"].shape[2], generator=g)
    kw["encoder_hidden_states_mask"] = torch.ones(1, 11, dtype=torch.bool)
    slot = [False] * 3 + [True] * 4 + [False] * 4 + [True] * 16
    kw["img_mask"] = torch.tensor([slot])
    kw["img_shapes"] = [[(1, 4, 4), (1, 8, 8)]]
    kw["hidden_states"] = torch.cat([torch.randn(1, 16, 16, generator=g), kw["hidden_states"]], 1)
    return kw


def test_editing_merges_the_target_after_its_condition_image(dispatch_calls, monkeypatch):
    # the condition image's 16 tokens sit in the cached prefix with the prompt's 7: the
    # cached passes merge only the target's 64, whose rows are the last of img_in's output
    # and of the rotary table (the packed order's reordering); the prefill runs unmerged
    from toma.adapters.state import PlanCache

    reference, model = make_qwenimage21(), make_qwenimage21()
    first = editing_inputs("extract")
    ref_first = run(reference, first)
    later = {**first, "kv_cache_mode": "cached", "timestep": torch.full((1,), 0.3)}
    ref_later = run(reference, later)

    toma.apply_toma(model, ratio=0.5, **OPTIONS)
    first = editing_inputs("extract")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(run(model, first), ref_first)
    later = {**first, "kv_cache_mode": "cached", "timestep": torch.full((1,), 0.3)}
    real, used = PlanCache.tile_order_layout, []
    monkeypatch.setattr(
        PlanCache, "tile_order_layout", lambda self, *a, **k: used.append(real(self, *a, **k)) or used[-1]
    )
    dispatch_calls.clear()
    tiled = run(model, later)
    assert dispatch_calls == [(32, 23 + 32)] * 2 and any(layout is not None for layout in used)
    assert 1e-3 < (tiled - ref_later).abs().max() < ref_later.abs().max()
    # the same merges from raster order (gathers at every site): attention sums its keys in
    # another order, a few float32 ulps per op, under 1e-5 through two blocks
    monkeypatch.setattr(PlanCache, "tile_order_layout", lambda self, *a, **k: None)
    torch.testing.assert_close(run(model, later), tiled, rtol=1e-4, atol=1e-5)
    toma.remove_toma(model)
    assert torch.equal(run(model, later), ref_later)


@pytest.mark.parametrize("form", A.FORMS)
def test_proportional_attention_is_exact_on_duplicate_tokens(form, monkeypatch):
    # a 4x8 target in two 4x4 tiles, each holding one token 9 times and 7 others once, with
    # rotary tables of ones (no positions): the 8 destinations of ratio 0.5 keep one of
    # each, and with the log(mass) bias after the cached prefix keys (log mass 0) every
    # merged attention computes what the unmerged one does, to fp32 rounding
    force(monkeypatch, form)
    model = make_qwenimage21()
    model.pos_embed.register_forward_hook(lambda m, args, out: torch.ones_like(out))
    kw = qwenimage21_inputs(1, 4, 8)
    kw["hidden_states"] = clustered_tokens(2)
    check_exact_on_duplicates(model, kw, run, **OPTIONS)


@pytest.mark.parametrize("editing", [False, True], ids=["text-to-image", "editing"])
def test_the_pipeline_merges_its_cached_steps(editing, tmp_path, dispatch_calls):
    # the pipeline's own input preparation and loop: its encoder's slots, the prefill that
    # fills the cache (and, editing, the condition image's 16 latent tokens in the prefix),
    # then the cached steps, for the prompt and the negative prompt each (true CFG)
    from PIL import Image

    from tests.tiny_pipelines import tiny_qwenimage21_pipeline

    pipe = tiny_qwenimage21_pipeline(tmp_path / "tok", make_qwenimage21())
    pixels = (torch.rand(64, 64, 3, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8)
    image = [Image.fromarray(pixels.numpy())] if editing else None
    kw = dict(image=image, negative_prompt="blurry", true_cfg_scale=2.0, height=128, width=128, output_resolution=64)

    def generate():
        return pipe(
            "a red fox", num_inference_steps=3, output_type="np", generator=torch.Generator().manual_seed(0), **kw
        ).images

    # each pass's mode ("extract": the prefill; "cached"), then its dispatches' (queries, keys)
    pipe.transformer.register_forward_pre_hook(
        lambda m, a, k: dispatch_calls.append(k["kv_cache_mode"]) or None, with_kwargs=True, prepend=True
    )

    def passes():
        out = []
        for item in dispatch_calls:
            if isinstance(item, str):
                out.append((item, []))
            else:
                out[-1][1].append(item)
        dispatch_calls.clear()
        return out

    ref = generate()
    unmerged = passes()
    toma.apply_toma(pipe, ratio=0.5, **OPTIONS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged = generate()
    assert [w for w in caught if "block-causal" in str(w.message)]
    got = passes()
    # (prompt, negative prompt) x 3 steps; the prefills run the whole joint sequence unmerged
    assert [mode for mode, _ in got] == ["extract"] * 2 + ["cached"] * 4
    assert got[:2] == unmerged[:2]
    # 128 px: 8x8 target tokens, 32 merged queries at each of the 2 blocks, after the cached
    # prefix: the prompt's tokens (and, editing, the condition image's 16)
    condition = 16 if editing else 0
    for (_, calls), (_, before) in zip(got[2:], unmerged[2:]):
        prefix = before[0][1] - 64
        assert before == [(64, prefix + 64)] * 2 and prefix > condition
        assert calls == [(32, prefix + 32)] * 2
    assert merged.shape == ref.shape and np.isfinite(merged).all() and not np.array_equal(merged, ref)
    toma.remove_toma(pipe)
    assert np.array_equal(generate(), ref)
