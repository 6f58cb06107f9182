"""Proportional attention through diffusers' dispatched attention (toma/adapters/attention.py):
each backend's rule, against the float mask on the same inputs."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch
from diffusers.models import attention_dispatch as ad

from toma.adapters import attention as A
from toma.core import proportional as P


def inputs(dtype=torch.float32, per_sample=True, text=3, seed=0):
    """``(B, S, H, D)`` queries, keys, values and a KeyBias: masses of 1, 2 or 16 behind
    ``text`` text keys of log mass 0."""
    g = torch.Generator().manual_seed(seed)
    b, s, h, d = 2, 19, 2, 16
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(dtype) for _ in range(3))
    masses = torch.tensor([1.0, 2.0, 16.0])[torch.randint(0, 3, (b if per_sample else 1, s - text), generator=g)]
    return q, k, v, A.KeyBias(P.with_text_keys(masses.log(), before=text).to(dtype))


def reference(q, k, v, bias):
    """float64 math SDPA with the float mask on the same (rounded) inputs."""
    return ad.dispatch_attention_fn(
        q.double(), k.double(), v.double(), attn_mask=bias.mask(torch.float64), backend="_native_math"
    )


# fp32: logits of a few units over 19 keys; the forms differ from the float64 reference
# by fp32 rounding of the logits and of a convex mix of values |v| < 5: well under 1e-5
FP32 = dict(atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["native", "_native_math", "_native_flash", "flex"])
@pytest.mark.parametrize("per_sample", [True, False])
def test_each_cpu_backend_applies_the_bias(backend, per_sample, monkeypatch):
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(A, "_compiled_flex", flex_attention)  # eager flex: the same maths, no 20 s compile
    q, k, v, bias = inputs(per_sample=per_sample)
    dispatch = A.biased_dispatch(ad.dispatch_attention_fn)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        got = dispatch(q, k, v, attn_mask=bias, backend=backend)
    want = reference(q, k, v, bias)
    torch.testing.assert_close(got.double(), want, **FP32)
    plain = ad.dispatch_attention_fn(q.double(), k.double(), v.double(), backend="_native_math")
    assert (plain - want).abs().max() > 1e-2  # the bias matters here


def test_native_flash_runs_the_key_channel_where_a_mask_is_refused():
    q, k, v, bias = inputs()
    with pytest.raises(ValueError, match="attn_mask"):  # diffusers' flash takes no mask
        ad.dispatch_attention_fn(q, k, v, attn_mask=bias.mask(q.dtype), backend="_native_flash")
    assert A.rule("_native_flash", "cpu", q.dtype)[0] == A.KEY_CHANNEL
    got = A.biased_dispatch(ad.dispatch_attention_fn)(q, k, v, attn_mask=bias, backend="_native_flash")
    torch.testing.assert_close(got.double(), reference(q, k, v, bias), **FP32)


@pytest.mark.parametrize("form", A.FORMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_forms_in_low_precision(form, dtype, monkeypatch):
    # each form forced onto the native backend, against the float mask in the same dtype;
    # the tolerance is the rounding bound of tests/core/test_proportional_paths.py
    from tests.cases import tolerance
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(A, "_compiled_flex", flex_attention)
    monkeypatch.setitem(A.RULES, "native", {"*": (form, "forced by the test")})
    q, k, v, bias = inputs(dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        got = A.biased_dispatch(ad.dispatch_attention_fn)(q, k, v, attn_mask=bias, backend="native")
    want = ad.dispatch_attention_fn(q, k, v, attn_mask=bias.mask(dtype), backend="native")
    assert got.dtype == dtype
    tol = tolerance(q, k, v, bias.log_mass, "bshd", q.shape[-1] ** -0.5)
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=0)


def test_positional_mask_and_scale_pass_through():
    q, k, v, bias = inputs()
    dispatch = A.biased_dispatch(ad.dispatch_attention_fn)
    got = dispatch(q, k, v, bias, 0.0, False, 0.2, backend="_native_flash")
    want = ad.dispatch_attention_fn(
        q.double(), k.double(), v.double(), bias.mask(torch.float64), 0.0, False, 0.2, backend="_native_math"
    )
    torch.testing.assert_close(got.double(), want, **FP32)


def test_other_masks_and_calls_are_untouched():
    q, k, v, bias = inputs()
    seen = []

    def real(*args, **kwargs):
        seen.append((args, kwargs))
        return args[0]

    mask = bias.mask(q.dtype)
    A.biased_dispatch(real)(q, k, v, mask, backend="native")
    A.biased_dispatch(real)(q, k, v, attn_mask=None, backend="flash")
    assert seen[0] == ((q, k, v, mask), {"backend": "native"})
    assert seen[1] == ((q, k, v), {"attn_mask": None, "backend": "flash"})


def test_sage_runs_without_the_bias_and_says_so_once(monkeypatch):
    q, k, v, bias = inputs()
    seen = []

    def real(query, key, value, **kwargs):  # stands for the sage kernel, which this CPU lacks
        seen.append(kwargs)
        return query

    monkeypatch.setattr(A, "_warned", set())
    dispatch = A.biased_dispatch(real)
    with pytest.warns(UserWarning, match="proportional attention is off on the 'sage' attention backend: quantizes K"):
        dispatch(q, k, v, attn_mask=bias, backend="sage")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch(q, k, v, attn_mask=bias, backend="sage")
    assert seen == [{"attn_mask": None, "backend": "sage"}] * 2  # no bias, no widened tensors
    assert A.rule("_sage_qk_int8_pv_fp16_triton", "cuda", torch.float16)[0] is None
    assert A.rule("some_future_backend", "cuda", torch.float16)[0] is None


def test_a_failing_form_falls_back_once(monkeypatch):
    q, k, v, bias = inputs()
    calls = []

    def real(query, key, value, **kwargs):
        calls.append(query.shape[-1])
        if query.shape[-1] != 16:
            raise RuntimeError("head dim 24 is not supported")
        return query

    monkeypatch.setattr(A, "_warned", set())
    with pytest.warns(UserWarning, match="key_channel failed on the 'flash' backend .*head dim 24.*float mask"):
        out = A.biased_dispatch(real)(q, k, v, attn_mask=bias, backend="flash")
    # the bias is kept: the calls take it as a float mask in torch's SDPA (fp32 rounding of
    # a softmax over 19 keys), where they once ran without it
    assert calls == [24]
    torch.testing.assert_close(out.double(), reference(q, k, v, bias), rtol=0, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        A.biased_dispatch(real)(q, k, v, attn_mask=bias, backend="flash")  # said once


def test_install_wraps_once_and_the_last_user_restores(monkeypatch):
    module = types.ModuleType("toma_test_processor_module")
    real = ad.dispatch_attention_fn
    module.dispatch_attention_fn = real
    monkeypatch.setitem(sys.modules, module.__name__, module)
    a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    assert A.install(module.__name__, [a]) and A.install(module.__name__, [b])
    wrapped = module.dispatch_attention_fn
    assert wrapped is not real and wrapped._toma_real is real
    A.uninstall(module.__name__, [a])
    assert module.dispatch_attention_fn is wrapped  # b's patch still uses it
    A.uninstall(module.__name__, [b])
    assert module.dispatch_attention_fn is real
    # replaced behind toma's back (a test's monkeypatch, another library): wrapped again
    A.install(module.__name__, [a])
    other = lambda *args, **kwargs: None  # noqa: E731
    module.dispatch_attention_fn = other
    A.install(module.__name__, [b])
    assert module.dispatch_attention_fn._toma_real is other
    A.uninstall(module.__name__, [a, b])
    assert module.dispatch_attention_fn is other
    assert not A.install("toma_no_such_module", [a])


def test_key_bias_slices_per_sample():
    bias = A.KeyBias(torch.arange(6.0).reshape(2, 3))
    assert torch.equal(bias.batch_slice(1, 2).log_mass, torch.tensor([[3.0, 4.0, 5.0]]))
    shared = A.KeyBias(torch.zeros(1, 3))
    assert torch.equal(shared.batch_slice(1, 2).log_mass, shared.log_mass)
    keep = torch.tensor([True, False])[:, None, None, None].expand(2, 1, 1, 3)
    folded = shared.with_model_mask(keep).batch_slice(1, 2)
    assert torch.equal(folded.model_mask, keep[1:]) and torch.equal(folded.log_mass, torch.full((1, 3), -torch.inf))


def test_model_mask_folds_into_the_bias_and_text_after_pads():
    # HunyuanVideo: [video; text] keys, the text after the merged video keys with its padding
    # masked by the model; the folded bias equals the float mask of both, on every form
    q, k, v, _ = inputs(text=0)
    video = 12
    log_mass = torch.rand(2, video, generator=torch.Generator().manual_seed(7))
    keep = torch.ones(2, 1, 1, k.shape[1], dtype=torch.bool)
    keep[1, ..., -3:] = False
    bias = A.key_bias_text_after(log_mass, 2, 2).with_model_mask(keep)
    want_mask = torch.cat([log_mass, torch.zeros(2, k.shape[1] - video)], 1)
    want_mask = want_mask.masked_fill(~keep[:, 0, 0], float("-inf"))[:, None, None, :]
    assert torch.equal(bias.mask(), want_mask)
    want = ad.dispatch_attention_fn(
        q.double(), k.double(), v.double(), attn_mask=want_mask.double(), backend="_native_math"
    )
    for backend in ("native", "_native_flash"):
        got = A.biased_dispatch(ad.dispatch_attention_fn)(q, k, v, attn_mask=bias, backend=backend)
        torch.testing.assert_close(got.double(), want, **FP32)
    # no model mask: the text keys are padded with log mass 0 at the call
    plain = A.key_bias_text_after(log_mass, 2, 2)
    assert torch.equal(plain.mask(keys=k.shape[1]), torch.cat([log_mass, torch.zeros(2, 7)], 1)[:, None, None, :])
    with pytest.raises(ValueError, match="a key bias over 12 keys met an attention call over 19 keys"):
        A.biased_dispatch(ad.dispatch_attention_fn)(q, k, v, attn_mask=A.key_bias(log_mass, 2, 2), backend="native")
    # where no form is exact the call keeps the model's own mask
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # said once: test_sage_runs_without_the_bias_and_says_so_once
        A.biased_dispatch(lambda q_, k_, v_, **kw: seen.append(kw["attn_mask"]) or q_)(
            q, k, v, attn_mask=bias, backend="sage"
        )
    assert seen[0] is keep
    # a mask per head has no place in a bias per key (per-query masks: test_joint_masks)
    with pytest.raises(ValueError, match=r"cannot fold an attention mask of shape \(2, 2, 1, 19\)"):
        plain.with_model_mask(torch.ones(2, 2, 1, 19, dtype=torch.bool))
