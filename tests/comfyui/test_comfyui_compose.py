"""The ComfyUI node with what else a workflow puts on a model: LoRA weight patches, img2img,
another attention override, ComfyUI's own TomePatchModel."""

from __future__ import annotations

import logging

import pytest
import torch
from test_comfyui_node import ALL_FLUX, TEXT, _flux_modules, _record, _unet_modules
from tiny_comfy import (
    conds,
    flux_controlnet,
    flux_patcher,
    qwen_conds,
    qwen_controlnet,
    qwen_patcher,
    sample,
    sd3_controlnet,
    sd3_patcher,
    unet_patcher,
)

from toma.comfyui import hooks
from toma.comfyui.patch import patch_model


@pytest.fixture(scope="module")
def flux(comfy):
    return flux_patcher(comfy, seed=3)


@pytest.fixture(scope="module")
def sd1(comfy):
    return unet_patcher(comfy, sdxl_like=False, seed=3)


def test_lora_weight_patch_composes(comfy, flux):
    key = "diffusion_model.double_blocks.0.img_attn.qkv.weight"
    weight = flux.model.state_dict()[key]
    lora = flux.clone()
    assert lora.add_patches(
        {key: ("diff", (0.5 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(5)),))}
    )
    with_lora = sample(comfy, lora, "flux", steps=2)
    assert not torch.equal(with_lora, sample(comfy, flux, "flux", steps=2))  # the patch changes the model
    # toma at ratio 0 on the LoRA'd model is that model, bitwise; merged, the blocks see K
    assert torch.equal(sample(comfy, patch_model(lora, 0.0, blocks=ALL_FLUX), "flux", steps=2), with_lora)
    merged = patch_model(lora, 0.5, blocks=ALL_FLUX)
    seen, handles = _record(_flux_modules(flux))
    try:
        out = sample(comfy, merged, "flux", steps=2)
    finally:
        for h in handles:
            h.remove()
    assert seen["double0.qkv"] == [32] * 2
    # the LoRA stays applied under merging: removing it changes the merged output
    assert not torch.equal(out, sample(comfy, patch_model(flux, 0.5, blocks=ALL_FLUX), "flux", steps=2))


def test_img2img_window_reads_sigmas_like_comfyui(comfy, flux):
    """With denoise < 1 the run starts part-way down the schedule; the window is still read
    against the model's whole schedule (percent_to_sigma), as ComfyUI's own nodes read it."""
    import comfy.samplers

    steps, denoise, start = 4, 0.6, 0.5
    ksampler = comfy.samplers.KSampler(
        flux, steps=steps, device="cpu", sampler="euler", scheduler="normal", denoise=denoise
    )
    threshold = flux.get_model_object("model_sampling").percent_to_sigma(start)
    expected = [64 if float(s) > threshold else 32 for s in ksampler.sigmas[:-1]]
    assert 64 in expected and 32 in expected
    patched = patch_model(flux, 0.5, blocks=ALL_FLUX, start_percent=start)
    init = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(2))
    seen, handles = _record(_flux_modules(flux))
    try:
        out = sample(comfy, patched, "flux", steps=steps, denoise=denoise, latent=init)
    finally:
        for h in handles:
            h.remove()
    assert seen["double0.qkv"] == expected
    assert torch.isfinite(out).all()


def test_window_reads_the_schedule_of_a_sampling_node_put_after_toma(comfy, flux):
    """ModelSamplingSD3 after the ToMA node replaces the schedule; the window follows the
    model being sampled, read when sampling starts, as ComfyUI's own nodes read it."""
    import comfy.samplers
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3

    steps, start = 6, 0.3
    patched = patch_model(flux, 0.5, blocks=ALL_FLUX, start_percent=start)
    (shifted,) = ModelSamplingSD3().patch(patched, shift=6.0)
    sampling = shifted.get_model_object("model_sampling")
    sigmas = comfy.samplers.KSampler(shifted, steps=steps, device="cpu", sampler="euler", scheduler="normal").sigmas
    expected = [64 if float(s) > sampling.percent_to_sigma(start) else 32 for s in sigmas[:-1]]
    # the schedule the node was given would put the cut elsewhere
    before = flux.get_model_object("model_sampling").percent_to_sigma(start)
    assert expected != [64 if float(s) > before else 32 for s in sigmas[:-1]] and 32 in expected
    seen, handles = _record(_flux_modules(flux))
    try:
        sample(comfy, shifted, "flux", steps=steps)
    finally:
        for h in handles:
            h.remove()
    assert seen["double0.qkv"] == expected


@pytest.mark.parametrize("layout", ["flux1", "flux2"])
def test_kontext_reference_tokens_pass_whole(comfy, flux, layout, caplog):
    """Reference latents (Kontext, Flux.2) join the image tokens in the sequence: they pass
    whole, only the generated image's tokens merge."""
    if layout == "flux2":  # global modulation, no pooled vector: where index_timestep_zero runs
        flux = flux_patcher(comfy, seed=3, global_modulation=True, vec_in_dim=None)
    import comfy.sample
    from tiny_comfy import conds

    pos, neg = conds("flux")
    ref = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(4))  # 4x4 = 16 tokens
    for c in (pos, neg):
        c[0][1]["reference_latents"] = [ref]
    noise = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(7))

    def run(model, method=None):
        p, n = pos, neg
        if method is not None:
            p = [[pos[0][0], {**pos[0][1], "reference_latents_method": method}]]
            n = [[neg[0][0], {**neg[0][1], "reference_latents_method": method}]]
        return comfy.sample.sample(
            model, noise, 2, 2.0, "euler", "normal", p, n, torch.zeros_like(noise), disable_pbar=True, seed=7
        )

    patched = patch_model(flux, 0.5, blocks=ALL_FLUX)
    seen, handles = _record(_flux_modules(flux))
    try:
        out = run(patched)
        seen_plain = {k: list(v) for k, v in seen.items()}
        for v in seen.values():
            v.clear()
        if layout == "flux2":
            with caplog.at_level(logging.WARNING, logger="toma.comfyui"):
                zero = run(patched, "index_timestep_zero")
    finally:
        for h in handles:
            h.remove()
    assert seen_plain["double0.qkv"] == [32 + 16] * 2  # K image tokens, then the 16 reference ones
    assert seen_plain["single1.linear1"] == [6 + 32 + 16] * 2
    assert torch.isfinite(out).all()
    if layout == "flux2":
        # references at their own timestep are modulated by position: toma runs the call
        # unmerged, and says so
        assert seen["double0.qkv"] == [64 + 16] * 2
        assert torch.equal(zero, run(flux, "index_timestep_zero"))
        assert "modulated apart" in caplog.text


def test_inpainting_noise_mask_composes(comfy, flux):
    """With a noise mask the sampler keeps the latent where the mask is 0 and denoises the
    rest; the merged model runs every call on K tokens and the kept region stays the latent's."""
    init = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(2))
    mask = torch.zeros(1, 1, 16, 16)
    mask[..., 4:12, 4:12] = 1.0
    patched = patch_model(flux, 0.5, blocks=ALL_FLUX)
    seen, handles = _record(_flux_modules(flux))
    try:
        out = sample(comfy, patched, "flux", steps=2, latent=init, noise_mask=mask)
    finally:
        for h in handles:
            h.remove()
    assert seen["double0.qkv"] == [32] * 2
    keep = mask.expand_as(init) == 0
    torch.testing.assert_close(out[keep], init[keep], rtol=0, atol=1e-6)
    assert not torch.allclose(out[~keep], init[~keep])


@pytest.mark.parametrize("order", ["before", "after"])
def test_attention_override_set_before_or_after_keeps_working(comfy, sd1, order):
    calls = []

    def other(*args, **kwargs):  # another node's attention, as set_model_optimized_attention takes it
        calls.append((args[1].shape[1], kwargs.get("mask") is not None))
        return hooks.resolve("comfy.ldm.modules.attention:attention_pytorch")(*args, **kwargs)

    if order == "before":
        model = sd1.clone()
        model.set_model_optimized_attention(other)
        model = patch_model(model, 0.5)
    else:
        model = patch_model(sd1, 0.5).clone()
        model.set_model_optimized_attention(other)
    sample(comfy, model, "unet", h=8, w=8, steps=1)
    # the other override ran for every attention call, and toma's bias reached exactly the
    # merged self-attentions (32 keys: the 64 tokens of the top level, halved)
    assert calls and {keys for keys, biased in calls if biased} == {32}
    assert all(biased for keys, biased in calls if keys == 32)


@pytest.mark.parametrize("cache", ["EasyCacheNode", "LazyCacheNode"])
@pytest.mark.parametrize("order", ["toma-first", "cache-first"])
def test_core_step_caches_compose(comfy, flux, cache, order):
    """EasyCache and LazyCache skip whole denoiser calls, reusing earlier outputs; on the
    calls they do run, toma merges. A high threshold makes them skip from their start on."""
    import comfy_extras.nodes_easycache as caches

    node = getattr(caches, cache)

    def add_cache(model):
        return node.execute(model, reuse_threshold=3.0, start_percent=0.0, end_percent=1.0, verbose=False).result[0]

    steps = 6
    if order == "toma-first":
        model = add_cache(patch_model(flux, 0.5, blocks=ALL_FLUX))
    else:
        model = patch_model(add_cache(flux), 0.5, blocks=ALL_FLUX)
    seen, handles = _record(_flux_modules(flux))
    try:
        out = sample(comfy, model, "flux", steps=steps)
    finally:
        for h in handles:
            h.remove()
    ran = len(seen["double0.qkv"])
    assert 0 < ran < steps  # the cache skipped some calls...
    assert seen["double0.qkv"] == [32] * ran  # ...and every call that ran merged
    assert torch.isfinite(out).all()


def test_torch_compile_model_traces_toma_without_graph_breaks(comfy, flux):
    """Core TorchCompileModel's wrapper (``set_torch_compile_wrapper``) compiles the whole
    diffusion model; with dynamo's ``eager`` backend (tracing only, no inductor build) the
    merged blocks trace into the graph with no break, and give the uncompiled output."""
    import torch._dynamo
    from comfy_api.torch_helpers.torch_compile import set_torch_compile_wrapper
    from torch._dynamo.utils import counters

    patched = patch_model(flux, 0.5, blocks=ALL_FLUX)
    eager = sample(comfy, patched, "flux", steps=1)
    compiled = patched.clone()
    set_torch_compile_wrapper(compiled, backend="eager")
    torch._dynamo.reset()
    counters.clear()
    try:
        out = sample(comfy, compiled, "flux", steps=1)
        breaks, frames = dict(counters["graph_break"]), dict(counters["frames"])
    finally:
        torch._dynamo.reset()
    assert frames.get("ok", 0) > 0  # dynamo did trace the model
    assert breaks == {}
    assert patched.toma_run.merged_calls == 1
    assert torch.equal(out, eager)


def test_toma_twice_is_refused(comfy, flux, caplog):
    once = patch_model(flux, 0.5, blocks=ALL_FLUX)
    assert isinstance(getattr(once, hooks.PATCHER_WRAPPERS), dict)
    with caplog.at_level(logging.WARNING, logger="toma.comfyui"):
        assert patch_model(once, 0.3) is once
    assert "ToMA is already applied to this model" in caplog.text


def test_tome_patch_model_is_refused_before_and_stepped_aside_after(comfy, sd1, caplog):
    from comfy_extras.nodes_tomesd import TomePatchModel

    tome = TomePatchModel.execute(sd1, 0.5).result[0]
    with caplog.at_level(logging.WARNING, logger="toma.comfyui"):
        assert patch_model(tome, 0.5) is tome
    assert "TomePatchModel is applied to this model too" in caplog.text
    caplog.clear()

    both = TomePatchModel.execute(patch_model(sd1, 0.5), 0.5).result[0]
    seen, handles = _record(_unet_modules(sd1))
    try:
        with caplog.at_level(logging.WARNING, logger="toma.comfyui"):
            out = sample(comfy, both, "unet", h=8, w=8, steps=2)
    finally:
        for h in handles:
            h.remove()
    # toma steps aside and its run's warning says why: TomePatchModel merges the top level's
    # queries (fewer than its 64 tokens; it picks at random, so its output is no reference),
    # while keys, which toma would have merged to 32, stay whole
    assert "nothing merged in this run: ComfyUI's TomePatchModel is applied to this model too" in caplog.text
    top = [name for name, counts in seen.items() if name.endswith("attn1.to_k") and counts[0] == 64]
    assert top and all(seen[name] == [64, 64] for name in top)
    assert all(0 < c < 64 for name in top for c in seen[name.replace("to_k", "to_q")])
    assert torch.isfinite(out).all()


def test_an_fp8_checkpoint_composes(comfy):
    # fp8 weights computed through ComfyUI's manual_cast layers, as an fp8 checkpoint loads
    model = flux_patcher(comfy, weight_dtype=torch.float8_e4m3fn)
    qkv = model.model.diffusion_model.double_blocks[0].img_attn.qkv
    assert qkv.weight.dtype == torch.float8_e4m3fn and type(qkv).__module__ == "comfy.ops"
    reference = sample(comfy, model, "flux", steps=2)
    assert torch.equal(sample(comfy, patch_model(model, 0.0, blocks=ALL_FLUX), "flux", steps=2), reference)
    patched = patch_model(model, 0.5, blocks=ALL_FLUX)
    seen = []
    handle = qkv.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
    try:
        out = sample(comfy, patched, "flux", steps=2)
    finally:
        handle.remove()
    n = 8 * 8  # a 16x16 latent in 2x2 patches
    k = patched.toma_run.cache.layout(8, 8).num_merged
    assert seen == [k] * 2 and k < n  # the fp8 layer ran on the merged tokens, at each step
    assert torch.isfinite(out).all() and not torch.equal(out, reference)
    assert torch.equal(sample(comfy, model, "flux", steps=2), reference)


@pytest.mark.parametrize("sdxl_like", [True, False], ids=["sdxl", "sd1"])
def test_controlnet_residuals_compose(comfy, sdxl_like):
    # ComfyUI's own ControlNetApply node on the conditioning: the ControlNet's residuals are
    # added to the UNet's blocks at full size, around the attention toma merges
    import comfy.sample
    import nodes
    from tiny_comfy import conds, unet_controlnet

    model = unet_patcher(comfy, sdxl_like=sdxl_like)
    size = 16 if sdxl_like else 8  # the default levels: 64 tokens (and 16 on SDXL) merge
    hint = torch.rand(1, 8 * size, 8 * size, 3, generator=torch.Generator().manual_seed(3))
    cnet = unet_controlnet(comfy, sdxl_like=sdxl_like)
    pos, neg = conds("unet")
    controlled = [nodes.ControlNetApply().apply_controlnet(c, cnet, hint, 1.0)[0] for c in (pos, neg)]

    def run(m, control=True):
        p, n = controlled if control else (pos, neg)
        noise = torch.randn(1, 4, size, size, generator=torch.Generator().manual_seed(7))
        latent = torch.zeros(1, 4, size, size)
        return comfy.sample.sample(m, noise, 2, 2.0, "euler", "normal", p, n, latent, disable_pbar=True, seed=7)

    reference = run(model)
    assert not torch.equal(reference, run(model, control=False))  # the ControlNet acts
    assert torch.equal(run(patch_model(model, 0.0)), reference)
    patched = patch_model(model, 0.5)
    seen, handles = _record(_unet_modules(model))
    try:
        out = run(patched)
    finally:
        for h in handles:
            h.remove()
    merged = {64: 32, 16: 8} if sdxl_like else {64: 32}
    for name, counts in seen.items():
        if name.endswith("attn1.to_q"):  # self-attention at a merged level runs on K
            (n,) = set(seen[name.replace("attn1.to_q", "attn2.to_q")])
            # 2 steps; the ControlNet's conditionings differ, so cond and uncond run apart
            assert counts == [merged.get(n, n)] * 4, name
    assert torch.isfinite(out).all() and not torch.equal(out, reference)
    assert not torch.equal(out, run(patched, control=False))  # still controlled when merged
    assert torch.equal(run(model), reference)


def _sd3_modules(patcher) -> dict[str, torch.nn.Module]:
    out = {}
    for i, b in enumerate(patcher.model.diffusion_model.joint_blocks):
        out[f"{i}.qkv"], out[f"{i}.mlp"] = b.x_block.attn.qkv, b.x_block.mlp.fc1
    return out


@pytest.mark.parametrize("family", ["flux", "sd3", "qwenimage"])
def test_controlnet_residuals_compose_on_dits(comfy, flux, family):
    # ComfyUI's own ControlNetApplyAdvanced node with a tiny ControlNet of the family's: the
    # model adds its residuals to the image tokens after a block, on the full-size stream
    # that toma's block replacement returns (it unmerges before the block returns)
    import comfy.sample
    import nodes

    n, k = 8 * 8, 32  # a 16x16 latent in 2x2 patches, halved
    if family == "flux":
        model, cnet, blocks = flux, flux_controlnet(comfy), ALL_FLUX
        modules = _flux_modules(model)
        modules["control.block0.attn"] = cnet.control_model.double_blocks[0].img_attn.qkv
        # the image's tokens, and [text; image] in the single blocks
        expected = {name: k if name.startswith("double") else TEXT + k for name in modules}
    elif family == "sd3":
        model, cnet, blocks = sd3_patcher(comfy, seed=3), sd3_controlnet(comfy), "blocks:all"
        modules = _sd3_modules(model)
        modules["control.block0.attn"] = cnet.control_model.joint_blocks[0].x_block.attn.qkv
        expected = dict.fromkeys(modules, k)
    else:
        model, cnet, blocks = qwen_patcher(comfy, seed=3), qwen_controlnet(comfy), "blocks:all"
        modules = {}
        for i, b in enumerate(model.model.diffusion_model.transformer_blocks):
            modules[f"{i}.to_q"], modules[f"{i}.mlp"] = b.attn.to_q, b.img_mlp
        modules["control.block0.attn"] = cnet.control_model.transformer_blocks[0].attn.to_q
        expected = dict.fromkeys(modules, k)
    expected["control.block0.attn"] = n  # the ControlNet's own blocks stay whole
    # Qwen-Image's latent is a video's of one frame
    shape = (1, 4, 1, 16, 16) if family == "qwenimage" else (1, 4, 16, 16)
    # the hint: a latent, channels last as the node's IMAGE input takes it
    hint = torch.rand(shape[:1] + shape[2:] + shape[1:2], generator=torch.Generator().manual_seed(3))
    pos, neg = qwen_conds() if family == "qwenimage" else conds("flux")
    controlled = nodes.ControlNetApplyAdvanced().apply_controlnet(pos, neg, cnet, hint, 1.0, 0.0, 1.0)[:2]

    def run(m, control=True):
        p, q = controlled if control else (pos, neg)
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(7))
        return comfy.sample.sample(
            m, noise, 2, 2.0, "euler", "normal", p, q, torch.zeros(shape), disable_pbar=True, seed=7
        )

    reference, plain = run(model), run(model, control=False)
    assert not torch.equal(reference, plain)  # the ControlNet acts
    assert torch.equal(run(patch_model(model, 0.0, blocks=blocks)), reference)
    patched = patch_model(model, 0.5, blocks=blocks)
    seen, handles = _record(modules)
    try:
        out = run(patched)
    finally:
        for h in handles:
            h.remove()
    assert patched.toma_run.cache.layout(8, 8).num_merged == k
    # 2 steps; the node gives cond and uncond one ControlNet, so they run as one batch
    assert seen == {name: [count] * 2 for name, count in expected.items()}
    assert torch.isfinite(out).all() and not torch.equal(out, reference)
    # still controlled when merged: the ControlNet's effect on the merged model points the way
    # it does on the unpatched one (cosines measured: 0.97 Flux, 0.99 SD3, 0.999 Qwen-Image;
    # a dropped residual leaves no effect)
    effect = out - run(patched, control=False)
    assert torch.nn.functional.cosine_similarity(effect.flatten(), (reference - plain).flatten(), 0) > 0.8
    assert torch.equal(run(model), reference)


@pytest.mark.parametrize("family", ["flux", "unet"])
def test_lowvram_loading_composes(comfy, family):
    # ComfyUI loads a model lowvram when it does not fit: each layer's weights are cast (and
    # moved) at its call. Forced here on the CPU, where ComfyUI would load it whole: the merged
    # denoiser call is bitwise what it is fully loaded
    from tiny_comfy import FLUX_CONTEXT, FLUX_VEC, comfy_denoise

    g = torch.Generator().manual_seed(1)
    if family == "flux":
        model, blocks = flux_patcher(comfy), ALL_FLUX
        x, context = torch.randn(1, 4, 16, 16, generator=g), torch.randn(1, 6, FLUX_CONTEXT, generator=g)
        pooled = torch.randn(1, FLUX_VEC, generator=g)
        layer = model.model.diffusion_model.double_blocks[0].img_attn.qkv
    else:
        model, blocks = unet_patcher(comfy), ""
        x, context, pooled = torch.randn(1, 4, 16, 16, generator=g), torch.randn(1, 5, 32, generator=g), None
        layer = next(m for n, m in model.model.diffusion_model.named_modules() if n.endswith("attn1.to_q"))
    sigma = torch.tensor([0.8])
    patched = patch_model(model, 0.5, blocks=blocks)
    full = comfy_denoise(patched, x, sigma, context, pooled)
    assert not torch.equal(full, comfy_denoise(model, x, sigma, context, pooled))
    patched.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1)
    try:
        assert layer.comfy_cast_weights  # the layer casts its weights at each call now
        calls = patched.toma_run.merged_calls
        assert torch.equal(comfy_denoise(patched, x, sigma, context, pooled), full)
        assert patched.toma_run.merged_calls == calls + 1
    finally:
        patched.unpatch_model(device_to=torch.device("cpu"))
