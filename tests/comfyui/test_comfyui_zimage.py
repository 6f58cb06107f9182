"""Z-Image / Lumina 2 (ComfyUI's ``NextDiT``) through the node, on the vendored ComfyUI 0.33.0.

NextDiT has no block replacement: each merged main layer is an object patch (a copy of the
layer sharing its submodules), undone when ComfyUI unpatches. Its sequence is
``[caption (padded to 32); image; image pad]``. What the layers see is observed by forward
pre-hooks on ComfyUI's own modules; the model is tiny, with seeded weights.
"""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_comfy import fp32_floor, loaded_denoise, sample, zimage_patcher

from toma.comfyui import hooks
from toma.comfyui.families import family_of
from toma.comfyui.node import ToMAModel
from toma.comfyui.families.zimage import NextDiTLayer
from toma.comfyui.patch import patch_model

H, W = 12, 20  # latent; patch 2: a 6x10 grid, 60 image tokens padded to 64
N, PAD = 60, 4
CAPTION = 32  # the 6 caption tokens of tiny_comfy.conds, padded to 32
ALL = "layers:all"


@pytest.fixture(scope="module")
def zimage(comfy):
    return zimage_patcher(comfy, seed=1)


@pytest.fixture(scope="module")
def reference(comfy, zimage):
    return sample(comfy, zimage, "flux", h=H, w=W, steps=2)


def _run(comfy, patcher, **kw):
    return sample(comfy, patcher, "flux", h=H, w=W, steps=kw.pop("steps", 2), **kw)


def _record(patcher) -> tuple[dict[str, list[int]], list]:
    """Tokens each module's input had, call by call: the main layers' attention and MLP, and
    the refiners (which never merge)."""
    dm = patcher.model.diffusion_model
    modules = {"refiner": dm.noise_refiner[0].attention.qkv, "caption": dm.context_refiner[0].attention.qkv}
    for i, layer in enumerate(dm.layers):
        modules[f"layer{i}.qkv"] = layer.attention.qkv
        modules[f"layer{i}.mlp"] = layer.feed_forward.w1
    seen: dict[str, list[int]] = {name: [] for name in modules}
    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: seen[name].append(args[0].shape[1]))
        for name, m in modules.items()
    ]
    return seen, handles


def _denoise(patcher, x, sigma, context):
    return loaded_denoise(patcher, x, torch.tensor([sigma]), context, num_tokens=context.shape[1])


def test_zimage_is_merged_by_the_node_through_its_own_hooks(comfy, zimage):
    family = family_of(zimage.model.diffusion_model)
    assert family.name == "zimage" and family.merges and family.reason is None
    assert hooks.first_problem(hooks.NEXTDIT_NEEDS + hooks.ATTENTION_OVERRIDE_NEEDS) is None
    dm = zimage.model.diffusion_model
    assert len(getattr(dm, hooks.NEXTDIT_LAYERS)) == 2 and getattr(dm, hooks.NEXTDIT_PAD_MULTIPLE) == 32
    assert getattr(dm, hooks.PATCH_SIZE) == 2


def test_zimage_layers_see_k_tokens_and_the_input_model_is_unchanged(comfy, zimage, reference, caplog):
    dm = zimage.model.diffusion_model
    layers = list(dm.layers)
    keys = list(dm.state_dict())
    (patched,) = ToMAModel().patch(zimage, 0.5, blocks=ALL)
    assert not zimage.object_patches and set(patched.object_patches) == {
        "diffusion_model.layers.0",
        "diffusion_model.layers.1",
    }
    seen, handles = _record(zimage)
    try:
        with caplog.at_level(logging.INFO, logger="toma.comfyui"):
            merged = _run(comfy, patched)
    finally:
        for h in handles:
            h.remove()
    k = 30  # 4x4 tiles (auto on a small grid) keep half their tokens
    calls = 2  # Euler steps, cond and uncond in one batch each
    for i in range(2):
        # the caption and the image's pad tokens pass whole; the image merges, in attention and MLP
        assert seen[f"layer{i}.qkv"] == [CAPTION + k + PAD] * calls
        assert seen[f"layer{i}.mlp"] == [CAPTION + k + PAD] * calls
    assert seen["refiner"] == [N + PAD] * calls and seen["caption"] == [CAPTION] * calls
    lines = [r.getMessage() for r in caplog.records if r.name == "toma.comfyui"]
    assert lines == [
        f"ToMA (zimage): merged layers 0-1 in {calls} of {calls} denoiser calls; image tokens {N} -> {k}; ratio 0.5"
    ]
    assert torch.isfinite(merged).all() and (merged - reference).abs().max() > 1e-2
    # ComfyUI undid the object patches: the same layer objects, nothing left on them
    assert _run(comfy, zimage).equal(reference) and _run(comfy, zimage.clone()).equal(reference)
    assert list(dm.layers) == layers and all(a is b for a, b in zip(dm.layers, layers))
    assert all("forward" not in vars(layer) for layer in layers) and list(dm.state_dict()) == keys


def test_zimage_ratio_zero_is_bitwise_unmerged(comfy, zimage, reference, caplog):
    patched = patch_model(zimage, 0.0, blocks=ALL)
    with caplog.at_level(logging.WARNING, logger="toma.comfyui"):
        assert _run(comfy, patched).equal(reference)
    assert "nothing merged in this run: ratio is 0" in caplog.text


def test_zimage_merged_output_is_close_to_unmerged_on_a_smooth_latent(comfy, zimage):
    """ToMA stands each merged token's layer update in for its group's: on a smooth latent,
    where neighbours are near-duplicates, that must cost a small part of what the merged
    layers do at all. The yardstick is the same model with the two layers skipped (their
    whole contribution); merging half the tokens measured 0.17 of it (0.05 vs 0.29
    relative), random latents 0.7 of it: the bound 0.3 leaves room for BLAS differences."""

    class Skip(torch.nn.Module):
        def forward(self, x, *args, **kwargs):
            return x

    g = torch.Generator().manual_seed(3)
    hh, ww = torch.linspace(0, 1, H)[:, None], torch.linspace(0, 1, W)[None]
    x = torch.stack([torch.sin(2 * hh + 3 * ww + c) for c in range(4)])[None] + 0.02 * torch.randn(
        1, 4, H, W, generator=g
    )
    context = torch.randn(1, 6, 32, generator=g)
    skipped = zimage.clone()
    for i in range(2):
        skipped.add_object_patch(f"diffusion_model.layers.{i}", Skip())
    reference = _denoise(zimage, x, 0.7, context)
    merged = _denoise(patch_model(zimage, 0.5, blocks=ALL), x, 0.7, context)
    whole = float((_denoise(skipped, x, 0.7, context) - reference).norm())
    error = float((merged - reference).norm())
    assert 1e3 * fp32_floor(reference) * reference.numel() ** 0.5 < error < 0.3 * whole


@pytest.mark.parametrize("proportional", [True, False], ids=["proportional", "plain"])
def test_zimage_merging_identical_tokens_is_exact_with_proportional_attention(comfy, zimage, proportional):
    """All image tokens equal (a constant latent) and one position for all of them (ComfyUI's
    ``rope_options`` scaled to 0): merged tokens are the tokens themselves, and with
    proportional attention each merged key weighs as the keys it stands for, so the output
    is the unmerged one up to fp32 reassociation (measured 2e-6 at |out| 1.1, 16 ulps;
    bound 100 ulps). Without it the caption's queries see half the image's keys: the
    output moves by 0.16, which the same bound catches."""
    rope = zimage.clone()
    options = rope.model_options.setdefault("transformer_options", {})
    options["rope_options"] = {"scale_x": 0.0, "scale_y": 0.0, "shift_x": 0.0, "shift_y": 0.0}
    x = torch.full((1, 4, H, W), 0.3)
    x[:, 1] = -0.5
    context = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(5))
    reference = _denoise(rope, x, 0.7, context)
    patched = patch_model(rope, 0.5, blocks=ALL, proportional_attention=proportional)
    out = _denoise(patched, x, 0.7, context)
    assert patched.toma_run.tokens == (N, 30)
    close = torch.allclose(out, reference, rtol=0, atol=100 * fp32_floor(reference))
    assert close == proportional


def test_zimage_steps_outside_the_window_are_bitwise_unmerged(comfy, zimage):
    sampling = zimage.get_model_object("model_sampling")
    steps, start, end = 4, 0.3, 0.7
    sigmas = comfy.comfy.samplers.calculate_sigmas(sampling, "normal", steps)
    hi, lo = sampling.percent_to_sigma(start), sampling.percent_to_sigma(end)
    inside = [lo <= float(s) <= hi for s in sigmas[:-1]]
    assert any(inside) and not all(inside)  # the window cuts the run

    def denoised(patcher):
        out = []
        _run(comfy, patcher, steps=steps, callback=lambda i, x0, x, total: out.append(x0.clone()))
        return out

    plain = denoised(zimage)
    patched = patch_model(zimage, 0.5, blocks=ALL, start_percent=start, end_percent=end)
    seen, handles = _record(zimage)
    try:
        windowed = denoised(patched)
    finally:
        for h in handles:
            h.remove()
    assert seen["layer0.qkv"] == [CAPTION + (30 if i else N) + PAD for i in inside]
    first = inside.index(True)
    for i in range(first):
        assert windowed[i].equal(plain[i])
    assert not windowed[first].equal(plain[first])


def test_zimage_default_blocks_skip_the_first_five_layers(comfy):
    model = zimage_patcher(comfy, layers=7, seed=2)
    patched = patch_model(model, 0.5)
    assert set(patched.object_patches) == {"diffusion_model.layers.5", "diffusion_model.layers.6"}
    with pytest.raises(ValueError, match="blocks: unknown block stack 'double'"):
        patch_model(model, 0.5, blocks="double:all")
    with pytest.raises(ValueError, match="merge_mlp: 'off' is not available on Z-Image"):
        patch_model(model, 0.5, merge_mlp="off")


def test_zimage_weight_patches_reach_the_merged_layers(comfy, zimage, reference):
    """A LoRA-style weight patch on a merged layer's projection: the object patch shares the
    layer's submodules, so ComfyUI patches the weights the merged layer uses."""
    lora = zimage.clone()
    key = "diffusion_model.layers.1.attention.qkv.weight"
    weight = zimage.model.diffusion_model.layers[1].attention.qkv.weight
    lora.add_patches({key: (torch.randn(weight.shape, generator=torch.Generator().manual_seed(9)) * 0.05,)}, 1.0)
    with_lora = _run(comfy, lora)
    assert not with_lora.equal(reference)
    assert _run(comfy, patch_model(lora, 0.0, blocks=ALL)).equal(with_lora)  # the layers run as object patches
    merged = _run(comfy, patch_model(lora, 0.5, blocks=ALL))
    assert not merged.equal(_run(comfy, patch_model(zimage, 0.5, blocks=ALL)))


def test_zimage_key_mask_is_fitted_other_masks_and_omni_run_unmerged(comfy, zimage, caplog):
    """This ComfyUI passes no mask to the layers (``patchify_and_embed`` returns None); one that
    does gets a key mask taken at the kept positions, and any other mask runs the layer
    unmerged, with one warning."""
    patched = patch_model(zimage, 0.5, blocks=ALL)
    run = patched.toma_run
    # loaded as sampling loads it: a patched model loaded before has its object patches undone
    comfy.comfy.model_management.load_models_gpu([zimage])
    layer = zimage.model.diffusion_model.layers[0]
    stand_in = NextDiTLayer(run, 0, layer, True, 32)
    g = torch.Generator().manual_seed(4)
    length = CAPTION + N + PAD
    x = torch.randn(2, length, 256, generator=g)
    pe = zimage.model.diffusion_model.rope_embedder(torch.randn(1, length, 3, generator=g)).movedim(1, 2)
    adaln = torch.randn(2, 256, generator=g)
    run.begin_run()
    run.begin_call(torch.zeros(2, 4, H, W), torch.tensor([0.5]))
    keys = torch.ones(2, length, dtype=torch.bool)
    keys[:, 6:CAPTION] = False  # the caption's padding
    with torch.no_grad():
        unmasked = stand_in.forward(x, None, pe, adaln, transformer_options={})
        masked = stand_in.forward(x, keys, pe, adaln, transformer_options={})
        queries = torch.ones(2, 1, length, length, dtype=torch.bool)
        with caplog.at_level(logging.WARNING, logger="toma.comfyui"):
            whole = stand_in.forward(x, queries, pe, adaln, transformer_options={})
            stand_in.forward(x, queries, pe, adaln, transformer_options={})
        plain = layer.forward(x, queries, pe, adaln, transformer_options={})
        # omni mode: parts of the sequence modulated at their own timestep run unmerged too
        zero = [(CAPTION, CAPTION + N)]
        with caplog.at_level(logging.WARNING, logger="toma.comfyui"):
            omni = stand_in.forward(x, None, pe, adaln, timestep_zero_index=zero, transformer_options={})
        omni_plain = layer.forward(x, None, pe, adaln, timestep_zero_index=zero, transformer_options={})
    assert masked.shape == unmasked.shape == x.shape and (masked - unmasked).abs().max() > 1e-3
    assert whole.equal(plain) and omni.equal(omni_plain)
    assert "runs unmerged: omni mode" in caplog.text
    warnings = [r for r in caplog.records if "runs unmerged: the attention mask" in r.getMessage()]
    assert len(warnings) == 1


def test_zimage_patched_while_another_patched_clone_is_loaded(comfy, zimage):
    """While a patched clone is loaded its stand-ins sit in the shared model. A clone's
    ``get_model_object`` finds the layers in the backups it shares with its parent; a
    patcher made apart around the same model has no such backups and finds the stand-ins:
    toma wraps the layers themselves, never another patch's stand-ins."""
    first = patch_model(zimage, 0.5, blocks=ALL)
    out = _run(comfy, first)
    layers = zimage.model.diffusion_model.layers
    assert isinstance(getattr(layers[0], "toma_layer", None), NextDiTLayer)
    apart = comfy.model_patcher.ModelPatcher(
        zimage.model, load_device=torch.device("cpu"), offload_device=torch.device("cpu")
    )
    for parent in (zimage, apart):
        second = patch_model(parent, 0.5, blocks=ALL)
        for i in range(2):
            wrapped = second.object_patches[f"diffusion_model.layers.{i}"].toma_layer.layer
            assert not hasattr(wrapped, "toma_layer")
    assert _run(comfy, patch_model(zimage, 0.5, blocks=ALL)).equal(out)


def test_zimage_key_bias_reaches_the_merged_layers_attention_only(comfy, zimage):
    """Proportional attention through the attention override, chained in front of one set
    before toma: of the four attention calls of a denoiser call (caption refiner, noise
    refiner, layers 0 and 1) only the merged layer's gets the key bias, over the merged
    sequence."""
    calls = []

    def other_override(*args, **kwargs):  # another node's attention, as set_model_optimized_attention takes it
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        calls.append((args[1].shape[-2], None if mask is None else tuple(mask.shape)))
        return hooks.resolve("comfy.ldm.modules.attention:attention_pytorch")(*args, **kwargs)

    before = zimage.clone()
    before.set_model_optimized_attention(other_override)
    _run(comfy, patch_model(before, 0.5, blocks="layers:1"), steps=1)
    merged = CAPTION + 30 + PAD
    assert calls == [(CAPTION, None), (N + PAD, None), (CAPTION + N + PAD, None), (merged, (2, 1, 1, merged))]
    calls.clear()
    _run(comfy, patch_model(before, 0.5, blocks="layers:1", proportional_attention=False), steps=1)
    assert calls[-1] == (merged, None)


def test_zimage_forward_without_its_layer_call_is_refused(comfy, zimage, caplog, monkeypatch):
    cls = hooks.resolve(hooks.NEXTDIT)

    def _forward(self, x, timesteps, context, num_tokens, attention_mask=None, transformer_options={}, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setattr(cls, "_forward", _forward)
    with caplog.at_level(logging.WARNING, logger="toma.comfyui"):
        out = patch_model(zimage, 0.5)
    assert out is zimage
    assert "NextDiT's main layers" in caplog.text and "no longer contains" in caplog.text


def test_lumina2_layout_merges_too(comfy, caplog):
    """Lumina 2 is the same class without the padding to 32 and with grouped keys and values:
    the sequence is [caption; image], nothing after the image."""
    model = zimage_patcher(
        comfy,
        seed=2,
        pad_tokens_multiple=None,
        n_kv_heads=1,
        z_image_modulation=False,
        dim=64,
        n_heads=2,
        axes_dims=[8, 12, 12],
    )
    reference = _run(comfy, model)
    patched = patch_model(model, 0.5, blocks=ALL)
    seen, handles = _record(model)
    try:
        out = _run(comfy, patched)
    finally:
        for h in handles:
            h.remove()
    assert seen["layer0.mlp"] == [6 + 30] * 2 and seen["refiner"] == [N] * 2
    assert torch.isfinite(out).all() and not out.equal(reference)


def test_torch_compile_model_traces_the_stand_ins_without_graph_breaks(comfy, zimage):
    """Core TorchCompileModel's wrapper compiles the whole diffusion model, whose merged
    layers are toma's stand-ins (a copied module with its own ``forward``): dynamo's
    ``eager`` backend (tracing only) traces them with no break and gives the eager output."""
    import torch._dynamo
    from comfy_api.torch_helpers.torch_compile import set_torch_compile_wrapper
    from torch._dynamo.utils import counters

    patched = patch_model(zimage, 0.5, blocks=ALL)
    eager = _run(comfy, patched, steps=1)
    compiled = patched.clone()
    set_torch_compile_wrapper(compiled, backend="eager")
    torch._dynamo.reset()
    counters.clear()
    try:
        out = _run(comfy, compiled, steps=1)
        breaks, frames = dict(counters["graph_break"]), dict(counters["frames"])
    finally:
        torch._dynamo.reset()
    assert frames.get("ok", 0) > 0 and breaks == {}
    assert patched.toma_run.merged_calls == 1
    assert torch.equal(out, eager)


def test_zimage_odd_latent_batch_two_with_cfg_gets_a_plan_per_sample(comfy, zimage, monkeypatch):
    """A 13x21 latent is padded to whole patches (7x11 = 77 tokens, then 19 pad tokens up to
    96); two samples under CFG are four sequences in one call, each with its own plan."""
    from toma.adapters import state

    selections = []
    build = state.build_plan
    monkeypatch.setattr(
        state, "build_plan", lambda tiles, *a, **k: selections.append(tiles.shape[0]) or build(tiles, *a, **k)
    )
    patched = patch_model(zimage, 0.5, blocks=ALL)
    seen, handles = _record(zimage)
    try:
        out = sample(comfy, patched, "flux", h=13, w=21, steps=2, batch=2)
    finally:
        for h in handles:
            h.remove()
    k = patched.toma_run.tokens[1]
    assert patched.toma_run.tokens[0] == 77 and k < 77
    assert seen["layer1.qkv"] == [CAPTION + k + 19] * 2 and seen["refiner"] == [96] * 2
    assert selections == [4] * 2  # one selection per call, for cond and uncond of both samples
    assert out.shape == (2, 4, 13, 21) and torch.isfinite(out).all()
