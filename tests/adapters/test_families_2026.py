"""What the 2026 families do beyond the conformance suite (their rows are in tests/tiny_models.py).

HunyuanVideo 1.5's text-to-video calls and its text mask, Wan VACE's raster order and
control-block plans, SkyReels-V2's diffusion-forcing modes and image-to-video calls,
Wan-Animate's one-frame tiles, and the families ToMA refuses, each with its reason.
"""

from __future__ import annotations

import importlib
import inspect
import warnings

import pytest
import torch

import toma
from tests.tiny_models import (
    FAMILIES,
    hunyuan15_inputs,
    make_skyreels,
    wan_inputs,
)
from toma.adapters.base import Hook, register_innermost, remove_hook


def output(model, kw) -> torch.Tensor:
    with torch.no_grad():
        return model(**kw).sample


def toma_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "ToMA" in str(w.message)]


class CallSpy(Hook):
    """Records the keyword arguments of each call of the module it is registered on."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def pre_forward(self, module, *args, **kwargs):
        self.calls.append(kwargs)
        return args, kwargs


# ------------------------------------------------------------------ HunyuanVideo 1.5
def test_hunyuanvideo15_text_to_video_merges_with_the_text_mask_as_is():
    # text to video passes zero image embeddings, whose tokens the model masks out: the
    # merged attention gets the block's (B, T) text mask unchanged (the processor pads it
    # to the merged video length itself), K video tokens, and merges without a warning
    fam = FAMILIES["hunyuanvideo15"]
    model = fam.make()
    kw = {**hunyuan15_inputs(2, 3, 8, 8), "image_embeds": torch.zeros(2, 2, 16)}
    kw["encoder_attention_mask"][1, -2:] = 0
    reference = output(model, kw)
    patch = toma.apply_toma(model, ratio=0.5, **fam.options)
    calls = []
    register_innermost(model.transformer_blocks[0].attn, CallSpy(calls), "spy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged = output(model, kw)
    remove_hook(model.transformer_blocks[0].attn, "spy")
    assert toma_warnings(caught) == []
    text = 2 + 3 + 6  # image-embedding, ByT5 and MLLM tokens
    kept = patch.cache.layout(3, 4, 4).num_merged
    assert [tuple(c["attention_mask"].shape) for c in calls] == [(1, text)] * 2  # once per sample (own plans)
    assert [c["hidden_states"].shape[1] for c in calls] == [kept] * 2
    assert (merged - reference).abs().max() > 1e-3
    toma.remove_toma(model)
    assert torch.equal(output(model, kw), reference)


# ------------------------------------------------------------------ Wan VACE
def test_wan_vace_runs_in_raster_order_with_plans_for_the_control_blocks():
    # the hints are added in raster order, so no forward takes tile order; the control
    # blocks' tokens are the control video's: they get plans of their own
    from toma.adapters.state import PlanCache

    fam = FAMILIES["wan-vace"]
    model, kw = fam.make(), fam.divided_inputs(2)  # a grid the tiles divide: tile order would be possible
    patch = toma.apply_toma(model, ratio=0.5, **fam.options)
    asked = []
    real = PlanCache.tile_order_layout
    PlanCache.tile_order_layout = lambda self, *a, **k: asked.append(1) or real(self, *a, **k)
    try:
        output(model, kw)
    finally:
        PlanCache.tile_order_layout = real
    assert asked == []  # raster order is decided before any tile layout is asked for
    groups = {key[0] for key in patch.cache._plans}
    grid = patch.cache.base_grid
    assert groups == {grid, ("vace", grid)}


def test_wan_vace_control_blocks_merge_only_when_asked():
    fam = FAMILIES["wan-vace"]
    model = fam.make()
    patch = toma.apply_toma(model, ratio=0.5, blocks={"blocks": range(3)})
    assert [t.name for t in patch.patched] == ["blocks.0.attn1", "blocks.1.attn1", "blocks.2.attn1"]


# ------------------------------------------------------------------ SkyReels-V2
def test_skyreels_causal_diffusion_forcing_runs_unmerged_with_one_warning():
    # num_frame_per_block > 1 masks self-attention frame-block causally over the unmerged
    # tokens: the whole forward runs unmerged, bitwise, and says why once
    model = make_skyreels(num_frame_per_block=2)
    kw = {
        **wan_inputs(2, 4, 8, 8),
        "timestep": torch.tensor([[900.0, 900.0, 500.0, 500.0]] * 2),
        "enable_diffusion_forcing": True,
    }
    reference = output(model, kw)
    toma.apply_toma(model, ratio=0.5, blocks={"blocks": range(3)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = output(model, kw), output(model, kw)
    found = toma_warnings(caught)
    assert len(found) == 1 and "num_frame_per_block=2" in found[0] and "run unmerged" in found[0]
    assert torch.equal(first, reference) and torch.equal(second, reference)


def test_skyreels_diffusion_forcing_without_a_mask_merges_in_raster_order():
    # per-frame timesteps modulate each token by its raster place: merged, in raster order
    model = make_skyreels()
    kw = {
        **wan_inputs(2, 4, 8, 8),
        "timestep": torch.tensor([[900.0, 900.0, 500.0, 500.0]] * 2),
        "enable_diffusion_forcing": True,
    }
    reference = output(model, kw)
    patch = toma.apply_toma(model, ratio=0.5, blocks={"blocks": range(3)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged = output(model, kw)
    assert toma_warnings(caught) == []
    assert patch.cache.forward.plans  # it planned merges
    assert (merged - reference).abs().max() > 1e-3
    from toma.adapters.engine import StepHook

    [hook] = [h for h in model._diffusers_hook.hooks.values() if isinstance(h, StepHook)]
    assert hook.order.layout is None  # raster order


def test_skyreels_image_to_video_merges_the_cross_attention_queries():
    # image-to-video: the cross-attention's keys are CLIP image tokens then 512 text tokens
    # (the processor splits them at 512 from the end); only its queries merge
    torch.manual_seed(0)
    model = make_skyreels(added_kv_proj_dim=16, image_dim=16)
    kw = {**wan_inputs(1, 2, 8, 8, text=512), "encoder_hidden_states_image": torch.randn(1, 3, 16)}
    reference = output(model, kw)
    patch = toma.apply_toma(model, ratio=0.5, blocks={"blocks": range(3)}, merge_crossattn=True)
    queries, keys = [], []
    attn2 = model.blocks[1].attn2
    handles = [
        attn2.to_q.register_forward_pre_hook(lambda m, a: queries.append(a[0].shape[1])),
        attn2.add_k_proj.register_forward_pre_hook(lambda m, a: keys.append(a[0].shape[1])),
    ]
    merged = output(model, kw)
    for h in handles:
        h.remove()
    assert queries == [patch.cache.layout(2, 4, 4).num_merged] and keys == [3]
    assert (merged - reference).abs().max() > 1e-3
    toma.remove_toma(model)
    assert torch.equal(output(model, kw), reference)


# ------------------------------------------------------------------ Wan-Animate
def test_wan_animate_tiles_one_frame():
    fam = FAMILIES["wan-animate"]
    model = fam.make()
    with pytest.raises(ValueError, match="tile_frames must be 1"):
        toma.apply_toma(model, ratio=0.5, tile_frames=2)
    assert not hasattr(model, "_diffusers_hook")
    assert toma.apply_toma(model, ratio=0.5, tile_frames=1).cache.layout(4, 6, 8).tt == 1


def test_wan_animate_face_adapter_needs_one_frame_tiles(monkeypatch):
    # why tile_frames is pinned: with 2-frame tiles in tile order the face adapter's
    # per-frame runs hold two frames' tokens, and tile order no longer computes what
    # raster order does (the conformance suite checks that 1-frame tiles do)
    from toma.adapters.families import wan_animate
    from toma.adapters.state import PlanCache

    fam = FAMILIES["wan-animate"]
    model, kw = fam.make(), fam.divided_inputs(1)
    monkeypatch.setattr(wan_animate._Quirks, "tile_frames", lambda self, config, frames: 2)
    toma.apply_toma(model, ratio=0.5, **fam.options)
    tiled = output(model, kw)
    monkeypatch.setattr(PlanCache, "tile_order_layout", lambda self, *a, **k: None)
    raster = output(model, kw)
    assert (tiled - raster).abs().max() > 1e-3  # tile-vs-raster differ by ~1e-7 where it is sound


# ------------------------------------------------------------------ refused families
REFUSED = [
    ("SanaVideoTransformer3DModel", "attention is linear"),
    ("SanaWMTransformer3DModel", "gated-DeltaNet linear attention"),
    ("Cosmos3OmniTransformer", "packed mixture of transformers"),
    ("Kandinsky6SRTransformer3DModel", "local windows"),
    ("AnyFlowFARTransformer3DModel", "cache of earlier chunks' keys and values"),
    ("WanAnimate2Transformer3DModel", "cache of the reference pass's keys and values"),
    ("AceStepTransformer1DModel", "denoises audio"),
    ("StableAudioDiTModel", "denoises audio"),
    ("StableAudio3DiTModel", "denoises audio"),
    ("LongCatAudioDiTTransformer", "denoises audio"),
    ("MiniMaxMusic3Transformer1DModel", "denoises audio"),
    ("JoyImageEditPlusTransformer3DModel", "packed per sample"),
]


@pytest.mark.parametrize(
    "name, needles",
    [
        ("JoyImageEditPlusTransformer3DModel", ("max_num_patches", "shape_list[i]", "sample_cos_list")),
    ],
)
def test_the_not_yet_supported_refusals_name_what_the_code_does(name, needles):
    # each refusal's reason is read off the installed diffusers' source of the model's module:
    # what it names is there (so a diffusers that drops it fails here, and the refusal is revisited)
    cls = getattr(importlib.import_module("diffusers"), name)
    source = inspect.getsource(inspect.getmodule(cls))
    assert all(needle in source for needle in needles), [n for n in needles if n not in source]


@pytest.mark.parametrize("name,reason", REFUSED)
def test_refused_families_name_what_toma_cannot_merge(name, reason):
    # the refusal is decided by class before any weight is read: an instance of the real
    # diffusers class, its nn.Module state only (building each from a config would test
    # nothing more here and cost seconds each)
    cls = getattr(importlib.import_module("diffusers"), name)
    model = cls.__new__(cls)
    torch.nn.Module.__init__(model)
    with pytest.raises(ValueError, match=f"ToMA does not merge {name}: .*{reason}"):
        toma.apply_toma(model, ratio=0.5)
    assert not hasattr(model, "_diffusers_hook")


# ------------------------------------------------------------------ Cosmos
def step_hook(model):
    from toma.adapters.engine import StepHook

    [hook] = [h for h in model._diffusers_hook.hooks.values() if isinstance(h, StepHook)]
    return hook


@pytest.mark.parametrize("case", ["per-frame timesteps", "learnable positions"])
def test_cosmos_raster_ordered_inputs_merge_in_raster_order(case):
    # video-to-world's per-frame timesteps and Predict 1's learnable positional embedding are
    # laid out over the raster sequence: those forwards merge, in raster order, and match
    # what the same merges compute from raster order (tile order would misplace them)
    from tests.tiny_models import cosmos_inputs, make_cosmos

    model = make_cosmos(extra_pos_embed_type="learnable" if case == "learnable positions" else None)
    kw = cosmos_inputs(1, 3, 8, 8)
    if case == "per-frame timesteps":
        kw["timestep"] = torch.tensor([0.9, 0.5, 0.5]).view(1, 1, 3, 1, 1)
    reference = output(model, kw)
    patch = toma.apply_toma(model, ratio=0.5, blocks={"transformer_blocks": range(3)})
    merged = output(model, kw)
    assert step_hook(model).order.layout is None and patch.cache.forward.plans
    assert (merged - reference).abs().max() > 1e-3
    plain = cosmos_inputs(1, 3, 8, 8)
    if case == "per-frame timesteps":  # the same model with one timestep keeps tile order
        output(model, plain)
        assert step_hook(model).order.layout is not None


# ------------------------------------------------------------------ proportional attention
@pytest.mark.parametrize(
    "name", ["longcat-image", "hunyuanimage", "krea2", "bria-fibo"]
)  # the Wan clones are rows of tests/adapters/test_proportional_families.py
def test_proportional_attention_reaches_the_new_families_processors(name, monkeypatch):
    # the key bias reaches the family's own processor and diffusers' dispatch: every form
    # the backend rule can pick computes what the float mask does (fp32 rounding, under
    # 1e-5 of the output's range through these tiny blocks, as in
    # tests/adapters/test_proportional_families.py), and the bias moves the output by more than 1e-3
    import warnings as _w

    from tests.cases import force
    from toma.adapters import attention as A

    fam = FAMILIES[name]
    model, kw = fam.make(), fam.inputs(2)
    out = {}
    for proportional in (False, True):
        toma.apply_toma(model, ratio=0.5, proportional_attention=proportional, **fam.options)
        out[proportional] = output(model, kw)
        toma.remove_toma(model)
    for form in (A.KEY_CHANNEL, A.FLEX):
        with monkeypatch.context() as m, _w.catch_warnings():
            _w.filterwarnings("ignore", message="flex_attention called without torch.compile")
            force(m, form)
            toma.apply_toma(model, ratio=0.5, proportional_attention=True, **fam.options)
            got = output(model, kw)
            toma.remove_toma(model)
        scale = float(out[True].abs().max())
        torch.testing.assert_close(got, out[True], atol=1e-5 * scale, rtol=0, msg=form)
    assert (out[False] - out[True]).abs().max() > 1e-3 * float(out[True].abs().max())


# ------------------------------------------------------------------ HunyuanImage 2.1
def test_hunyuanimage_checkpointing_fails_in_diffusers_unpatched():
    # why its conformance row skips the checkpointed-gradient test: diffusers 0.42.1 passes
    # the blocks keyword arguments that its checkpoint function does not take; when this
    # starts passing, the row's checkpointing flag should go
    fam = FAMILIES["hunyuanimage"]
    model = fam.make()
    model.enable_gradient_checkpointing()
    with pytest.raises(TypeError, match="unexpected keyword argument 'attention_mask'"):
        model(**fam.inputs(1)).sample.sum().backward()


def test_hunyuanimage_merges_its_2d_grid_and_keeps_the_text_padding_masked():
    # a 2-D latent: the grid is (1, h/2, w/2); padded text stays hidden under merging
    # (exp of the masked scores underflows to exactly 0, so their values change nothing)
    fam = FAMILIES["hunyuanimage"]
    model, kw = fam.make(), fam.inputs(2)
    reference = output(model, kw)
    patch = toma.apply_toma(model, ratio=0.5, **fam.options)
    merged = output(model, kw)
    assert patch.cache.base_grid == (1, 8, 10) and (merged - reference).abs().max() > 1e-3
    changed = {**kw, "encoder_hidden_states": kw["encoder_hidden_states"].clone()}
    changed["encoder_hidden_states"][1, -2:] = 100.0
    torch.testing.assert_close(output(model, changed), merged, rtol=0, atol=1e-6)
