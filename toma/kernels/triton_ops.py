"""Triton kernels for plan building, merging and unmerging (imported only when triton is).

Three kernels replace the torch path's dozens of small launches per plan and its reorder
copies:

* :func:`plan_tiles`: for every tile of every batch element in one launch, the exact
  scores, the facility-location greedy and the soft assignment with its merge weights and
  masses. It computes the same destinations as :func:`toma.core.selection.facility_location`
  (the same integer scores, the same lowest-index tie rule), and the weights of
  :func:`toma.core.merge.assignment` up to float32 rounding.
* :func:`merge_tokens` / :func:`unmerge_tokens`: the batched matmuls of
  :meth:`toma.core.plan.Plan.merge` / ``unmerge`` with the move between raster and tile
  order folded into their loads and stores (a row index per tile slot), so tokens can stay
  in raster order with no copy.

Every launch goes through :func:`_launch`, which runs it on its tensors' device, checks
that its block shape fits the device before the first launch of that shape, and turns an
error into a torch-path fallback in ``auto`` mode (see :mod:`toma.kernels`): the public
functions then return None and the caller runs the torch path.

Under ``TRITON_INTERPRET=1`` they run on CPU tensors (slowly), which is how the tests
check them against the torch path on machines without a GPU; the interpreter does not
apply the GPU compiler's rules, which :mod:`toma.kernels.aot` checks ahead of time.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import triton
import triton.language as tl

from toma.kernels import HEALTH, KERNELS_ENV, LAUNCH_OBSERVERS, kernel_mode

# Adding then subtracting 1.5 * 2**23 rounds a float32 of magnitude <= 2**22 to the nearest
# integer, ties to even, exactly like torch.round. libdevice.rint would do, but the Triton
# interpreter cannot run libdevice calls. A kernel may only read a global that is a
# tl.constexpr instance: the interpreter accepts a plain float, the GPU compiler does not.
_ROUNDER = tl.constexpr(12582912.0)


@triton.jit
def _plan_kernel(
    x_ptr,
    src_ptr,
    tmask_ptr,
    keep_ptr,
    dest_ptr,
    a_ptr,
    mw_ptr,
    mass_ptr,
    logm_ptr,
    sim_ptr,
    T,
    n,
    k,
    C,
    sxb,
    sxn,
    sxc,
    scale,
    temperature,
    N: tl.constexpr,
    KB: tl.constexpr,
    BC: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_TMASK: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    HARD: tl.constexpr,
    SAVE_SIM: tl.constexpr,
    SCALE: tl.constexpr,
):
    g = tl.program_id(0)  # one (batch element, tile) group per program
    b = g // T
    t = g % T
    rows = tl.arange(0, N)  # candidates i
    cols = tl.arange(0, N)  # tokens j
    real_r = rows < n
    real_c = cols < n

    # the tile's Gram matrix, read once from the activations in their own dtype (products
    # of fp16/bf16 values are exact in the float32 accumulator); non-finite entries count
    # as 0, as in build_plan
    src = tl.load(src_ptr + t * n + rows, mask=real_r, other=-1)
    if SCALE:
        # bf16/fp32 tokens past ~1e17 have Gram entries that overflow float32, and tiny ones
        # norms under the floor: each row is divided by the power of two at or below its
        # largest magnitude (its exponent bits), which is exact, as cosine_similarity does
        peak = tl.zeros([N], dtype=tl.float32)
        for c0 in range(0, C, BC):
            c = c0 + tl.arange(0, BC)
            xb = tl.load(
                x_ptr + b * sxb + src[:, None] * sxn + c[None, :] * sxc,
                mask=(src[:, None] >= 0) & (c[None, :] < C),
                other=0.0,
            ).to(tl.float32)
            xb = tl.where((xb == xb) & (tl.abs(xb) < float("inf")), xb, 0.0)
            peak = tl.maximum(peak, tl.max(tl.abs(xb), axis=1))
        power = (peak.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        power = tl.maximum(power, 1.1754943508222875e-38)  # float32 tiny: zero rows stay zero
    gram = tl.zeros([N, N], dtype=tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        xb = tl.load(
            x_ptr + b * sxb + src[:, None] * sxn + c[None, :] * sxc,
            mask=(src[:, None] >= 0) & (c[None, :] < C),
            other=0.0,
        )
        xb = tl.where((xb == xb) & (tl.abs(xb) < float("inf")), xb, 0.0).to(xb.dtype)
        if SCALE:
            xb = (xb.to(tl.float32) / power[:, None]).to(xb.dtype)
        if IEEE:
            gram += tl.dot(xb, tl.trans(xb), input_precision="ieee")
        else:
            gram += tl.dot(xb, tl.trans(xb))
    # cosine similarity, as F.normalize: norms floored at 1e-12, and correctly rounded square
    # roots (tl.sqrt may compile to an approximate one)
    diag = rows[:, None] == cols[None, :]
    norm = tl.maximum(tl.sqrt_rn(tl.sum(tl.where(diag, gram, 0.0), axis=1)), 1e-12)
    norm_c = tl.maximum(tl.sqrt_rn(tl.sum(tl.where(diag, gram, 0.0), axis=0)), 1e-12)
    sim = gram / norm[:, None] / norm_c[None, :]
    if SAVE_SIM:
        tl.store(sim_ptr + g * n * n + rows[:, None] * n + cols[None, :], sim, mask=real_r[:, None] & real_c[None, :])

    # exact_scores: symmetric, rounded to multiples of 1/scale, clamped, unit diagonal
    q = (sim + tl.trans(sim)) * (scale * 0.5)
    q = (q + _ROUNDER) - _ROUNDER
    q = tl.minimum(tl.maximum(q, -scale), scale)
    q = tl.where(diag, scale, q)

    if HAS_TMASK:
        tok = tl.load(tmask_ptr + t * n + cols, mask=real_c, other=0) != 0
    else:
        tok = real_c
    # padded tokens never need covering (2 * scale); padded and picked candidates are
    # barred (the torch path gets the same picks from a raised diagonal, which saves
    # kernels there and nothing here); slots past n (block padding) add nothing to any score
    coverage = tl.where(tok, -scale, 2.0 * scale)
    tok_r = tl.where(rows < n, 0.0, float("-inf"))
    if HAS_TMASK:
        tok_rows = tl.load(tmask_ptr + t * n + rows, mask=real_r, other=0) != 0
        tok_r = tl.where(tok_rows, 0.0, float("-inf"))
    barred = tok_r
    slots = tl.arange(0, KB)
    dest = tl.zeros([KB], dtype=tl.int32)
    for step in range(k):
        best = tl.maximum(q, coverage[None, :])
        # integers below 2**24: the sum is exact in any order, so ties are real ties
        score = tl.sum(tl.where(real_c[None, :], best, 0.0), axis=1) + barred
        top = tl.max(score, axis=0)
        idx = tl.min(tl.where(score == top, rows, N), axis=0)  # the lowest of equal maxima
        idx = tl.where(idx == N, 0, idx)  # no real candidate left (torch: argmax of all -inf is 0)
        dest = tl.where(slots == step, idx, dest)
        coverage = tl.max(tl.where(rows[:, None] == idx, best, float("-inf")), axis=0)
        barred = tl.where(rows == idx, float("-inf"), barred)

    # the soft assignment over the destinations' rows of the (unsymmetrised) similarity
    used = slots < k
    if HAS_KEEP:
        used = used & (slots < tl.load(keep_ptr + t))
    # rows of sim picked by a one-hot product: one nonzero term each, so exact
    pick = tl.where(dest[:, None] == rows[None, :], 1.0, 0.0)
    logits = tl.dot(pick, sim, input_precision="ieee")
    logits = tl.where(used[:, None], logits, float("-inf"))
    top = tl.max(logits, axis=0)
    if HARD:
        first = tl.min(tl.where(logits == top[None, :], slots[:, None], KB), axis=0)
        a = tl.where(slots[:, None] == first[None, :], 1.0, 0.0)
    else:
        # divided, not multiplied by 1/temperature, which may overflow: 0 / t stays 0
        e = tl.exp((logits - top[None, :]) / temperature)
        a = e / tl.sum(e, axis=0)[None, :]
    a = tl.where(tok[None, :] & used[:, None], a, 0.0)
    mass = tl.maximum(tl.sum(a, axis=1), 1.1754943508222875e-38)  # float32 tiny, as destination_mass
    out = g * k * n + slots[:, None] * n + cols[None, :]
    keep_out = (slots[:, None] < k) & real_c[None, :]
    tl.store(a_ptr + out, a.to(a_ptr.dtype.element_ty), mask=keep_out)
    tl.store(mw_ptr + out, (a / mass[:, None]).to(mw_ptr.dtype.element_ty), mask=keep_out)
    tl.store(mass_ptr + g * k + slots, mass, mask=slots < k)
    tl.store(logm_ptr + g * k + slots, tl.log(mass).to(logm_ptr.dtype.element_ty), mask=slots < k)
    tl.store(dest_ptr + g * k + slots, dest.to(tl.int64), mask=slots < k)


def plan_tiles(
    x: torch.Tensor,
    src_rows: torch.Tensor,
    k: int,
    temperature: float,
    dtype: torch.dtype,
    token_mask: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    save_sim: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """Similarities, destinations, assignment, merge weights and masses of every tile, in one launch.

    Args:
        x: ``(Bp, N', C)`` tokens, in any float dtype and any strides.
        src_rows: ``(T, n)`` int32 row of ``x`` in each tile slot, -1 for padded slots
            (see :class:`toma.core.tiling.KernelIndex`).
        k: destination slots per tile.
        temperature: softmax temperature (0: hard assignment).
        dtype: dtype of the returned weights (the activations').
        token_mask: optional ``(T, n)`` int8 (or bool, converted), 0 for padded slots.
        keep: optional ``(T,)`` int32 destinations each tile uses (slots past it are unused).
        save_sim: also return the ``(Bp, T, n, n)`` float32 similarities the kernel used.

    Returns:
        ``dest`` ``(Bp, T, k)`` int64 (as :func:`toma.core.selection.facility_location` on
        those similarities), ``a`` ``(Bp, T, k, n)`` assignment and ``merge_w``
        ``(Bp, T, k, n)`` in ``dtype``, ``mass`` ``(Bp, T, k)`` float32 (as
        :func:`toma.core.merge.destination_mass`), its log ``(Bp, T, k)`` in ``dtype`` (the
        proportional-attention bias), and the similarities or None. None instead of all
        that when the kernel cannot run here (see :func:`_launch`): use the torch path.
    """
    bp, _, c = x.shape
    tiles, n = src_rows.shape
    device = x.device
    scale = float(2 ** (23 - max(1, math.ceil(math.log2(n)))))  # as exact_scores
    dest = torch.empty(bp, tiles, k, dtype=torch.long, device=device)
    a = torch.empty(bp, tiles, k, n, dtype=dtype, device=device)
    mw = torch.empty(bp, tiles, k, n, dtype=dtype, device=device)
    mass = torch.empty(bp, tiles, k, dtype=torch.float32, device=device)
    log_mass = torch.empty(bp, tiles, k, dtype=dtype, device=device)
    sim = torch.empty(bp, tiles, n, n, dtype=torch.float32, device=device) if save_sim else mass  # mass: unused
    if token_mask is not None and token_mask.dtype == torch.bool:
        token_mask = token_mask.to(torch.int8)
    tmask = src_rows if token_mask is None else token_mask  # src_rows: an unused pointer
    launched = _launch(
        "plan",
        (bp * tiles,),
        (
            x,
            src_rows,
            tmask,
            src_rows if keep is None else keep,
            dest,
            a,
            mw,
            mass,
            log_mass,
            sim,
            tiles,
            n,
            k,
            c,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            scale,
            float(temperature),
        ),
        dict(
            N=max(16, triton.next_power_of_2(n)),
            KB=max(16, triton.next_power_of_2(k)),
            BC=_block_c(c),
            IEEE=x.dtype == torch.float32,
            HAS_TMASK=token_mask is not None,
            HAS_KEEP=keep is not None,
            HARD=temperature == 0,
            SAVE_SIM=save_sim,
            SCALE=x.dtype != torch.float16,
        ),
    )
    if not launched:
        return None
    return dest, a, mw, mass, log_mass, sim if save_sim else None


@triton.jit
def _merge_kernel(
    x_ptr,
    w_ptr,
    src_ptr,
    dst_ptr,
    out_ptr,
    T,
    n,
    k,
    C,
    sxb,
    sxn,
    sxc,
    swb,
    sob,
    son,
    N: tl.constexpr,
    KB: tl.constexpr,
    BC: tl.constexpr,
    IEEE: tl.constexpr,
):
    g = tl.program_id(0)  # (batch element, tile)
    b = g // T
    t = g % T
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    slots = tl.arange(0, N)
    dslots = tl.arange(0, KB)
    src = tl.load(src_ptr + t * n + slots, mask=slots < n, other=-1)  # token row of each slot, -1 padded
    x = tl.load(
        x_ptr + b * sxb + src[:, None] * sxn + c[None, :] * sxc, mask=(src[:, None] >= 0) & (c[None, :] < C), other=0.0
    )
    w = tl.load(
        w_ptr + b * swb + t * k * n + dslots[:, None] * n + slots[None, :],
        mask=(dslots[:, None] < k) & (slots[None, :] < n),
        other=0.0,
    )
    if IEEE:
        acc = tl.dot(w, x, input_precision="ieee")
    else:
        acc = tl.dot(w, x)
    dst = tl.load(dst_ptr + t * k + dslots, mask=dslots < k, other=-1)  # output row, -1 unused
    tl.store(
        out_ptr + b * sob + dst[:, None] * son + c[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(dst[:, None] >= 0) & (c[None, :] < C),
    )


@triton.jit
def _unmerge_kernel(
    y_ptr,
    a_ptr,
    src_ptr,
    dst_ptr,
    out_ptr,
    res_ptr,
    T,
    n,
    k,
    C,
    syb,
    syn,
    syc,
    sab,
    sat,
    sak,
    san,
    sob,
    son,
    srb,
    srn,
    src_c,
    N: tl.constexpr,
    KB: tl.constexpr,
    BC: tl.constexpr,
    IEEE: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    g = tl.program_id(0)
    b = g // T
    t = g % T
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    slots = tl.arange(0, N)
    dslots = tl.arange(0, KB)
    dst = tl.load(dst_ptr + t * k + dslots, mask=dslots < k, other=-1)
    y = tl.load(
        y_ptr + b * syb + dst[:, None] * syn + c[None, :] * syc, mask=(dst[:, None] >= 0) & (c[None, :] < C), other=0.0
    )
    # A^T (n, k), read from the (k, n) assignment through its strides
    at = tl.load(
        a_ptr + b * sab + t * sat + dslots[None, :] * sak + slots[:, None] * san,
        mask=(slots[:, None] < n) & (dslots[None, :] < k),
        other=0.0,
    )
    if IEEE:
        acc = tl.dot(at, y, input_precision="ieee")
    else:
        acc = tl.dot(at, y)
    src = tl.load(src_ptr + t * n + slots, mask=slots < n, other=-1)
    rows = (src[:, None] >= 0) & (c[None, :] < C)
    if RESIDUAL:
        # the block's residual add, in the same pass: one launch instead of two
        acc += tl.load(res_ptr + b * srb + src[:, None] * srn + c[None, :] * src_c, mask=rows, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * sob + src[:, None] * son + c[None, :], acc.to(out_ptr.dtype.element_ty), mask=rows)


def _check_batch(b: int, bp: int) -> None:
    # the torch path's matmuls broadcast a shared plan and refuse any other mismatch
    if bp not in (1, b):
        raise ValueError(f"a plan for a batch of {bp} cannot merge a batch of {b} (plans are per sample or shared)")


def _block_c(c: int) -> int:
    return max(16, min(64, triton.next_power_of_2(c)))


def merge_tokens(
    x: torch.Tensor, merge_w: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor, num_merged: int
) -> torch.Tensor | None:
    """Merge ``x`` ``(B, N', C)`` with ``merge_w`` ``(Bp, T, k, n)`` into ``(B, K, C)``, or
    None when the kernel cannot run here (use the torch path).

    Args:
        src_rows: ``(T, n)`` int32 row of ``x`` in each tile slot, -1 for padded slots
            (raster order: the tile permutation; tile order: ``t * n + slot``).
        dst_rows: ``(T, k)`` int32 merged row of each destination slot, -1 for unused slots.
        num_merged: K.
    """
    b, _, c = x.shape
    bp, tiles, k, n = merge_w.shape
    _check_batch(b, bp)
    merge_w = merge_w.contiguous()
    out = torch.empty(b, num_merged, c, dtype=x.dtype, device=x.device)
    bc = _block_c(c)
    launched = _launch(
        "merge",
        (b * tiles, triton.cdiv(c, bc)),
        (
            x,
            merge_w,
            src_rows,
            dst_rows,
            out,
            tiles,
            n,
            k,
            c,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            0 if bp == 1 else merge_w.stride(0),
            out.stride(0),
            out.stride(1),
        ),
        dict(
            N=max(16, triton.next_power_of_2(n)),
            KB=max(16, triton.next_power_of_2(k)),
            BC=bc,
            IEEE=x.dtype == torch.float32,
        ),
    )
    return out if launched else None


def unmerge_tokens(
    y: torch.Tensor,
    a: torch.Tensor,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    num_rows: int,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Unmerge ``y`` ``(B, K, C)`` with the assignment ``a`` ``(Bp, T, k, n)`` (``A``, whose
    transpose is the unmerge weights) into ``(B, num_rows, C)``; rows are placed by
    ``src_rows`` (see :func:`merge_tokens`), and rows no slot names are left unwritten.

    With ``residual`` ``(B, num_rows, C)``, returns ``residual + unmerge(y)`` (the sum in
    float32, then rounded once), in the same launch. None when the kernel cannot run here
    (use the torch path)."""
    b, _, c = y.shape
    bp, tiles, k, n = a.shape
    _check_batch(b, bp)
    if residual is not None and residual.shape != (b, num_rows, c):
        raise ValueError(f"residual of shape {tuple(residual.shape)} does not fit an unmerged {(b, num_rows, c)}")
    out = torch.empty(b, num_rows, c, dtype=y.dtype, device=y.device)
    res = out if residual is None else residual  # not read without a residual
    bc = _block_c(c)
    launched = _launch(
        "unmerge",
        (b * tiles, triton.cdiv(c, bc)),
        (
            y,
            a,
            src_rows,
            dst_rows,
            out,
            res,
            tiles,
            n,
            k,
            c,
            y.stride(0),
            y.stride(1),
            y.stride(2),
            0 if bp == 1 else a.stride(0),
            a.stride(1),
            a.stride(2),
            a.stride(3),
            out.stride(0),
            out.stride(1),
            res.stride(0),
            res.stride(1),
            res.stride(2),
        ),
        dict(
            N=max(16, triton.next_power_of_2(n)),
            KB=max(16, triton.next_power_of_2(k)),
            BC=bc,
            IEEE=y.dtype == torch.float32,
            RESIDUAL=residual is not None,
        ),
    )
    return out if launched else None


# every launch site's kernel, for toma.tools.opcount to count
KERNELS = (_plan_kernel, _merge_kernel, _unmerge_kernel)

# launch name -> kernel; looked up at each launch, so a test can put a failing kernel here
KERNEL_FNS: dict[str, Any] = {"plan": _plan_kernel, "merge": _merge_kernel, "unmerge": _unmerge_kernel}

# launch options: fused multiply-adds off, so that a GPU rounds each product and sum as
# the interpreter (and the torch path) does; and no Triton warning about its default
_OPTIONS = {"enable_fp_fusion": False}


class _DryRun:
    depth = 0


@contextlib.contextmanager
def dry_run():
    """Inside, the public functions record their launches (observers) without launching:
    on ``meta`` tensors, they give every launch's signature with no device at all."""
    _DryRun.depth += 1
    try:
        yield
    finally:
        _DryRun.depth -= 1


def _launch(name: str, grid: tuple, args: tuple, meta: dict) -> bool:
    """Launch kernel ``name`` on ``grid`` on its tensors' device; False if it takes the torch
    path instead (turned off by an earlier error, a block shape that does not fit the
    device, or an error now, in ``auto`` mode; each said once)."""
    kernel = KERNEL_FNS[name]
    if not _DryRun.depth and not HEALTH.usable(name):
        return False
    for observer in LAUNCH_OBSERVERS:
        observer(name, kernel, args, meta)
    if _DryRun.depth:
        return True
    device = args[0].device
    try:
        with _device_guard(device):
            if not _fits(name, kernel, grid, args, meta, device):
                return False
            kernel[grid](*args, **meta, **_OPTIONS)
    except Exception as err:
        if kernel_mode() == "triton":
            raise
        HEALTH.fail(name, err)
        return False
    return True


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the current device: make it ``device`` (tensors on ``cuda:1``
    launched with ``cuda:0`` current would be read through the wrong device's addresses)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device.index)
    return contextlib.nullcontext()


def _fits(name: str, kernel: Any, grid: tuple, args: tuple, meta: dict, device: torch.device) -> bool:
    """Whether this launch's block shape fits ``device``, from its compiled shared memory,
    before the first launch of that shape (Triton would raise out of resources there).
    The interpreter has no limits."""
    key = (name, tuple(meta.values()), args[0].dtype, device)
    fits = HEALTH.fits.get(key)
    if fits is None:
        limit = _shared_limit(device)
        if limit is None:
            HEALTH.fits[key] = True
            return True
        needed = _shared_needed(kernel, grid, args, meta)
        fits = HEALTH.fits[key] = needed <= limit
        if not fits:
            message = (
                f"toma: the Triton {name} kernel for N={meta.get('N')}, KB={meta.get('KB')} in {args[0].dtype} needs "
                f"{needed} bytes of shared memory, more than this device's {limit}; those launches take the torch path"
            )
            if kernel_mode() == "triton":
                raise RuntimeError(
                    message.replace("; those launches take the torch path", "")
                    + f" (a smaller tile_size fits; {KERNELS_ENV}=auto falls back by itself)"
                )
            HEALTH.say(message)
    return fits


def _shared_needed(kernel: Any, grid: tuple, args: tuple, meta: dict) -> int:
    # compiles (or finds in Triton's cache) exactly what the launch will run
    return int(kernel.warmup(*args, grid=grid, **meta, **_OPTIONS).metadata.shared)


def _shared_limit(device: torch.device) -> int | None:
    """The most shared memory a block may use on ``device`` (what Triton checks at load),
    or None where there is no limit (the interpreter)."""
    if device.type != "cuda":
        return None
    from triton.runtime import driver

    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


def probe(device: torch.device) -> None:
    """Launch each kernel once on tiny inputs on ``device``, so that an environment where
    a kernel cannot run at all (a compile error, a driver that rejects the code) turns it
    off before the first real merge rather than in the middle of a forward."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 16, generator=g).to(device)
    src = torch.arange(16, dtype=torch.int32, device=device).view(1, 16)
    dst = torch.arange(8, dtype=torch.int32, device=device).view(1, 8)
    planned = plan_tiles(x, src, 8, 0.1, x.dtype)
    # the merge kernels run on weights of their own if the plan kernel could not
    mw = planned[2] if planned is not None else torch.full((1, 1, 8, 16), 1 / 16, device=device)
    a = planned[1] if planned is not None else mw
    merged = merge_tokens(x, mw, src, dst, 8)
    unmerge_tokens(merged if merged is not None else x[:, :8], a, src, dst, 16)
