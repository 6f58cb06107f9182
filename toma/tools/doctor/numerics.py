"""The doctor's comparisons and their tolerances, each bound derived from how the dtypes round.

Notation. ``eps`` is the spacing of a dtype's numbers in [1, 2): 2^-10 for float16, 2^-7
for bfloat16, 2^-23 for float32. Rounding to nearest stores ``v`` within ``eps/2 * |v|``
(the spacing at ``v`` is at most ``eps * |v|``); two values rounded independently from
nearby float32 results differ by at most ``eps * |v|`` plus the results' own difference.
``EPS32`` is float32's eps: every float32 addition is off by at most one float32 spacing
of its result, which covers truncating adders (tensor cores) as well as rounding ones.

The bounds are worst cases (every rounding error in the same direction), so a correct
kernel stays far inside them; an indexing or stride bug is off by the size of the values
themselves, orders of magnitude beyond them. Each comparison reports how much of its
tolerance the worst element used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23, torch.float64: 2.0**-52}
EPS32 = 2.0**-23
# the spacing of the subnormals: below the normal range the relative bound gives way to this
TINY = {torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133, torch.float32: 2.0**-149, torch.float64: 2.0**-1074}


def out_eps(dtype: torch.dtype) -> float:
    """``eps`` of values stored in ``dtype`` (0 for float32 results compared as computed: they
    are not rounded again)."""
    return 0.0 if dtype == torch.float32 else EPS[dtype]


@dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol + rtol * |expected|``, elementwise; ``why`` says where it comes from."""

    atol: float
    rtol: float
    why: str


@dataclass(frozen=True)
class Comparison:
    """The worst element of one comparison: its absolute difference and the share of its tolerance used."""

    max_abs: float
    used: float  # max over elements of |difference| / tolerance: <= 1 passes
    ok: bool
    detail: str

    def as_dict(self) -> dict:
        """JSON-ready."""
        return {"max_abs": self.max_abs, "tolerance_used": self.used, "ok": self.ok, "detail": self.detail}


def compare(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> Comparison:
    """Compare elementwise (in float64 where either side is float64, else in float32, where
    the difference of two fp16/bf16 values is exact and that of two float32 values within
    2^-24 of itself); non-finite values, or a shape mismatch, fail. Runs in chunks: whole
    copies of activations-sized tensors cost more in memory traffic than the arithmetic."""
    if actual.shape != expected.shape:
        return Comparison(math.inf, math.inf, False, f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.numel() == 0:
        return Comparison(0.0, 0.0, True, "empty")
    wide = torch.float64 in (actual.dtype, expected.dtype)
    work = torch.float64 if wide else torch.float32
    flat_a, flat_e = actual.detach().reshape(-1), expected.detach().reshape(-1)
    used, max_abs = 0.0, 0.0
    for start in range(0, flat_a.numel(), _CHUNK):
        e = flat_e[start : start + _CHUNK].to(work)  # may be a view of ``expected``: not written to
        diff = (flat_a[start : start + _CHUNK].to(work) - e).abs_()
        max_abs = max(max_abs, float(diff.max()))
        used = max(used, float(diff.div_(e.abs().mul_(tol.rtol).add_(tol.atol)).max()))
    if not (math.isfinite(used) and math.isfinite(max_abs)):
        # the references are finite by construction: a NaN or inf here is the result's
        bad = int((~torch.isfinite(flat_a)).sum())
        return Comparison(math.inf, math.inf, False, f"{bad} non-finite values (the reference is finite)")
    return Comparison(max_abs, used, used <= 1.0, f"max |err| {max_abs:.2e} ({used:.2g} of its bound)")


_CHUNK = 1 << 20


def convex_mix(dtype: torch.dtype, terms: int, scale: float, against_exact: bool = False) -> Tolerance:
    """Two float32-accumulated computations of ``sum_j w_j x_j`` (``w >= 0`` summing to 1 over
    ``terms`` terms: a merge or an unmerge, ``|x| <= scale``), each rounded once to ``dtype``.

    Each sum: the products are exact for fp16/bf16 inputs (11 and 8 significant bits fit
    float32's 24) and within half a float32 spacing for fp32; the ``terms`` additions add
    at most one float32 spacing of a partial sum each, and partial sums stay below
    ``sum |w_j x_j| <= scale * (1 + terms * eps / 2)`` (the weights are stored in
    ``dtype``, so they sum to 1 within ``terms * eps / 2``). Rounding the result to
    ``dtype`` adds ``eps / 2`` of it. Two such computations: twice the accumulation and
    ``eps`` relative; against the exact float64 value (``against_exact``): once, and ``eps / 2``.
    """
    eps = out_eps(dtype)
    bound = scale * (1.0 + terms * EPS[dtype] / 2)
    acc = (terms + 1) * EPS32 * bound
    sides = 1 if against_exact else 2
    return Tolerance(
        atol=sides * acc * (1 + eps) + TINY[dtype],
        rtol=(eps / 2 if against_exact else eps) * (1 + eps),
        why=f"{sides} x ({terms}+1) float32 spacings of {bound:.3g}"
        + (f" + {sides}/2 {dtype_name(dtype)} eps" if eps else ""),
    )


def mix_plus_residual(
    dtype: torch.dtype, terms: int, scale: float, residual_scale: float, against_exact: bool = False
) -> Tolerance:
    """``residual + sum_j a_j y_j``: the fused kernel (and the tile-order ``baddbmm``) rounds
    the float32 sum once; the raster torch path rounds the unmerged value to ``dtype``
    first (``eps / 2`` of up to ``scale``) and the sum again. The accumulation runs over
    ``terms + 1`` terms bounded by ``scale + residual_scale``; the two paths differ by both
    accumulations, the extra intermediate rounding and ``eps`` of the result."""
    eps = out_eps(dtype)
    bound = scale * (1.0 + terms * EPS[dtype] / 2) + residual_scale
    acc = (terms + 2) * EPS32 * bound
    sides = 1 if against_exact else 2
    return Tolerance(
        atol=sides * acc * (1 + eps) + eps / 2 * scale * (1 + eps) + TINY[dtype],
        rtol=(eps / 2 if against_exact else eps) * (1 + eps),
        why=f"{sides} x ({terms}+2) float32 spacings of {bound:.3g} + {dtype_name(dtype)} eps/2 of the unmerged values"
        + (f" + {sides}/2 eps" if eps else ""),
    )


def similarity(channels: int) -> Tolerance:
    """Cosine similarities of the plan kernel (a float32 Gram matrix, divided by the norms
    after) against the torch path's (rows normalised first, then multiplied).

    A float32 dot product of ``C`` terms is off by ``(C + 1)`` float32 spacings of
    ``sum |x_i x_j| <= |x_i| |x_j|`` (Cauchy-Schwarz), so relative to the result's scale:
    the Gram entry by ``(C + 1) EPS32``; each norm by half that (a square root halves a
    relative error) plus one correctly rounded square root; the divisions by one rounding
    each. Both paths: ``2 * (2 C + 4) EPS32`` on values in [-1, 1]."""
    return Tolerance(atol=(4 * channels + 8) * EPS32, rtol=0.0, why=f"2 x (2*{channels}+4) float32 spacings")


def assignment_rel(temperature: float, slots: int) -> float:
    """Relative difference of two float32 soft assignments ``softmax_k(l / T)`` on the same
    similarities ``l`` in [-1, 1] (see :func:`assignment`), before any rounding to a dtype.

    The exponent's argument: the kernel shifts then divides (``(l - max) / T``), torch
    divides then shifts; each rounding is at most half a spacing of a value up to ``2 / T``,
    so the arguments differ by at most ``7 * 2^-24 / T``; ``exp`` adds up to 2 spacings on
    each side (GPU ``exp`` is approximate). A ratio of exponentials: twice that, plus the
    normaliser's ``k`` additions and the division on each side."""
    if temperature == 0:
        return 0.0
    arg = 7 * 2.0**-24 / temperature + 4 * EPS32
    return 2 * math.expm1(arg) + (2 * slots + 2) * EPS32


def assignment(dtype: torch.dtype, temperature: float, slots: int) -> Tolerance:
    """Assignment weights in [0, 1] (stored in ``dtype``): :func:`assignment_rel` as an absolute
    bound, plus the two roundings to ``dtype``. A hard assignment (``temperature == 0``) is
    the same one-hot on the same similarities: exact."""
    if temperature == 0:
        return Tolerance(0.0, 0.0, "hard assignment: exact")
    rel = assignment_rel(temperature, slots)
    eps = out_eps(dtype)
    why = f"softmax at T={temperature:g}: {rel:.2g}" + (" + eps" if eps else "")
    return Tolerance(atol=rel + TINY[dtype], rtol=eps, why=why)


def merge_weights(dtype: torch.dtype, temperature: float, slots: int, tile: int) -> Tolerance:
    """``a / sum(a)`` in [0, 1]: the assignment's relative error twice (numerator and the sum
    of up to ``tile`` of them), the sum's additions and the division, then ``dtype``."""
    if temperature == 0:
        rel = (tile + 1) * EPS32 * 2
    else:
        rel = 2 * assignment_rel(temperature, slots) + 2 * (tile + 1) * EPS32
    eps = out_eps(dtype)
    return Tolerance(atol=rel + TINY[dtype], rtol=eps, why=f"{rel:.2g}" + (" + eps" if eps else ""))


def mass(temperature: float, slots: int, tile: int) -> Tolerance:
    """Float32 masses (sums of up to ``tile`` assignment weights): relative to themselves."""
    rel = assignment_rel(temperature, slots) + 2 * (tile + 1) * EPS32
    return Tolerance(atol=2.0**-126, rtol=rel, why=f"relative {rel:.2g}")


def log_of(dtype: torch.dtype) -> Tolerance:
    """The kernel's log of its own masses against torch's: a GPU ``log`` is approximate
    (within 2^-21 absolute for arguments near 1, a few spacings elsewhere), then both are
    rounded to ``dtype``."""
    return Tolerance(atol=2.0**-20, rtol=out_eps(dtype) + 4 * EPS32, why="approximate log + eps")


def row_sums(dtype: torch.dtype, terms: int) -> Tolerance:
    """Sums of ``terms`` weights that should be 1: each weight was rounded to ``dtype``
    (``eps / 2`` of it, so ``eps / 2`` of their sum of 1) after float32 arithmetic, and the
    sum here is float64 (exact)."""
    return Tolerance(atol=EPS[dtype] / 2 + (terms + 2) * EPS32, rtol=0.0, why=f"{dtype_name(dtype)} eps/2")


def attention(
    dtype: torch.dtype, head_dim: int, keys: int, logit_bound: float, value_bound: float, quantized: bool = False
) -> Tolerance:
    """An attention backend's output ``o = sum_j p_j v_j``, ``p = softmax(s)``, against float32
    math SDPA on the same ``dtype`` inputs.

    * logits ``s``: float32 dots of ``head_dim`` products, each side off by ``(head_dim + 1)``
      float32 spacings of ``logit_bound`` (``max|q| max|k| * scale`` bounds ``sum |q_i k_i| * scale``),
      plus ``eps / 2`` of ``logit_bound`` where a backend stores them in ``dtype`` (torch's
      math kernel does); int8-quantized QK (SageAttention): 2^-7 of it (two 8-bit roundings
      to the block's maximum);
    * a softmax moves by at most ``expm1(2 * ds)`` relative when every logit moves by ``ds``
      (shifting all logits changes nothing), so ``o`` by that times ``value_bound``;
    * ``p`` stored in ``dtype`` before ``P V`` (flash kernels): ``eps / 2`` of ``value_bound``
      (fp8 P for SageAttention: 2^-4); the ``keys`` float32 additions of ``P V``, on each side;
    * the output rounded to ``dtype``: ``eps / 2`` relative (here both sides once: the
      reference is float32)."""
    eps = EPS[dtype] if dtype != torch.float32 else EPS32
    # float32 arithmetic on both sides (the reference's logits are float32 too)
    ds = 2 * (head_dim + 1) * EPS32 * logit_bound + (eps / 2 + EPS32 / 2) * logit_bound
    p_round = eps / 2
    if quantized:
        ds += 2.0**-7 * logit_bound
        p_round = 2.0**-4
    atol = (math.expm1(2 * ds) + p_round + 2 * (keys + 1) * EPS32) * value_bound
    return Tolerance(
        atol=atol + TINY[dtype],
        rtol=eps / 2 + EPS32,
        why=f"logits within {ds:.2g} of {logit_bound:.3g}, P and output in {dtype_name(dtype)}",
    )


def dtype_name(dtype: torch.dtype) -> str:
    """``fp16``, ``bf16``, ``fp32`` (what the doctor prints)."""
    names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
    return names.get(dtype, str(dtype))
