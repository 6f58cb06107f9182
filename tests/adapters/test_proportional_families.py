"""Proportional attention through each family's merged attention, by every form the
per-backend rule can pick (toma/adapters/attention.py), against the float mask."""

from __future__ import annotations

import warnings

import pytest
import torch

import toma
from tests.cases import clustered_tokens, duplicated_video, force
from tests.tiny_models import flux_inputs, helios_inputs, make_flux, make_wan, wan_inputs
from tests.tiny_models import FAMILIES as TINY
from tests.tiny_models import cogvideox_inputs, flux2_inputs, hunyuan_inputs, make_cogvideox, make_flux2, make_hunyuan
from toma.adapters import attention as A


def run(model, **kw):
    with torch.no_grad():
        out = model(**kw, return_dict=False)[0]
    return torch.stack(out) if isinstance(out, list) else out  # Z-Image: one tensor per sample


@pytest.fixture(autouse=True)
def _quiet_eager_flex():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


FAMILIES = {
    # batch 2, a plan per sample: Flux and HunyuanVideo run their merged attention once per
    # sample (one rotary table per call), so the bias is sliced per sample; HunyuanVideo's
    # second sample pads two text tokens, which its mask folds into the bias
    "flux": (make_flux, lambda: flux_inputs(2, 8, 8), {}),
    "wan": (lambda: make_wan(layers=2), lambda: wan_inputs(2, 2, 8, 8), {"blocks": {"blocks": range(2)}}),
    "flux2": (
        make_flux2,
        lambda: flux2_inputs(2, 8, 8),
        {"blocks": {"transformer_blocks": range(2), "single_transformer_blocks": range(2)}},
    ),
    "hunyuanvideo": (
        make_hunyuan,
        lambda: hunyuan_inputs(2, 2, 8, 8),
        {"blocks": {"transformer_blocks": range(2), "single_transformer_blocks": range(2)}},
    ),
}
# the families built on Wan's spec, whose processors live in modules of their own
# and those whose processors cannot carry the bias in their mask argument: SD3 (toma's own
# joint attention), LTX, LTX-2 and Qwen-Image (the bias waits for the processor's dispatch)
# Z-Image's and ERNIE-Image's image-first attention (the text's keys after the image's), and
# Kandinsky 5's (its processor's dispatch, no mask of its own), FramePack's (its
# history's keys before the merged ones, the text's after them) and Qwen-Image 2.1's (its
# cached prefix keys before the merged ones, however many) and FLUX.3's (the image alone in
# its own blocks, the text first in its single-stream ones)
for _name in (
    "wan-vace",
    "skyreels-v2",
    "wan-animate",
    "sd3",
    "ltx",
    "ltx2",
    "qwenimage",
    "cosmos",
    "joyimage",
    "zimage",
    "ernie-image",
    "kandinsky5",
    "framepack",
    "qwenimage21",
    "flux3",
):
    _f = TINY[_name]
    FAMILIES[_name] = (_f.make, lambda _f=_f: _f.inputs(2), _f.options)
# Helios without its history: behind the 148 history keys the bias moves these outputs by
# under 1e-3 of their range, too little to tell the forms' agreement from no bias at all;
# test_helios checks every form with the history (exact on duplicate tokens)
FAMILIES["helios"] = (TINY["helios"].make, lambda: helios_inputs(2, 2, 16, 16, history=False), TINY["helios"].options)


def outputs(name, monkeypatch) -> dict[str, torch.Tensor]:
    make, inputs, options = FAMILIES[name]
    model, kw = make(), inputs()
    out = {}
    for proportional in (False, True):
        toma.apply_toma(model, ratio=0.5, proportional_attention=proportional, **options)
        out["plain" if not proportional else "mask"] = run(model, **kw)
        toma.remove_toma(model)
    for form in (A.KEY_CHANNEL, A.FLEX):
        with monkeypatch.context() as m:
            force(m, form)
            toma.apply_toma(model, ratio=0.5, proportional_attention=True, **options)
            out[form] = run(model, **kw)
            toma.remove_toma(model)
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_form_equals_the_mask_in_a_family(name, monkeypatch):
    out = outputs(name, monkeypatch)
    scale = float(out["mask"].abs().max())
    # fp32: each merged attention's forms differ by rounding (about 1e-6 of its outputs,
    # tests/core/test_proportional_paths.py); through these 2-4 tiny blocks that stays under
    # 1e-5 of the output's range, against a bias that moves it by more than 1e-3 of it
    for form in (A.KEY_CHANNEL, A.FLEX):
        torch.testing.assert_close(out[form], out["mask"], atol=1e-5 * scale, rtol=0, msg=form)
    assert (out["plain"] - out["mask"]).abs().max() > 1e-3 * scale


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["flux", "wan", "sd3", "qwenimage"])
def test_each_form_equals_the_mask_in_half_precision(name, dtype, monkeypatch):
    # one family per way the bias travels: Flux and Wan in the processor's mask, SD3 through
    # toma's joint attention, Qwen-Image past its processor to the dispatch. In half precision
    # every layer rounds its output to the dtype, so two forms that agree to rounding in each
    # attention (tests/core/test_proportional_paths.py) reach outputs about an ulp of their
    # range apart: measured at most 1.6 units of roundoff (u: 2^-11 fp16, 2^-8 bf16) of the
    # range in these rows. The bound is 3u (bf16) or 4u (fp16). 4x4 tiles at ratio 0.75 give
    # destinations of unequal masses, so the bias itself moves the outputs by more than 4.3u
    # in bf16 and 33u in fp16: a form that dropped it would fail
    make, inputs, options = FAMILIES[name]
    model = make().to(dtype)
    kw = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs().items()}
    out = {}
    for form in (A.MASK, A.KEY_CHANNEL, A.FLEX):
        with monkeypatch.context() as m:
            force(m, form)
            toma.apply_toma(model, ratio=0.75, tile_size=4, proportional_attention=True, **options)
            out[form] = run(model, **kw).float()
            toma.remove_toma(model)
    toma.apply_toma(model, ratio=0.75, tile_size=4, proportional_attention=False, **options)
    plain = run(model, **kw).float()
    toma.remove_toma(model)
    u = torch.finfo(dtype).eps / 2
    bound = (4 if dtype == torch.float16 else 3) * u * float(out[A.MASK].abs().max())
    for form in (A.KEY_CHANNEL, A.FLEX):
        assert (out[form] - out[A.MASK]).abs().max() <= bound, form
    assert (plain - out[A.MASK]).abs().max() > bound


def identity_rotary(module: torch.nn.Module) -> None:
    """Make a rotary module's ``(cos, sin)`` tables the identity: no positions, so that
    copies of a token are duplicates for attention too."""
    module.register_forward_hook(lambda m, args, out: (torch.ones_like(out[0]), torch.zeros_like(out[1])))


@pytest.mark.parametrize("form", A.FORMS)
def test_flux_is_exact_on_duplicate_tokens(form, monkeypatch):
    # two 4x4 tiles, each holding one token 9 times and 7 others once: the 8 destinations
    # of ratio 0.5 keep one of each, so merging loses nothing, and with the log(mass)
    # bias every merged block (attention, and the single-stream blocks' MLP) computes what
    # the unmerged one does: the outputs agree to fp32 rounding
    force(monkeypatch, form)
    model = make_flux()
    identity_rotary(model.pos_embed)
    kw = flux_inputs(1, 4, 8)
    kw["hidden_states"] = clustered_tokens(2)
    ref = run(model, **kw)
    toma.apply_toma(model, ratio=0.5, tile_size=4, proportional_attention=True)
    exact = run(model, **kw)
    toma.apply_toma(model, ratio=0.5, tile_size=4, proportional_attention=False)
    plain = run(model, **kw)
    toma.remove_toma(model)
    torch.testing.assert_close(exact, ref, rtol=1e-4, atol=1e-5)
    assert (plain - ref).abs().max() > 1e-3  # without the bias the 9-fold token is under-weighted


@pytest.mark.parametrize("form", [A.KEY_CHANNEL, A.FLEX])
def test_wan_is_exact_on_duplicate_tokens_by_every_form(form, monkeypatch):
    # tests/adapters/test_dit.py checks this through the CPU's rule (the mask); here the other forms
    force(monkeypatch, form)
    model = make_wan(layers=2)
    model.rope.freqs_cos.fill_(1.0)
    model.rope.freqs_sin.fill_(0.0)
    kw = wan_inputs(1, 2, 8, 8)
    kw["hidden_states"] = duplicated_video()
    ref = run(model, **kw)
    toma.apply_toma(
        model, ratio=0.5, tile_size=2, tile_frames=2, blocks={"blocks": range(2)}, proportional_attention=True
    )
    exact = run(model, **kw)
    toma.remove_toma(model)
    torch.testing.assert_close(exact, ref, rtol=1e-4, atol=1e-5)


def test_hunyuanvideo_bias_covers_video_keys_and_keeps_the_text_padding(monkeypatch):
    from diffusers.models.transformers import transformer_hunyuan_video as hv

    seen = []
    real = hv.dispatch_attention_fn

    def recording(query, key, value, attn_mask=None, **kw):
        seen.append((attn_mask, key.shape[1]))
        return real(query, key, value, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(hv, "dispatch_attention_fn", recording)
    model = make_hunyuan()
    kw = hunyuan_inputs(2, 2, 8, 8)  # 2 x 4 x 4 video tokens, 6 text tokens, sample 1 pads 2
    patch = toma.apply_toma(
        model,
        ratio=0.5,
        proportional_attention=True,
        blocks={"transformer_blocks": [1], "single_transformer_blocks": [1]},
    )
    run(model, **kw)
    merged = [(mask, keys) for mask, keys in seen if keys == 16 + 6]
    assert len(merged) == 4  # two merged blocks, once per sample each
    plans = [plan for _, plan in patch.cache._plans.values()]
    for b, (mask, _) in enumerate(merged[:2]):  # the dual-stream block: samples 0 and 1
        assert mask.shape == (1, 1, 1, 22)
        video, text = mask[0, 0, 0, :16], mask[0, 0, 0, 16:]
        assert any(torch.equal(video, plan.log_mass[b]) for plan in plans)
        want = torch.zeros(6) if b == 0 else torch.tensor([0.0] * 4 + [float("-inf")] * 2)
        assert torch.equal(text, want)


def test_cogvideox_takes_the_bias_as_a_float_mask():
    # CogVideoX's processor calls torch's SDPA itself: the bias is its (B, 1, text + K)
    # mask, text keys first; merged attention with it differs from merged without it
    model = make_cogvideox()
    kw = cogvideox_inputs(2, 3, 8, 8)
    options = {"blocks": {"transformer_blocks": range(3)}}
    toma.apply_toma(model, ratio=0.5, proportional_attention=False, **options)
    plain = run(model, **kw)
    toma.apply_toma(model, ratio=0.5, proportional_attention=True, **options)
    biased = run(model, **kw)
    toma.remove_toma(model)
    assert (biased - plain).abs().max() > 1e-3 * float(plain.abs().max())


def test_remove_toma_restores_the_modules_dispatch(monkeypatch):
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers import transformer_flux

    # patches of earlier tests that were never removed leave the wrapper (harmless: other
    # calls pass through): start from an unwrapped module and no users
    monkeypatch.setattr(transformer_flux, "dispatch_attention_fn", dispatch_attention_fn)
    monkeypatch.setattr(A, "_users", {})
    first, second = make_flux(), make_flux()
    toma.apply_toma(first, ratio=0.5, proportional_attention=True)
    toma.apply_toma(second, ratio=0.5, proportional_attention=True)
    assert transformer_flux.dispatch_attention_fn._toma_real is dispatch_attention_fn
    toma.remove_toma(first)
    assert transformer_flux.dispatch_attention_fn._toma_real is dispatch_attention_fn  # second still merges
    toma.remove_toma(second)
    assert transformer_flux.dispatch_attention_fn is dispatch_attention_fn
    toma.apply_toma(first, ratio=0.5, proportional_attention=False)  # no bias: nothing wrapped
    assert transformer_flux.dispatch_attention_fn is dispatch_attention_fn
    toma.remove_toma(first)


def test_the_key_bias_traces_under_torch_compile(monkeypatch):
    # Dynamo carries the KeyBias through Wan's processor into the wrapped dispatch (the key
    # channel: the form with most ops of its own); the eager backend (tests/adapters/test_compile.py's
    # reason) keeps it fast. The same ops run, so compiled and eager outputs agree to the
    # last bits fp32 reordering can change
    force(monkeypatch, A.KEY_CHANNEL)
    model = make_wan(layers=2)
    kw = wan_inputs(2, 2, 8, 8)
    toma.apply_toma(model, ratio=0.5, proportional_attention=True, blocks={"blocks": range(2)})
    eager = run(model, **kw)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        got = compiled(**kw, return_dict=False)[0]
    toma.remove_toma(model)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", A.FORMS)
def test_hunyuanvideo_is_exact_on_duplicate_tokens(form, monkeypatch):
    # the video family with text keys after the video's and two of them padded: the bias
    # (with the padding folded in as -inf) makes every merged block compute what the
    # unmerged one does, as in the Flux test above (tiles as tests/adapters/test_dit.py's Wan one)
    force(monkeypatch, form)
    model = make_hunyuan()
    identity_rotary(model.rope)
    kw = hunyuan_inputs(1, 2, 8, 8)  # its one sample pads its last 2 of 6 text tokens
    kw["hidden_states"] = duplicated_video()
    ref = run(model, **kw)
    options = dict(
        ratio=0.5,
        tile_size=2,
        tile_frames=2,
        blocks={"transformer_blocks": range(2), "single_transformer_blocks": range(2)},
    )
    toma.apply_toma(model, proportional_attention=True, **options)
    exact = run(model, **kw)
    toma.apply_toma(model, proportional_attention=False, **options)
    plain = run(model, **kw)
    toma.remove_toma(model)
    torch.testing.assert_close(exact, ref, rtol=1e-4, atol=1e-5)
    assert (plain - ref).abs().max() > 1e-3


@pytest.mark.parametrize("form", [A.KEY_CHANNEL, A.FLEX])
def test_lora_gradients_through_each_form_equal_the_masks(form, monkeypatch):
    # LoRA training through merged attention with the bias: the LoRA factors' gradients
    # through the key channel equal those through the float mask (the same maths, another
    # summation order: fp32 rounding, relative to the largest gradient); flex has no
    # backward on CPU, so its calls fall back to the mask in torch's SDPA, said once
    # (before, they ran without the bias)
    pytest.importorskip("peft")
    from peft import LoraConfig

    kw = flux_inputs(2, 8, 8)

    def lora_grads(chosen):
        force(monkeypatch, chosen)
        model = make_flux()
        model.add_adapter(LoraConfig(r=2, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False))
        toma.apply_toma(model, ratio=0.5, proportional_attention=chosen is not None, share_batch_plan=True)
        out = model(**kw, return_dict=False)[0]
        out.square().mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad and "lora" in n}

    monkeypatch.setattr(A, "_warned", set())
    mask, plain = lora_grads(A.MASK), lora_grads(None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other = lora_grads(form)
    fell_back = [w for w in caught if "float mask in torch's SDPA" in str(w.message)]
    assert len(fell_back) == (form == A.FLEX)
    assert mask and mask.keys() == other.keys()
    scale = max(g.abs().max().item() for g in mask.values())
    for name in mask:
        torch.testing.assert_close(other[name], mask[name], rtol=0, atol=1e-5 * scale, msg=name)
    assert max((plain[n] - mask[n]).abs().max().item() for n in mask) > 1e-3 * scale  # the bias reaches the LoRA


def _sd3_duplicates():
    # positions are a learned table added at the patch embedding: zero it, and let the patch
    # projection emit the duplicated tokens on a 4x8 grid
    from tests.tiny_models import make_sd3, sd3_inputs

    model = make_sd3()
    model.pos_embed.pos_embed.zero_()
    tokens = clustered_tokens(2, channels=model.inner_dim).reshape(1, 4, 8, -1).permute(0, 3, 1, 2)
    model.pos_embed.proj.register_forward_hook(lambda m, args, out: tokens.clone())
    return model, sd3_inputs(1, 8, 16), {"blocks": {"transformer_blocks": range(4)}}


def _ltx_duplicates():
    from tests.tiny_models import ltx_inputs, make_ltx

    model = make_ltx()
    identity_rotary(model.rope)
    kw = ltx_inputs(1, 1, 4, 8)
    kw["hidden_states"] = clustered_tokens(2, channels=8)
    return model, kw, {"blocks": {"transformer_blocks": range(3)}}


def _qwen_duplicates():
    from tests.tiny_models import make_qwen, qwen_inputs

    model = make_qwen()
    # complex tables: 1 + 0j rotates nothing
    model.pos_embed.register_forward_hook(lambda m, args, out: tuple(torch.ones_like(t) for t in out))
    kw = qwen_inputs(1, 4, 8)
    kw["hidden_states"] = clustered_tokens(2)
    return model, kw, {"blocks": {"transformer_blocks": range(3)}}


@pytest.mark.parametrize("form", A.FORMS)
@pytest.mark.parametrize("build", [_sd3_duplicates, _ltx_duplicates, _qwen_duplicates], ids=["sd3", "ltx", "qwenimage"])
def test_bias_outside_the_mask_argument_is_exact_on_duplicate_tokens(build, form, monkeypatch):
    # as the Flux test above: two 4x4 tiles of one token 9 times and 7 others, so that the
    # merged attention with the log(mass) bias computes the unmerged one, on the paths
    # where the bias does not ride in the processor's mask argument
    force(monkeypatch, form)
    model, kw, options = build()
    ref = run(model, **kw)
    toma.apply_toma(model, ratio=0.5, tile_size=4, proportional_attention=True, **options)
    exact = run(model, **kw)
    toma.apply_toma(model, ratio=0.5, tile_size=4, proportional_attention=False, **options)
    plain = run(model, **kw)
    toma.remove_toma(model)
    torch.testing.assert_close(exact, ref, rtol=1e-4, atol=1e-5)
    assert (plain - ref).abs().max() > 1e-3


def test_a_processor_toma_cannot_reach_turns_the_bias_off_with_a_warning():
    # SD3's bias runs in place of JointAttnProcessor2_0 only, and Qwen-Image's reaches the
    # dispatch of the module toma wrapped at apply: a processor whose call is defined
    # elsewhere (here in this module) may look up another dispatch, which would drop it
    # silently. A subclass that inherits diffusers' call keeps the bias
    from diffusers.models.attention_processor import JointAttnProcessor2_0
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    class Joint(JointAttnProcessor2_0):
        pass

    class Qwen(QwenDoubleStreamAttnProcessor2_0):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    class Inherits(QwenDoubleStreamAttnProcessor2_0):
        pass

    make, inputs, options = FAMILIES["qwenimage"]
    model = make()
    toma.apply_toma(model, ratio=0.5, proportional_attention=True, **options)
    biased = run(model, **inputs())
    model.set_attn_processor(Inherits())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(run(model, **inputs()), biased)
    toma.remove_toma(model)
    for name, processor, why in (
        ("sd3", Joint(), "in place of JointAttnProcessor2_0 and FusedJointAttnProcessor2_0 only"),
        ("qwenimage", Qwen(), "whose dispatch toma did not wrap"),
    ):
        make, inputs, options = FAMILIES[name]
        model = make()
        toma.apply_toma(model, ratio=0.5, proportional_attention=True, **options)
        biased = run(model, **inputs())
        model.set_attn_processor(processor)
        with pytest.warns(UserWarning, match=f"proportional attention is off in .*{why}"):
            plain = run(model, **inputs())
        toma.remove_toma(model)
        toma.apply_toma(model, ratio=0.5, proportional_attention=False, **options)
        torch.testing.assert_close(plain, run(model, **inputs()), rtol=0, atol=0)
        assert (plain - biased).abs().max() > 1e-3
        toma.remove_toma(model)


def test_hunyuanvideo15_takes_the_bias_in_the_mask_form_only(monkeypatch):
    # its processor builds a (B, 1, S, S) boolean mask, a row per query, which only the
    # float-mask form can carry beside the bias: the CPU's rule (the mask) applies it; the
    # key channel runs without it, said once
    f = TINY["hunyuanvideo15"]
    model, kw = f.make(), f.inputs(2)
    out = {}
    for proportional in (False, True):
        toma.apply_toma(model, ratio=0.5, proportional_attention=proportional, **f.options)
        out[proportional] = run(model, **kw)
        toma.remove_toma(model)
    force(monkeypatch, A.KEY_CHANNEL)
    monkeypatch.setattr(A, "_warned", set())  # said once per process: not by an earlier test
    toma.apply_toma(model, ratio=0.5, proportional_attention=True, **f.options)
    with pytest.warns(UserWarning, match="a row per query"):
        channel = run(model, **kw)
    toma.remove_toma(model)
    assert torch.equal(channel, out[False])
    assert (out[True] - out[False]).abs().max() > 1e-3 * float(out[True].abs().max())
