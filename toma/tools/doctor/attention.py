"""The doctor's attention checks: a merged attention against the unmerged one (timed), and
every attention backend diffusers offers here on merged tokens, against torch's SDPA."""

from __future__ import annotations

import math
import re
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from toma.config import ToMAConfig
from toma.core.plan import Plan
from toma.adapters.state import PlanCache
from toma.tools.doctor import numerics as nm
from toma.tools.doctor.inputs import smooth_tokens
from toma.tools.doctor.merge_checks import strict_matmul
from toma.tools.doctor.report import Outcome, Report, Result, first_line


@dataclass
class AttentionSetup:
    """Sizes of the attention checks."""

    device: torch.device
    h: int
    w: int
    heads: int
    head_dim: int
    batch: int
    dtype: torch.dtype
    ratio: float
    tile: int
    repeats: int
    seed: int

    @property
    def tokens(self) -> int:
        """N."""
        return self.h * self.w

    @property
    def width(self) -> int:
        """Channels: heads x head_dim."""
        return self.heads * self.head_dim

    def describe(self) -> str:
        """What the attention checks run on."""
        return (
            f"{self.h}x{self.w} = {self.tokens} tokens, {self.heads} heads of {self.head_dim}, batch {self.batch}, "
            f"{nm.dtype_name(self.dtype)}, ratio {self.ratio:g}, median of {self.repeats}"
        )


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (timings must not stop at a launch)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], repeats: int, device: torch.device) -> tuple[float, Any]:
    """Median seconds of ``repeats`` calls of ``fn`` after one untimed call (compiles,
    allocator warm-up), and the last result."""
    out = fn()
    sync(device)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


class MergedAttention:
    """Query, key and value tokens with image-like structure, the plan toma would use on
    them, and the unmerged and merged attentions (torch's SDPA, heads of ``head_dim``)."""

    def __init__(self, a: AttentionSetup) -> None:
        self.a = a
        g = torch.Generator().manual_seed(a.seed * 1000 + 21)
        d = a.width
        fields = smooth_tokens(a.batch, a.h, a.w, 4 * d, g)
        base, noise_q, noise_k, v = fields.split(d, -1)
        # queries and keys share the hidden states' structure (so a token attends most to
        # tokens like it, as image self-attention does); the plan is built on those states
        q, k = base + 0.5 * noise_q, base + 0.5 * noise_k
        self.hidden = base.to(a.device, a.dtype)
        self.qkv = torch.cat([q, k, v], -1).to(a.device, a.dtype)
        self.config = ToMAConfig(ratio=a.ratio, tile_size=a.tile)

    def plan(self) -> Plan:
        """A fresh plan, as the first merged block of a denoising step computes it."""
        cache = PlanCache(self.config)
        cache.begin_forward((self.a.h, self.a.w), None)
        plan = cache.get(self.hidden, (self.a.h, self.a.w), group="doctor")
        if plan is None:
            raise Outcome("skip", f"ratio {self.a.ratio:g} merges nothing at {self.a.h}x{self.a.w}")
        return plan

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        """``(B, S, heads * head_dim)`` as ``(B, heads, S, head_dim)``."""
        return t.unflatten(-1, (self.a.heads, self.a.head_dim)).transpose(1, 2)

    def attend(self, qkv: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """SDPA over ``qkv`` ``(B, S, 3 * width)``, back to ``(B, S, width)``."""
        q, k, v = (self.heads(t) for t in qkv.split(self.a.width, -1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).flatten(2)

    def merged(self, plan: Plan, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Merge, attend on the merged tokens, unmerge: what a merged block's attention costs."""
        return plan.unmerge(self.attend(plan.merge(self.qkv), mask))


def key_bias(plan: Plan) -> torch.Tensor:
    """Proportional attention's additive key bias: ``log(mass)`` per merged key, ``(Bp, 1, 1, K)``
    over ``(batch, heads, queries, keys)``, as toma's processors pass it."""
    return plan.log_mass[:, None, None, :]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` in the L2 norm, in float32."""
    want = want.float()
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


def attention_checks(report: Report, a: AttentionSetup, timings_mean_little: bool = False) -> dict[str, Any]:
    """Merged against unmerged attention, with and without proportional attention; returns
    the merged tokens and bias for the backend checks (empty if the check could not run).
    ``timings_mean_little``: the merges run in Triton's interpreter, so the speed-up is not
    one to report."""
    shared: dict[str, Any] = {}

    def run_plain() -> tuple[str, dict]:
        ma = MergedAttention(a)
        plan_s, plan = timed(ma.plan, a.repeats, a.device)
        full_s, full = timed(lambda: ma.attend(ma.qkv), a.repeats, a.device)
        merge_s, merged_qkv = timed(lambda: plan.merge(ma.qkv), a.repeats, a.device)
        attn_s, merged_out = timed(lambda: ma.attend(merged_qkv), a.repeats, a.device)
        unmerge_s, _ = timed(lambda: plan.unmerge(merged_out), a.repeats, a.device)
        total_s, out = timed(lambda: ma.merged(plan), a.repeats, a.device)
        _finite(out, "merged attention")
        err = relative_error(out, full)
        floor = relative_error(plan.unmerge(plan.merge(full)), full)
        shared.update(ma=ma, plan=plan, merged_qkv=merged_qkv, full=full, full_s=full_s)
        data = {
            "unmerged_s": full_s,
            "merged_s": total_s,
            "plan_s": plan_s,
            "merge_s": merge_s,
            "attention_merged_s": attn_s,
            "unmerge_s": unmerge_s,
            "speedup": full_s / total_s,
            "relative_error": err,
            "round_trip_error": floor,
            "merged_tokens": plan.num_merged,
        }
        if timings_mean_little:
            data["timings"] = "Triton's interpreter: not the kernels' speed"
        else:
            report.notes.append(f"merged attention {full_s / total_s:.2f}x as fast as unmerged at {a.tokens} tokens")
        return (
            f"unmerged {_ms(full_s)}, merged {_ms(total_s)} (merge {_ms(merge_s)} + attention {_ms(attn_s)} + "
            f"unmerge {_ms(unmerge_s)}): {full_s / total_s:.2f}x; relative error {err:.3f} (the plan's round trip "
            f"of the exact output alone: {floor:.3f}); plan {_ms(plan_s)}, once per step and group of blocks"
        ), data

    report.check("merged vs unmerged attention", run_plain)
    if "plan" not in shared:
        return {}

    def run_proportional() -> tuple[str, dict]:
        ma, plan, full = shared["ma"], shared["plan"], shared["full"]
        bias = key_bias(plan)
        total_s, out = timed(lambda: ma.merged(plan, bias), a.repeats, a.device)
        attn_s, _ = timed(lambda: ma.attend(shared["merged_qkv"], bias), a.repeats, a.device)
        _finite(out, "merged attention with the log-mass bias")
        err = relative_error(out, full)
        data = {
            "merged_s": total_s,
            "attention_merged_s": attn_s,
            "speedup": shared["full_s"] / total_s,
            "relative_error": err,
        }
        return (
            f"merged {_ms(total_s)} (attention {_ms(attn_s)} with the float mask): "
            f"{shared['full_s'] / total_s:.2f}x; relative error {err:.3f}"
        ), data

    report.check("merged attention, proportional (log-mass key bias)", run_proportional)
    return shared


def _finite(t: torch.Tensor, what: str) -> None:
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise Outcome("fail", f"{what}: {bad} non-finite values")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


# --- diffusers' attention backends ------------------------------------------------------------------------------


def backend_names(spec: str) -> list[str]:
    """The backends ``--backends`` names (all registered ones for ``all``, none for ``none``);
    an unknown name raises ``ValueError`` naming the known ones."""
    from toma.adapters import _private

    known = _private.backends()
    text = spec.strip().lower()
    if text == "all":
        return known
    if text in ("none", ""):
        return []
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"--backends: unknown attention backend(s) {', '.join(unknown)}; diffusers {_diffusers()} "
            f"offers {', '.join(known)}"
        )
    return names


def _diffusers() -> str:
    import diffusers

    return diffusers.__version__


def backend_checks(report: Report, a: AttentionSetup, shared: dict[str, Any], names: list[str], hub: bool) -> None:
    """Each backend in ``names`` on the merged tokens of :func:`attention_checks`, without
    and with the log-mass mask, against float32 math SDPA on the same inputs."""
    import diffusers.models.attention_dispatch as ad

    plan = shared["plan"]
    q, k, v = (t.unflatten(-1, (a.heads, a.head_dim)).contiguous() for t in shared["merged_qkv"].split(a.width, -1))
    bias = key_bias(plan).contiguous()
    refs = {False: _reference(q, k, v, None), True: _reference(q, k, v, bias)}
    scale = 1 / math.sqrt(a.head_dim)
    qn, kn = q.float().norm(dim=-1), k.float().norm(dim=-1)
    logit_bound = float(qn.max() * kn.max()) * scale + float(bias.float().abs().max())
    value_bound = float(v.float().abs().max())
    unavailable: list[tuple[str, str]] = []
    # a GPU times each backend as the attention check does; on the CPU one call says enough
    # (diffusers' flex backend runs flex attention eagerly: ~0.4 s a call there)
    timings = min(a.repeats, 3) if a.device.type == "cuda" else 1
    for name in names:
        backend = ad.AttentionBackendName(name)
        try:
            why = _unavailable(ad, backend, hub, a)
        except Exception as err:  # a Hub download that failed, say
            why = f"could not be set up: {type(err).__name__}: {_short(first_line(str(err)), 90)}"
        if why:
            report.add(Result(report.section, name, "skip", why), echo=False)
            unavailable.append((name, why))
            continue
        tol = nm.attention(a.dtype, a.head_dim, q.shape[1], logit_bound, value_bound, quantized="sage" in name)
        for masked in (False, True):
            label = f"{name} + log-mass bias" if masked else name
            report.check(
                label, lambda: _run_backend(ad, backend, q, k, v, bias if masked else None, refs, tol, timings)
            )
    if unavailable:
        report.say(f"  {'skip':<8} not available here: {len(unavailable)} backends")
        for line in _grouped(unavailable):
            report.say(f"           {line}")


def _grouped(entries: list[tuple[str, str]]) -> list[str]:
    """``(name, reason)`` pairs as lines of names sharing a reason, the reason said once."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in entries:
        by_reason.setdefault(reason, []).append(name)
    return [f"{', '.join(names)}: {reason}" for reason, names in by_reason.items()]


def _unavailable(ad: Any, backend: Any, hub: bool, a: AttentionSetup) -> str | None:
    """Why ``backend`` cannot run here (missing package, a Hub download, this device), or None."""
    try:
        ad._check_attention_backend_requirements(backend)
    except Exception as err:  # diffusers says which package is missing
        return _missing(first_line(str(err)))
    if backend in getattr(ad, "_HUB_KERNELS_REGISTRY", {}):
        if not hub:
            return "its kernel comes from the Hugging Face Hub: --hub-backends to try it"
        ad._maybe_download_kernel_for_backend(backend)
    g = torch.Generator().manual_seed(0)
    probe = [torch.randn(1, 64, 1, a.head_dim, generator=g).to(a.device, a.dtype) for _ in range(3)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # said again, and kept, where the backend is checked
            ad.dispatch_attention_fn(*probe, backend=backend)
        sync(a.device)
    except Exception as err:  # the backend does not run on this device or dtype at all
        return f"does not run on {a.device.type} in {nm.dtype_name(a.dtype)}: {_short(first_line(str(err)), 90)}"
    return None


def _missing(message: str) -> str:
    """diffusers' "not usable ... Please install `pkg`" as "needs pkg" (and "Please build ..." as it is)."""
    found = re.search(r"install (?:it with )?`(?:pip install )?(?:-U )?([^`]+)`", message)
    if found:
        return f"needs pip install {found.group(1)}"
    advice = re.search(r"Please (.+?)\.?$", message)
    return f"not installed ({advice.group(1)})" if advice else _short(message, 90)


def _short(text: str, limit: int = 110) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Float32 math SDPA on the same (rounded) inputs, in diffusers' ``(B, S, heads, D)`` layout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with strict_matmul(), sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(
            *(t.float().transpose(1, 2) for t in (q, k, v)), attn_mask=None if bias is None else bias.float()
        )
    return out.transpose(1, 2)


def _run_backend(
    ad: Any,
    backend: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    refs: dict[bool, torch.Tensor],
    tol: nm.Tolerance,
    repeats: int,
) -> tuple[str, dict]:
    from toma.adapters.attention import KeyBias, biased_dispatch, rule

    masked = bias is not None
    form = None
    if masked:
        # the bias as toma's families pass it: in the form the backend's rule picks
        form, why = rule(backend.value, q.device, q.dtype)
        if form is None:
            raise Outcome("n/a", f"proportional attention is off on it: {why}")
        dispatch = biased_dispatch(ad.dispatch_attention_fn)
        call = lambda: dispatch(q, k, v, attn_mask=KeyBias(bias[:, 0, 0, :]), backend=backend)  # noqa: E731
    else:
        call = lambda: ad.dispatch_attention_fn(q, k, v, backend=backend)  # noqa: E731
    with warnings.catch_warnings():
        # a form that fell back (to no bias) is a failure here
        warnings.filterwarnings("error", message="ToMA: proportional attention", category=UserWarning)
        try:
            seconds, out = timed(call, repeats, q.device)
        except UserWarning as err:
            raise Outcome("fail", f"the {form} did not run: {_short(first_line(str(err)), 160)}") from None
    ref = refs[masked]
    c = nm.compare(out, ref, tol)
    data = {"seconds": seconds, **c.as_dict(), "tolerance": {"atol": tol.atol, "rtol": tol.rtol, "why": tol.why}}
    if masked:
        data["form"] = form
        # a backend that dropped the bias would sit closer to the unmasked result
        err_masked, err_plain = relative_error(out, ref), relative_error(out, refs[False])
        effect = relative_error(refs[True], refs[False])
        data.update(error_to_masked=err_masked, error_to_unmasked=err_plain, mask_effect=effect)
        if err_masked >= err_plain and c.ok:
            return (
                f"{c.detail} ({_ms(seconds)}); the bias moves the output by only {effect:.2g} here, too little "
                "to tell whether it was applied"
            ), data
        if err_masked >= err_plain:
            raise Outcome(
                "fail",
                f"the mask seems ignored: the output is nearer the unmasked result ({err_plain:.2g}) "
                f"than the masked one ({err_masked:.2g})",
                data,
            )
    if not c.ok:
        raise Outcome("fail", c.detail, data)
    return f"{form + ': ' if form else ''}{c.detail} ({_ms(seconds)})", data
