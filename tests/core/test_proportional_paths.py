"""Proportional attention's three exact forms (toma/core/proportional.py): the key channel
and the FlexAttention score_mod against the float mask, and all three against unmerged
attention over duplicated keys."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from toma.core import proportional as P
from tests.cases import tolerance

HEAD_DIM = 16


def sdpa(q, k, v, layout, mask=None, scale=None):
    """torch's SDPA in ``layout`` (SDPA itself takes ``bhsd``)."""
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out if layout == "bhsd" else out.transpose(1, 2)


def with_mask(q, k, v, log_mass, layout, scale=None):
    return sdpa(q, k, v, layout, P.additive_mask(log_mass, q.dtype), scale)


def with_key_channel(q, k, v, log_mass, layout, scale=None):
    attend = lambda q_, k_, v_, scale: sdpa(q_, k_, v_, layout, scale=scale)  # noqa: E731
    return P.key_channel_attention(attend, q, k, v, log_mass, scale, layout)


def with_flex(q, k, v, log_mass, layout, scale=None):
    # eager flex materialises the scores: the maths of the compiled kernel, slowly
    return P.flex_attention_with_bias(q, k, v, log_mass, scale, layout)


PATHS = {"key channel": with_key_channel, "flex": with_flex}


def to_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``(B, H, S, D)`` as ``layout``."""
    return t if layout == "bhsd" else t.transpose(1, 2).contiguous()


def text_split(text: str, count: int) -> tuple[int, int]:
    return (count, 0) if text == "before" else (0, count)


@pytest.fixture(autouse=True)
def _quiet_eager_flex():
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


# --- exactness on duplicated keys ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", P.LAYOUTS)
@pytest.mark.parametrize("text", ["before", "after"])
@pytest.mark.parametrize("per_sample", [True, False])
def test_bias_on_merged_keys_equals_attention_over_their_copies(layout, text, per_sample):
    # K distinct image keys (and values), key j stands for m_j identical copies; text keys
    # are single. softmax(s + log m) over the K keys is softmax over the copies exactly, so
    # in float64 the paths differ from unmerged attention only by rounding: each output is
    # a convex mix of values |v| < 4, summed over < 100 terms, so 1e-12 is ~100x that.
    g = torch.Generator().manual_seed(1)
    batch, heads, queries, image, texts = 2, 3, 11, 9, 4
    before, after = text_split(text, texts)
    q = torch.randn(batch, heads, queries, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(batch, heads, before + image + after, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(batch, heads, before + image + after, HEAD_DIM, generator=g, dtype=torch.float64)
    masses = torch.randint(1, 7, (batch if per_sample else 1, image), generator=g)
    masses[:, 0] = 5  # at least one merged key: the bias must matter
    log_mass = P.with_text_keys(masses.double().log(), before, after)
    counts = P.with_text_keys(masses, before, after)  # text keys: one copy (log 1 = 0)
    counts[:, :before] = 1
    if after:
        counts[:, -after:] = 1
    full = []
    for b in range(batch):
        reps = counts[b if per_sample else 0]
        full.append(
            sdpa(
                *(
                    to_layout(t[b : b + 1], layout)
                    for t in (q, k.repeat_interleave(reps, 2), v.repeat_interleave(reps, 2))
                ),
                layout,
            )
        )
    full = torch.cat(full)
    qs, ks, vs = (to_layout(t, layout) for t in (q, k, v))
    for name, path in {"mask": with_mask, **PATHS}.items():
        torch.testing.assert_close(path(qs, ks, vs, log_mass, layout), full, atol=1e-12, rtol=0, msg=name)
    plain = sdpa(qs, ks, vs, layout)
    assert (plain - full).abs().max() > 1e-2  # without the bias merged keys are under-weighted


# --- each path against the mask, per dtype ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", P.LAYOUTS)
@pytest.mark.parametrize("per_sample", [True, False])
@pytest.mark.parametrize("text", ["before", "after"])
@pytest.mark.parametrize("path", list(PATHS))
def test_path_equals_the_mask(dtype, layout, per_sample, text, path):
    g = torch.Generator().manual_seed(2)
    batch, heads, queries, image, texts = 2, 2, 24, 20, 4
    before, after = text_split(text, texts)
    keys = before + image + after
    scale = 0.3  # not 1/sqrt(16): a path that let the scale follow its widened head dim would show
    # logits of about a unit, values in [-1, 1], masses of 1, 2 or 16, and the heavy keys'
    # first value channel +1 against -1 for the others: the bias moves that channel of the
    # output far more than rounding can (checked below)
    q = torch.randn(batch, heads, queries, HEAD_DIM, generator=g) * 0.5
    k = torch.randn(batch, heads, keys, HEAD_DIM, generator=g) * 0.5
    v = torch.rand(batch, heads, keys, HEAD_DIM, generator=g) * 2 - 1
    masses = torch.tensor([1.0, 2.0, 16.0])[torch.randint(0, 3, (batch if per_sample else 1, image), generator=g)]
    heavy = P.with_text_keys(masses, before, after) == 16
    v[..., 0] = torch.where(heavy[:, None, :], 1.0, -1.0)
    q, k, v = (to_layout(t, layout).to(dtype) for t in (q, k, v))
    log_mass = P.with_text_keys(masses.log(), before, after).to(dtype)  # as Plan.log_mass: the activations' dtype
    want = with_mask(q, k, v, log_mass, layout, scale)
    got = PATHS[path](q, k, v, log_mass, layout, scale)
    assert got.dtype == dtype and got.shape == want.shape
    tol = tolerance(q, k, v, log_mass, layout, scale)
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=0)
    # the bias matters by more than the tolerance, so a path that dropped it would fail
    assert (sdpa(q, k, v, layout, scale=scale).double() - want.double()).abs().max() > 2 * tol


def test_default_scale_is_the_original_head_dims():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 10, HEAD_DIM, generator=g) for _ in range(3))
    log_mass = torch.rand(1, 10, generator=g)
    qk, kk, vk, scale = P.key_channel(q, k, v, log_mass)
    assert scale == 1 / math.sqrt(HEAD_DIM) and qk.shape[-1] == kk.shape[-1] == vk.shape[-1] == 24
    # the widened tensors under SDPA's default scale (1/sqrt(24)) would be another attention
    torch.testing.assert_close(with_key_channel(q, k, v, log_mass, "bhsd"), with_mask(q, k, v, log_mass, "bhsd"))
    assert P.key_channel(q, k, v, log_mass, multiple=1)[0].shape[-1] == HEAD_DIM + 1


def test_values_of_another_head_dim_stay_as_they_are():
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, 2, 10, HEAD_DIM, generator=g) for _ in range(2))
    v = torch.randn(1, 2, 10, 8, generator=g)
    log_mass = torch.rand(1, 10, generator=g)
    _, _, vk, _ = P.key_channel(q, k, v, log_mass)
    assert vk is v
    torch.testing.assert_close(with_key_channel(q, k, v, log_mass, "bhsd"), with_mask(q, k, v, log_mass, "bhsd"))


def test_paths_under_torch_compile():
    # one small fp32 case through inductor: the key channel's concatenations and flex's
    # score_mod (which compiles into the fused kernel) trace in one graph and stay exact;
    # fp32 rounding as in test_path_equals_the_mask
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 32, HEAD_DIM, generator=g) for _ in range(3))
    log_mass = P.with_text_keys(torch.randint(1, 9, (2, 28), generator=g).float().log(), before=4)

    def both(q, k, v, log_mass):
        return (with_key_channel(q, k, v, log_mass, "bhsd", 0.25), with_flex(q, k, v, log_mass, "bhsd", 0.25))

    compiled = torch.compile(both, fullgraph=True)
    want = with_mask(q, k, v, log_mass, "bhsd", 0.25)
    tol = tolerance(q, k, v, log_mass, "bhsd", 0.25)
    for got in compiled(q, k, v, log_mass):
        torch.testing.assert_close(got, want, atol=tol, rtol=0)


def test_bad_inputs_are_named():
    q = torch.zeros(1, 2, 10, HEAD_DIM)
    with pytest.raises(ValueError, match="layout must be one of bhsd, bshd"):
        P.key_channel(q, q, q, torch.zeros(1, 10), layout="sbhd")
    with pytest.raises(ValueError, match=r"log_mass must be \(1 or 1, 10\)"):
        P.key_channel(q, q, q, torch.zeros(1, 9))
    with pytest.raises(ValueError, match="scale must be > 0"):
        P.key_channel(q, q, q, torch.zeros(1, 10), scale=0.0)
    with pytest.raises(ValueError, match="multiple must be >= 1"):
        P.key_channel(q, q, q, torch.zeros(1, 10), multiple=0)
    with pytest.raises(ValueError, match="before and after must be >= 0"):
        P.with_text_keys(torch.zeros(1, 10), before=-1)
    with pytest.raises(ValueError, match=r"log_mass must be \(Bp, Sk\)"):
        P.bias_score_mod(torch.zeros(10))


@pytest.mark.parametrize("layout", P.LAYOUTS)
@pytest.mark.parametrize("path", list(PATHS))
def test_masked_out_keys_get_no_weight(layout, path):
    # text padding folded into the bias as -inf: every form then equals attention over the
    # kept keys alone (float64, as the duplicate-key test), with no NaN from the -inf
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 2, 12, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(3))
    log_mass = P.with_text_keys(torch.rand(2, 8, generator=g, dtype=torch.float64), after=4)
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[0, -2:] = False  # sample 0 pads its last two text keys
    biased = P.masked_out(log_mass, keep)
    qs, ks, vs = (to_layout(t, layout) for t in (q, k, v))
    got = PATHS[path](qs, ks, vs, biased, layout)
    for b, kept in ((0, 10), (1, 12)):
        one = lambda t: to_layout(t[b : b + 1, :, :kept], layout)  # noqa: E731
        want = with_mask(to_layout(q[b : b + 1], layout), one(k), one(v), log_mass[b : b + 1, :kept], layout)
        torch.testing.assert_close(got[b : b + 1], want, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match=r"keep must be a bool \(Bk, 12\) mask"):
        P.masked_out(log_mass, keep.float())
