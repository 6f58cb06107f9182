"""The doctor's plan, merge and unmerge checks: the torch path against float64, the Triton
kernels against the torch path.

Two rules keep a rounding difference from failing a correct implementation:

* merges and unmerges are compared on the same plan (the same weights), so which
  destinations a greedy picked cannot matter there;
* destinations are compared exactly either on the same similarities (the plan kernel's
  own, fed to the torch greedy), or on :func:`~toma.tools.doctor.inputs.margin_tokens`,
  whose every greedy choice is won by a margin far beyond any rounding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from toma.config import ToMAConfig
from toma.core.merge import assignment, cosine_similarity, destination_mass, merge_weights
from toma.core.plan import Plan, build_fused_plan, build_plan, finite_or_zero
from toma.core.selection import facility_location
from toma.core.tiling import KernelIndex, LayoutIndex, TileLayout, kernel_index, layout_index, make_layout, to_tiles
from toma.kernels import HEALTH
from toma.tools.doctor import numerics as nm
from toma.tools.doctor.inputs import (
    NoMarginDesign,
    margin_tokens,
    merged_rows,
    reference_merge,
    reference_unmerge,
    tile_rows,
)
from toma.tools.doctor.report import Outcome, Report


@dataclass
class MergeSetup:
    """The merge checks' sizes and everything derived from them on the device."""

    device: torch.device
    h: int
    w: int
    channels: int
    batch: int
    tile: int
    ratio: float
    dtypes: tuple[torch.dtype, ...]
    seed: int
    config: ToMAConfig = dataclasses.field(init=False)
    layout: TileLayout = dataclasses.field(init=False)
    index: LayoutIndex = dataclasses.field(init=False)
    rows: torch.Tensor = dataclasses.field(init=False)
    dst: torch.Tensor = dataclasses.field(init=False)
    _margin: Any = dataclasses.field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.config = ToMAConfig(ratio=self.ratio, tile_size=self.tile)
        self.layout = make_layout(self.h, self.w, self.config.tile, self.ratio)
        self.index = layout_index(self.layout, self.device)
        lay = self.layout
        self.rows = tile_rows(self.h, self.w, lay.th, lay.tw, self.device)
        self.dst = merged_rows(lay.keep, lay.slots, self.device)

    @property
    def tokens(self) -> int:
        """N."""
        return self.h * self.w

    def describe(self) -> str:
        """What the checks run on."""
        lay = self.layout
        return (
            f"{self.h}x{self.w} tokens x {self.channels} channels, batch {self.batch}, tile {lay.th}x{lay.tw}, "
            f"ratio {self.ratio:g} ({lay.num_merged} merged tokens), temperature {self.config.temperature:g}"
        )

    def random(self, *shape: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
        """Standard normal values (drawn on the CPU, so every device gets the same), in ``dtype``."""
        g = torch.Generator().manual_seed(self.seed * 1000 + salt)
        return torch.randn(*shape, generator=g).to(self.device, dtype)

    def tile_order(self, x: torch.Tensor) -> torch.Tensor:
        """Raster tokens in tile order, by this module's own geometry (unpadded layouts only)."""
        return x[:, self.rows.flatten()]

    def margin(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """:func:`margin_tokens` for these sizes on the device (made once): tokens (float32),
        the expected destinations and the margin; raises :class:`NoMarginDesign` where none exists."""
        if self._margin is None:
            lay = self.layout
            g = torch.Generator().manual_seed(self.seed * 1000 + 7)
            try:
                mt = margin_tokens(self.h, self.w, lay.th, lay.tw, lay.keep, lay.slots, self.batch, self.channels, g)
                self._margin = (mt.x.to(self.device), mt.expected.to(self.device), mt.margin)
            except NoMarginDesign as err:
                self._margin = err
        if isinstance(self._margin, NoMarginDesign):
            raise self._margin
        return self._margin


@contextlib.contextmanager
def strict_matmul() -> Iterator[None]:
    """Float32 matmuls in float32 and half-precision ones accumulated in float32, as the
    tolerances assume: TF32 and cuBLAS' reduced-precision split-K reductions round
    intermediate sums to fewer bits. Restores the settings after."""
    m = torch.backends.cuda.matmul
    saved = (
        torch.get_float32_matmul_precision(),
        m.allow_fp16_reduced_precision_reduction,
        m.allow_bf16_reduced_precision_reduction,
        torch.backends.cudnn.allow_tf32,
    )
    torch.set_float32_matmul_precision("highest")
    m.allow_fp16_reduced_precision_reduction = False
    m.allow_bf16_reduced_precision_reduction = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction = saved[1], saved[2]
        torch.backends.cudnn.allow_tf32 = saved[3]


def _all_pass(named: dict[str, nm.Comparison]) -> tuple[str, dict[str, Any]]:
    """Pass with the worst comparison's detail, or fail naming the first that failed."""
    data = {name: c.as_dict() for name, c in named.items()}
    bad = [(name, c) for name, c in named.items() if not c.ok]
    if bad:
        name, c = bad[0]
        raise Outcome("fail", f"{name}: {c.detail}", data)
    name, worst = max(named.items(), key=lambda item: item[1].used)
    if len(named) == 1:
        return f"{name} within bounds: {worst.detail}", data
    return f"{', '.join(list(named)[:-1])} and {list(named)[-1]} within bounds; worst {worst.detail} in {name}", data


# --- the torch path ---------------------------------------------------------------------------------------------


def torch_path_checks(report: Report, s: MergeSetup) -> None:
    """Plans (margin tokens, weight sums) and merges/unmerges of the torch path against a
    float64 reference, per dtype."""
    report.say(
        "  (bounds are the worst case of the dtype's rounding: a correct result may come near one, "
        "a bug lands orders of magnitude beyond)"
    )
    for dtype in s.dtypes:
        name = nm.dtype_name(dtype)
        x = s.random(s.batch, s.tokens, s.channels, dtype=dtype, salt=1)
        plan = _once(
            lambda: build_plan(
                to_tiles(x, s.layout, s.index.gather_index),
                s.layout,
                dtype,
                selection=s.config.selection,
                temperature=s.config.temperature,
                index=s.index,
            )
        )
        report.check(f"{name} plan on margin tokens", lambda: _torch_margin_plan(s, dtype))
        report.check(f"{name} plan weights", lambda: _weight_sums(s, plan(), dtype))
        report.check(f"{name} merge", lambda: _torch_merge(s, plan(), x, dtype))
        y = s.random(s.batch, s.layout.num_merged, s.channels, dtype=dtype, salt=2)
        res = s.random(s.batch, s.tokens, s.channels, dtype=dtype, salt=3)
        report.check(f"{name} unmerge", lambda: _torch_unmerge(s, plan(), y, dtype))
        report.check(f"{name} unmerge + residual", lambda: _torch_unmerge(s, plan(), y, dtype, res))


def _once(make: Callable[[], Plan]) -> Callable[[], Plan]:
    """``make``, called at the first check that needs its plan (inside that check, so that an
    error fails the check rather than the run) and kept for the next ones."""
    made: list[Plan] = []

    def get() -> Plan:
        if not made:
            made.append(make())
        return made[0]

    return get


def _torch_margin_plan(s: MergeSetup, dtype: torch.dtype) -> tuple[str, dict]:
    try:
        x, expected, margin = s.margin()
    except NoMarginDesign as err:
        raise Outcome("skip", str(err)) from None
    x = x.to(dtype)
    plan = build_plan(
        to_tiles(x, s.layout, s.index.gather_index),
        s.layout,
        dtype,
        selection=s.config.selection,
        temperature=s.config.temperature,
        index=s.index,
    )
    return _destinations_as_designed(plan.dest, expected, margin, "torch greedy")


def _destinations_as_designed(dest: torch.Tensor, expected: torch.Tensor, margin: float, who: str) -> tuple[str, dict]:
    used = expected >= 0
    wrong = ((dest != expected) & used).any(-1)  # (B, T): tiles with a destination off the design
    designed = used.any(-1)
    tiles, all_tiles = int(designed.sum()), designed.numel()
    data = {
        "tiles": tiles,
        "tiles_without_design": all_tiles - tiles,
        "wrong_tiles": int(wrong.sum()),
        "margin": margin,
    }
    if wrong.any():
        b, t = (int(i) for i in wrong.nonzero()[0])
        got, want = dest[b, t][used[b, t]].tolist(), expected[b, t][used[b, t]].tolist()
        raise Outcome(
            "fail",
            f"{int(wrong.sum())} of {tiles} tiles off the design (batch {b}, tile {t}: {who} "
            f"picked {got}, designed {want})",
            data,
        )
    left = f"; {all_tiles - tiles} edge tiles have no design and are not checked" if tiles < all_tiles else ""
    gap = f"smallest greedy margin {margin:.3f}" if math.isfinite(margin) else "no choice to make: every token kept"
    return f"all {tiles} tiles' destinations as designed ({gap}){left}", data


def _weight_sums(s: MergeSetup, plan: Plan, dtype: torch.dtype) -> tuple[str, dict]:
    used, real = s.dst >= 0, s.rows >= 0
    n, k = s.layout.tile_area, s.layout.slots
    rows = plan.merge_w.double().sum(-1)[:, used]  # each destination's weights: a mean
    cols = plan.unmerge_w.double().sum(-1)[:, real]  # each real token's share: all of it
    negative = int((plan.merge_w < 0).sum() + (plan.unmerge_w < 0).sum())
    if negative:
        raise Outcome("fail", f"{negative} negative weights")
    picked_real = torch.gather(real.expand(plan.dest.shape[0], -1, -1), 2, plan.dest)[:, used]
    if not bool(picked_real.all()):
        raise Outcome("fail", f"{int((~picked_real).sum())} destinations on padded slots")
    return _all_pass(
        {
            "merge rows sum to 1": nm.compare(rows, torch.ones_like(rows), nm.row_sums(dtype, n)),
            "unmerge rows sum to 1": nm.compare(cols, torch.ones_like(cols), nm.row_sums(dtype, k)),
        }
    )


def _torch_merge(s: MergeSetup, plan: Plan, x: torch.Tensor, dtype: torch.dtype) -> tuple[str, dict]:
    scale = float(x.abs().max())
    tol = nm.convex_mix(dtype, s.layout.tile_area, scale, against_exact=True)
    with strict_matmul():
        ref = reference_merge(x, plan.merge_w, s.rows, s.dst)
        named = {"raster order": nm.compare(plan.merge(x), ref, tol)}
        if not s.layout.padded:
            named["tile order"] = nm.compare(plan.merge(s.tile_order(x), tiled=True), ref, tol)
    return _all_pass(named)


def _torch_unmerge(
    s: MergeSetup, plan: Plan, y: torch.Tensor, dtype: torch.dtype, residual: torch.Tensor | None = None
) -> tuple[str, dict]:
    scale, k = float(y.abs().max()), s.layout.slots
    if residual is None:
        tol = nm.convex_mix(dtype, k, scale, against_exact=True)
    else:
        tol = nm.mix_plus_residual(dtype, k, scale, float(residual.abs().max()), against_exact=True)
    with strict_matmul():
        ref = reference_unmerge(y, plan.unmerge_w, s.rows, s.dst, s.tokens, residual)
        named = {"raster order": nm.compare(plan.unmerge(y, residual=residual), ref, tol)}
        if not s.layout.padded:
            res_t = None if residual is None else s.tile_order(residual)
            named["tile order"] = nm.compare(plan.unmerge(y, tiled=True, residual=res_t), s.tile_order(ref), tol)
    return _all_pass(named)


# --- the Triton kernels -----------------------------------------------------------------------------------------


def kernel_checks(report: Report, s: MergeSetup, interpreter: bool) -> None:
    """The plan, merge and unmerge kernels against the torch path, per dtype (the caller has
    decided that the kernels run on ``s.device``)."""
    from toma.kernels import triton_ops

    kidx = kernel_index(s.layout, s.device)
    bf16_skip = None
    if interpreter and torch.bfloat16 in s.dtypes:
        from toma.tools.doctor.triton_control import bf16_dot_works

        if not bf16_dot_works(s.device):
            bf16_skip = (
                "Triton's interpreter computes bf16 dot products wrongly (a control tl.dot of small "
                "integers in bf16 failed), so bf16 kernel results on the CPU mean nothing; checked on GPUs"
            )
    for dtype in s.dtypes:
        name = nm.dtype_name(dtype)
        if dtype == torch.bfloat16 and bf16_skip:
            report.check(f"{name} kernels", lambda: _raise(Outcome("skip", bf16_skip)))
            continue
        x = s.random(s.batch, s.tokens, s.channels, dtype=dtype, salt=11)
        report.check(f"{name} plan kernel", lambda: _plan_kernel(s, kidx, x, dtype, triton_ops))
        report.check(f"{name} plan kernel on margin tokens", lambda: _plan_kernel_margin(s, kidx, dtype, triton_ops))
        # the API's plan (the plan kernel's, or the torch path's where that kernel cannot run)
        plan = _once(
            lambda: build_fused_plan(x, False, s.layout, dtype, s.index, kidx, temperature=s.config.temperature)
        )
        y = s.random(s.batch, s.layout.num_merged, s.channels, dtype=dtype, salt=12)
        res = s.random(s.batch, s.tokens, s.channels, dtype=dtype, salt=13)
        report.check(f"{name} merge kernel", lambda: _merge_kernel(s, kidx, plan(), x, dtype, triton_ops))
        report.check(f"{name} unmerge kernel", lambda: _unmerge_kernel(s, kidx, plan(), y, dtype, triton_ops))
        report.check(
            f"{name} unmerge kernel + residual", lambda: _unmerge_kernel(s, kidx, plan(), y, dtype, triton_ops, res)
        )


def _raise(outcome: Outcome) -> None:
    raise outcome


def fallback_reason(name: str) -> str:
    """Why kernel ``name`` just took the torch path, from :data:`toma.kernels.HEALTH`."""
    if name in HEALTH.broken:
        return f"the Triton {name} kernel takes the torch path: it failed ({HEALTH.broken[name]})"
    if any(key[0] == name and not fits for key, fits in HEALTH.fits.items()):
        return f"the Triton {name} kernel takes the torch path: its block does not fit this device's shared memory"
    return f"the Triton {name} kernel takes the torch path here"


def _plan_kernel(s: MergeSetup, kidx: KernelIndex, x: torch.Tensor, dtype: torch.dtype, ops: Any) -> tuple[str, dict]:
    lay, temperature = s.layout, s.config.temperature
    with strict_matmul():
        out = ops.plan_tiles(
            x, kidx.src_raster, lay.slots, temperature, dtype, kidx.token_mask, kidx.keep, save_sim=True
        )
        if out is None:
            raise Outcome("fallback", fallback_reason("plan"))
        dest, a, mw, mass, log_mass, sim = out
        mask = s.index.token_mask
        # the torch path's similarities, on its own tiles (padded slots hold copies there,
        # zeros in the kernel: compared on real tokens only)
        sim_t = cosine_similarity(finite_or_zero(to_tiles(x, lay, s.index.gather_index)))
        real = (s.rows >= 0)[:, :, None] & (s.rows >= 0)[:, None, :]
        picks = facility_location(sim, lay.slots, mask)  # the torch greedy on the kernel's similarities
        if not torch.equal(dest, picks):
            wrong = int((dest != picks).any(-1).sum())
            raise Outcome(
                "fail",
                f"destinations: {wrong} of {dest.shape[0] * dest.shape[1]} tiles differ from the "
                "torch greedy on the kernel's own similarities",
            )
        a_ref = assignment(sim, dest, temperature, mask, s.index.slot_mask)
        mass_ref = destination_mass(a_ref)
        n, k = lay.tile_area, lay.slots
        return _all_pass(
            {
                "similarities": nm.compare(sim[:, real], sim_t[:, real], nm.similarity(s.channels)),
                "assignment": nm.compare(a, a_ref.to(dtype), nm.assignment(dtype, temperature, k)),
                "merge weights": nm.compare(
                    mw, merge_weights(a_ref, mass_ref).to(dtype), nm.merge_weights(dtype, temperature, k, n)
                ),
                "masses": nm.compare(mass, mass_ref.squeeze(-1), nm.mass(temperature, k, n)),
                "log masses": nm.compare(log_mass, mass.log().to(dtype), nm.log_of(dtype)),
            }
        )


def _plan_kernel_margin(s: MergeSetup, kidx: KernelIndex, dtype: torch.dtype, ops: Any) -> tuple[str, dict]:
    try:
        x, expected, margin = s.margin()
    except NoMarginDesign as err:
        raise Outcome("skip", str(err)) from None
    x, lay = x.to(dtype), s.layout
    out = ops.plan_tiles(x, kidx.src_raster, lay.slots, s.config.temperature, dtype, kidx.token_mask, kidx.keep)
    if out is None:
        raise Outcome("fallback", fallback_reason("plan"))
    torch_plan = build_plan(
        to_tiles(x, lay, s.index.gather_index),
        lay,
        dtype,
        selection=s.config.selection,
        temperature=s.config.temperature,
        index=s.index,
    )
    used = expected >= 0
    if not torch.equal(out[0][used], torch_plan.dest[used]):
        wrong = int(((out[0] != torch_plan.dest) & used).any(-1).sum())
        raise Outcome("fail", f"{wrong} tiles' destinations differ between the kernel and the torch greedy")
    detail, data = _destinations_as_designed(out[0], expected, margin, "the kernel")
    return detail.replace("as designed", "as designed and as the torch greedy's"), data


def _merge_kernel(
    s: MergeSetup, kidx: KernelIndex, plan: Plan, x: torch.Tensor, dtype: torch.dtype, ops: Any
) -> tuple[str, dict]:
    torch_plan = dataclasses.replace(plan, kernels=None)
    tol = nm.convex_mix(dtype, s.layout.tile_area, float(x.abs().max()))
    with strict_matmul():
        out = ops.merge_tokens(x, plan.merge_w, kidx.src_raster, kidx.dst_rows, plan.num_merged)
        if out is None:
            raise Outcome("fallback", fallback_reason("merge"))
        named = {"raster order": nm.compare(out, torch_plan.merge(x), tol)}
        if not torch.equal(plan.merge(x), out):
            raise Outcome("fail", "Plan.merge on the kernel path does not return the merge kernel's result")
        if not s.layout.padded:
            xt = s.tile_order(x)
            out_t = ops.merge_tokens(xt, plan.merge_w, kidx.src_tiled, kidx.dst_rows, plan.num_merged)
            if out_t is None:
                raise Outcome("fallback", fallback_reason("merge"))
            named["tile order"] = nm.compare(out_t, torch_plan.merge(xt, tiled=True), tol)
    return _all_pass(named)


def _unmerge_kernel(
    s: MergeSetup,
    kidx: KernelIndex,
    plan: Plan,
    y: torch.Tensor,
    dtype: torch.dtype,
    ops: Any,
    residual: torch.Tensor | None = None,
) -> tuple[str, dict]:
    torch_plan = dataclasses.replace(plan, kernels=None)
    k, scale = s.layout.slots, float(y.abs().max())
    if residual is None:
        tol = nm.convex_mix(dtype, k, scale)
    else:
        tol = nm.mix_plus_residual(dtype, k, scale, float(residual.abs().max()))
    a = plan.unmerge_w.transpose(-1, -2)  # the (k, n) assignment the kernel reads
    with strict_matmul():
        out = ops.unmerge_tokens(y, a, kidx.src_raster, kidx.dst_rows, s.tokens, residual)
        if out is None:
            raise Outcome("fallback", fallback_reason("unmerge"))
        named = {"raster order": nm.compare(out, torch_plan.unmerge(y, residual=residual), tol)}
        if not s.layout.padded:
            res_t = None if residual is None else s.tile_order(residual)
            rows = s.layout.num_tiles * s.layout.tile_area
            out_t = ops.unmerge_tokens(y, a, kidx.src_tiled, kidx.dst_rows, rows, res_t)
            if out_t is None:
                raise Outcome("fallback", fallback_reason("unmerge"))
            named["tile order"] = nm.compare(out_t, torch_plan.unmerge(y, tiled=True, residual=res_t), tol)
    return _all_pass(named)
