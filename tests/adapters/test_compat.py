"""ToMA next to other diffusers features: LoRA, attention slicing, fused QKV, caches.

Each test checks that the feature and ToMA compose: the merged output is the one the
feature alone would give merged (order of application does not matter, or the features
act on disjoint parts of the computation), and removal stays exact.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0

import toma
from tests.tiny_models import (
    flux_inputs,
    make_flux,
    make_sd3,
    make_sd15_unet,
    make_wan,
    sd3_inputs,
    unet_inputs,
    wan_inputs,
)
from tests.cases import CACHED, engine_family, fused_calls

NEWER = ["ltx", "qwenimage", "flux2", "hunyuanvideo", "cogvideox"]


def _engine_case(family: str):
    # the smallest batch-2 inputs and every block, as the robustness tests use them
    make, kw, blocks = engine_family(family)
    return make, lambda: kw, blocks


FAMILIES = {  # the families whose diffusers model takes a LoRA through add_adapter (PixArt's does not)
    "unet": (make_sd15_unet, lambda: unet_inputs(2, 16, 16, False), {}),
    "flux": (
        make_flux,
        lambda: flux_inputs(2, 8, 8),
        {"blocks": {"transformer_blocks": (0, 1), "single_transformer_blocks": (0, 1)}},
    ),
    "sd3": (make_sd3, lambda: sd3_inputs(2, 16, 16), {"blocks": {"transformer_blocks": range(4)}}),
    "wan": (make_wan, lambda: wan_inputs(2, 3, 8, 8), {"blocks": {"blocks": range(3)}}),
    **{family: _engine_case(family) for family in NEWER},
}


def run(model, kw):
    with torch.no_grad():
        return model(**kw)[0]


def add_lora(model) -> None:
    """A LoRA on every attention projection, with random (non-zero) up-projections so that
    it changes the output."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(7)
    config = peft.LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False)
    model.add_adapter(config)


# a LoRA added before or after apply_toma, every family: tests/adapters/test_conformance.py


def test_lora_loaded_with_load_lora_weights(tmp_path):
    # the user-facing path: a LoRA file saved by one pipeline, loaded into a patched one
    from diffusers import StableDiffusionPipeline
    from peft.utils import get_peft_model_state_dict

    from tests.tiny_pipelines import tiny_sd_pipeline

    def build():
        torch.manual_seed(0)
        return tiny_sd_pipeline(tmp_path / "tok")

    trained = build()
    add_lora(trained.unet)
    StableDiffusionPipeline.save_lora_weights(
        tmp_path / "lora", unet_lora_layers=get_peft_model_state_dict(trained.unet)
    )

    def generate(pipe):
        return pipe(
            "a fox",
            height=32,
            width=32,
            num_inference_steps=2,
            output_type="np",
            generator=torch.Generator().manual_seed(0),
        ).images

    pipe = build()
    toma.apply_toma(pipe, ratio=0.5)
    merged = generate(pipe)
    pipe.load_lora_weights(tmp_path / "lora")
    merged_lora = generate(pipe)
    assert not (merged_lora == merged).all()
    toma.remove_toma(pipe)
    unmerged_lora = generate(pipe)
    toma.apply_toma(pipe, ratio=0.5)
    assert (generate(pipe) == merged_lora).all()  # LoRA loaded before or after: same
    assert not (merged_lora == unmerged_lora).all()


def test_attention_slicing_keeps_merging():
    # sliced attention runs the merged tokens a slice of heads at a time: same maths;
    # grid selection keeps the plan independent of rounding upstream
    unet = make_sd15_unet()
    kw = unet_inputs(2, 16, 16, False)
    patch = toma.apply_toma(unet, ratio=0.5, selection="grid")
    seen = []
    patch.patched[0].module.to_q.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[1]))
    merged = run(unet, kw)
    unet.set_attention_slice(1)
    sliced = run(unet, kw)
    assert seen == [128, 128]  # half of 16 x 16 tokens, both times
    torch.testing.assert_close(sliced, merged, rtol=1e-5, atol=1e-5)
    toma.remove_toma(unet)
    unet.set_attn_processor(AttnProcessor2_0())  # a fresh model's processor
    plain = make_sd15_unet()
    assert torch.equal(run(unet, kw), run(plain, kw))


def test_fused_qkv_keeps_merging_sd3():
    # every row of the conformance suite is fused there (test_fused_projections_keep_merging);
    # its SD3.5 row cannot be (diffusers cannot fuse the image-only attn2, unpatched too): SD3
    make, inputs, opts = FAMILIES["sd3"]
    make = lambda: make_sd3(dual=())  # noqa: E731
    kw = inputs()
    model = make()
    toma.apply_toma(model, ratio=0.5, selection="grid", **opts)
    merged = run(model, kw)
    assert not torch.equal(merged, run(make(), kw))
    calls = fused_calls(model)
    torch.testing.assert_close(run(model, kw), merged, rtol=1e-4, atol=1e-5)
    assert calls  # the fused projections did run


def test_fused_cogvideox_drops_the_bias():
    # diffusers' fused CogVideoX processor pads any mask to the text's length (it fails
    # unpatched too): the bias is dropped there, said once, and the merge goes on
    make, inputs, opts = FAMILIES["cogvideox"]
    kw = inputs()
    plain, biased = make(), make()
    toma.apply_toma(plain, ratio=0.5, selection="grid", proportional_attention=False, **opts)
    toma.apply_toma(biased, ratio=0.5, selection="grid", **opts)  # None: on, on CPU
    assert not torch.equal(run(biased, kw), run(plain, kw))
    biased.fuse_qkv_projections()
    with pytest.warns(UserWarning, match="fused processor"):
        out = run(biased, kw)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*fused processor")  # once per merged attention
        run(biased, kw)
    torch.testing.assert_close(out, run(plain, kw), rtol=1e-4, atol=1e-5)  # fused vs unfused matmuls


def denoise(model, kw, steps: int, scale: float):
    """A short denoising-like loop: shrinking inputs at decreasing timesteps, inside the
    cache context pipelines open, as diffusers' caches expect."""
    outs = []
    with torch.no_grad():
        for i in range(steps):
            t = torch.full((kw["hidden_states"].shape[0],), scale * (1 - i / steps))
            with model.cache_context("cond"):
                outs.append(model(**{**kw, "hidden_states": kw["hidden_states"] * (1 - i / steps), "timestep": t})[0])
    return torch.stack(outs)


# diffusers' caches (FirstBlockCache, MagCache, TaylorSeer, PAB, FasterCache) on every family they
# run on: tests/adapters/test_conformance.py
@pytest.mark.parametrize("family", ["flux", "wan"])
def test_remove_toma_under_a_cache_leaves_nothing_behind(family):
    # diffusers rewired the cache hook registered after toma's to a stale reference: after
    # remove_toma and disable_cache, toma's hooks still ran (Flux warned that its processor
    # was replaced, on every later forward)
    from diffusers.hooks import FirstBlockCacheConfig

    make, inputs, scale, opts, probe = CACHED[family]
    kw, steps = inputs(), 4
    model = make()
    toma.apply_toma(model, ratio=0.5, **opts)
    model.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    toma.remove_toma(model)
    fresh = make()
    fresh.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the cache alone, still working, as on a model ToMA never touched
        assert torch.equal(denoise(model, kw, steps, scale), denoise(fresh, kw, steps, scale))
        model.disable_cache()
        fresh.disable_cache()
        assert torch.equal(denoise(model, kw, 2, scale), denoise(make(), kw, 2, scale))


def test_first_block_cache_skips_the_same_steps_in_tile_and_raster_order(monkeypatch):
    # without the cache, tile and raster order compute the same outputs (bitwise here); the
    # cache's decisions must not depend on the token order either
    from diffusers.hooks import FirstBlockCacheConfig

    from toma.adapters.state import PlanCache

    make, inputs, scale, options, probe = CACHED["wan"]
    kw = inputs()
    computed = []
    for tiled in (True, False):
        if not tiled:
            monkeypatch.setattr(PlanCache, "tile_order_layout", lambda self, *a, **k: None)
        model = make()
        toma.apply_toma(model, ratio=0.5, **options)
        model.enable_cache(FirstBlockCacheConfig(threshold=0.5))
        calls = []
        model.get_submodule(probe).register_forward_hook(lambda mod, args, out: calls.append(1))
        denoise(model, kw, 8, scale)
        computed.append(len(calls))
    assert computed[0] == computed[1]


def test_wan_tokens_reach_the_first_block_already_in_tile_order():
    # tile order is entered at the patch embedding's (B, C, t, h, w) output, before any hook
    # on the first block (FirstBlockCache's), which then sees a permutation of the raster rows
    make, inputs, scale, options, probe = CACHED["wan"]
    kw = {**inputs(), "timestep": torch.full((1,), scale)}
    seen = {}
    for name in ("plain", "merged"):
        model = make()
        if name == "merged":
            toma.apply_toma(model, ratio=0.5, **options)
        model.blocks[0].register_forward_pre_hook(
            lambda m, a, k: seen.__setitem__(name, (a or (k["hidden_states"],))[0]), with_kwargs=True
        )
        with torch.no_grad():
            model(**kw)
    plain, merged = seen["plain"], seen["merged"]
    assert not torch.equal(merged, plain)
    # the same rows, each once: a permutation of the raster sequence
    assert torch.equal(merged.sort(dim=1).values, plain.sort(dim=1).values)
    rows = [r.tolist() for r in plain[0]]
    perm = [rows.index(r.tolist()) for r in merged[0]]
    assert sorted(perm) == list(range(plain.shape[1]))
