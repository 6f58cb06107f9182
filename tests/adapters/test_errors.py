"""Bad input raises a clear error before anything is patched."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from diffusers import UNet2DConditionModel

import toma
from tests.tiny_models import FAMILIES, flux_inputs, make_flux, make_sd15_unet, unet_inputs


def hooked_modules(model):
    return [m for m in model.modules() if getattr(m, "_diffusers_hook", None) and m._diffusers_hook.get_hook("toma")]


BAD = [
    ({"ratio": 1.0}, ValueError, "ratio"),
    ({"ratio": -0.1}, ValueError, "ratio"),
    ({"ratio": math.nan}, ValueError, r"\[0, 1\)"),
    ({"ratio": "half"}, TypeError, "ratio"),
    ({"tile_size": 0}, ValueError, "tile_size"),
    ({"tile_size": (4, -1)}, ValueError, "tile_size"),
    ({"tile_size": 2.5}, TypeError, "tile_size"),
    ({"selection": "bipartite"}, ValueError, "'facility', 'random', 'grid'"),
    ({"temperature": -1.0}, ValueError, "temperature"),
    ({"recompute_every": 0}, ValueError, "recompute_every"),
    ({"levels": 0}, ValueError, "levels"),
    ({"mlp_levels": (1,)}, ValueError, "mlp_levels is set but merge_mlp is off"),
    ({"mlp_levels": (2,), "merge_mlp": True}, ValueError, r"mlp_levels must name merged levels, in 1..levels=1"),
    ({"mlp_levels": (0,), "merge_mlp": True}, ValueError, "mlp_levels entries must be >= 1"),
    ({"mlp_levels": 2, "merge_mlp": True}, TypeError, "mlp_levels must be a sequence of attention levels"),
    ({"start_step": -1}, ValueError, "start_step"),
    ({"start_step": 1.5}, TypeError, "start_step"),
    ({"stop_step": 0}, ValueError, "stop_step"),
    ({"start_step": 3, "stop_step": 3}, ValueError, "stop_step must be greater than start_step"),
    ({"merge_mlp": "yes"}, TypeError, "merge_mlp"),
    ({"max_downsample": 2}, TypeError, "unknown ToMA option"),
    # torch's generator takes [-2**63, 2**64 - 1]: past it the first forward used to overflow
    ({"seed": 2**64, "selection": "random"}, ValueError, r"seed must be in \[-2\*\*63, 2\*\*64 - 1\]"),
    ({"seed": -(2**63) - 1, "selection": "random"}, ValueError, "seed must be in"),
    ({"seed": 1.0}, TypeError, "seed must be an int"),
]


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63)])
def test_seeds_at_the_range_ends_run(seed):
    # an accepted seed must work: the random selection seeds its generator at the first forward
    unet = make_sd15_unet()
    kw = unet_inputs(1, 16, 16, False)
    toma.apply_toma(unet, ratio=0.5, selection="random", seed=seed)
    with torch.no_grad():
        assert torch.isfinite(unet(**kw).sample).all()


@pytest.mark.parametrize("options,error,message", BAD)
def test_bad_options_raise_and_leave_model_unpatched(options, error, message):
    unet = make_sd15_unet()
    kw = unet_inputs(1, 16, 16, False)
    with torch.no_grad():
        ref = unet(**kw).sample
    with pytest.raises(error, match=message):
        toma.apply_toma(unet, **options)
    assert toma.get_toma(unet) is None and not hooked_modules(unet)
    with torch.no_grad():
        assert torch.equal(unet(**kw).sample, ref)


def test_bad_options_keep_previous_patch():
    unet = make_sd15_unet()
    patch = toma.apply_toma(unet, ratio=0.5)
    count = len(hooked_modules(unet))
    with pytest.raises(ValueError, match="ratio"):
        toma.apply_toma(unet, ratio=2.0)
    assert toma.get_toma(unet) is patch and len(hooked_modules(unet)) == count


def test_config_object_accepted_and_validated():
    unet = make_sd15_unet()
    cfg = toma.ToMAConfig(ratio=0.25, tile_size=(2, 4))
    assert toma.apply_toma(unet, cfg).config == cfg
    assert toma.apply_toma(unet, config=cfg, ratio=0.5).config.ratio == 0.5
    with pytest.raises(ValueError, match="tile_size"):
        toma.ToMAConfig(tile_size=(0, 4))
    with pytest.raises(TypeError, match="ToMAConfig"):
        toma.apply_toma(unet, config={"ratio": 0.5})


def test_models_without_supported_blocks():
    with pytest.raises(ValueError, match="no blocks ToMA supports"):
        toma.apply_toma(torch.nn.Linear(4, 4), ratio=0.5)
    no_attention = UNet2DConditionModel(
        sample_size=8,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        mid_block_type=None,
        norm_num_groups=8,
        cross_attention_dim=32,
    )
    with pytest.raises(ValueError, match="no blocks ToMA supports"):
        toma.apply_toma(no_attention)
    assert not hooked_modules(no_attention)
    with pytest.raises(TypeError, match="pipe_or_model"):
        toma.apply_toma("not a model")


def test_options_that_select_nothing_raise():
    unet = make_sd15_unet()
    with pytest.raises(ValueError, match="no blocks"):
        toma.apply_toma(unet, merge_attn=False)
    assert not hooked_modules(unet)


def test_flux_bad_block_indices_and_other_processors():
    model = make_flux(double=3, single=3)
    with pytest.raises(ValueError, match=r"flux_single_blocks must hold indices in \[0, 2\]"):
        toma.apply_toma(model, flux_single_blocks=(1, 7))
    assert not hooked_modules(model)
    with pytest.raises(ValueError, match="give blocks or flux_double_blocks/flux_single_blocks, not both"):
        toma.apply_toma(model, flux_double_blocks=(1,), blocks={"transformer_blocks": (1,)})
    assert not hooked_modules(model)

    # merging wraps the attention module, so a processor of the user's own runs on the
    # merged tokens as Flux's does
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    seen = []

    class OtherProcessor(FluxAttnProcessor):
        def __call__(self, attn, hidden_states, *args, **kwargs):
            seen.append(hidden_states.shape[1])
            return super().__call__(attn, hidden_states, *args, **kwargs)

    model.transformer_blocks[2].attn.processor = OtherProcessor()
    patch = toma.apply_toma(model, ratio=0.5, flux_double_blocks=(1, 2))
    double = [p.name for p in patch.patched if p.name.startswith("transformer_blocks")]
    assert double == ["transformer_blocks.1.attn", "transformer_blocks.2.attn"]
    with torch.no_grad():
        model(**flux_inputs(1, 8, 8))
    assert seen == [32]  # 64 image tokens at ratio 0.5


def test_failure_while_attaching_rolls_back(monkeypatch):
    unet = make_sd15_unet()
    from toma.adapters import unet as unet_adapter

    original = unet_adapter.attach

    def failing_attach(model, targets, cache, ledger):
        original(model, targets[:1], cache, ledger)
        raise RuntimeError("boom")

    monkeypatch.setattr(unet_adapter, "attach", failing_attach)
    with pytest.raises(RuntimeError, match="boom"):
        toma.apply_toma(unet)
    assert toma.get_toma(unet) is None and not hooked_modules(unet)


def test_unusable_outputs_fail_before_any_work(tmp_path, capsys, monkeypatch):
    from toma.tools import generate
    from toma.tools.bench import harness as bench_harness
    from toma.tools.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(generate, "run_builtin", lambda args: pytest.fail("generated before checking --out"))
    monkeypatch.setattr(bench_harness, "build_model", lambda *a, **k: pytest.fail("benchmarked before checking --out"))
    cases = [
        (["generate", "--out", str(blocker / "x.png")], "--out: cannot write to"),
        (["generate", "--out", str(tmp_path / "name")], "--out must end in one of .png"),
        (["generate", "--out", str(tmp_path)], "--out must end in one of"),
        (["eval", "--out-dir", str(blocker / "d")], "--out-dir: cannot write to"),
        (["bench", "--arch", "tiny-unet", "--out", str(blocker / "d")], "--out: cannot write to"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)


def test_missing_extras_are_named_before_the_work(tmp_path, capsys, monkeypatch):
    import importlib.util

    from toma.tools.bench import harness as bench_harness
    from toma.tools.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["eval", "--out-dir", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib, which is not installed: pip install 'toma-diffusion[eval]'" in err
    assert "Traceback" not in err and not (tmp_path / "e" / "results.json").exists()
    monkeypatch.setattr(bench_harness, "build_model", lambda *a, **k: pytest.fail("stop after the checks"))
    with pytest.raises(pytest.fail.Exception):
        main(["bench", "--arch", "tiny-unet", "--out", str(tmp_path / "b")])
    assert "pip install 'toma-diffusion[bench]'; writing the JSON only" in capsys.readouterr().out


def model_state(model):
    """What a patch could leave on a model: each module's instance attributes (by identity)
    and torch hooks."""
    return {
        name: (
            {k: id(v) for k, v in m.__dict__.items() if not k.startswith("_forward") and k != "_parameters"},
            len(m._forward_pre_hooks),
            len(m._forward_hooks),
        )
        for name, m in model.named_modules()
    }


def wrapped_dispatch() -> set[str]:
    """The loaded modules whose dispatch function is toma's wrapper (a patch of another
    test that was never removed may keep one: its own, not this test's)."""
    loaded = list(sys.modules.items())
    return {n for n, mod in loaded if is_toma_wrapper(vars(mod).get("dispatch_attention_fn"))}


def is_toma_wrapper(fn) -> bool:
    return callable(fn) and "_toma_real" in getattr(fn, "__dict__", {})


def dispatch_users(model) -> list:
    """The model's attention modules that a dispatch wrapper is still kept for."""
    from toma.adapters import attention

    return [m for m in model.modules() for users in attention._users.values() if m in users]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_partly_failed_apply_leaves_nothing_behind(name, monkeypatch):
    # apply_toma fails half-way through its hooks, then once every change but the last is
    # made (the forward guard): each time the ledger undoes what was recorded, and nothing is left
    from toma.adapters.ledger import Ledger

    fam = FAMILIES[name]
    model, kw = fam.make(), fam.inputs(1)
    options = dict(fam.every_part(), ratio=0.5, proportional_attention=True if fam.proportional else None)
    ref = fam.output(model, kw)
    before, wrapped = model_state(model), wrapped_dispatch()
    hooks = len([e for e in toma.apply_toma(model, **options).ledger.entries() if e.startswith("diffusers hook")])
    toma.remove_toma(model)
    assert model_state(model) == before and wrapped_dispatch() <= wrapped and not dispatch_users(model)
    real_hook, calls = Ledger.hook, []

    def failing_hook(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == hooks // 2 + 1:
            raise RuntimeError("boom in a hook")
        return real_hook(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(Ledger, "hook", failing_hook)
        with pytest.raises(RuntimeError, match="boom in a hook"):
            toma.apply_toma(model, **options)
    assert toma.get_toma(model) is None and not hooked_modules(model)
    assert model_state(model) == before and wrapped_dispatch() <= wrapped and not dispatch_users(model)

    def failing_guard(model):
        raise RuntimeError("boom at the guard")

    with monkeypatch.context() as m:
        m.setattr(toma.api, "guard_forward", failing_guard)
        with pytest.raises(RuntimeError, match="boom at the guard"):
            toma.apply_toma(model, **options)
    assert toma.get_toma(model) is None and not hooked_modules(model)
    assert model_state(model) == before and wrapped_dispatch() <= wrapped and not dispatch_users(model)
    assert torch.equal(fam.output(model, kw), ref)
