"""Compile the kernels ahead of time for GPU targets, on a machine without a GPU.

Triton's interpreter (``TRITON_INTERPRET=1``), which runs the kernels in the tests, does
not apply the GPU compiler's rules: a kernel can compute the right numbers there and fail
to compile for every GPU. This module records the signature of each launch (the same
specialisation Triton's launcher makes: argument types, the integers it turns into
constants, 16-byte alignment) and compiles it with Triton's own compiler for chosen
targets (ptxas ships in the triton wheel; AMD targets need no tool of their own), then
checks each compile's shared memory against :mod:`toma.kernels.targets`.

Compiling must happen in a process where ``TRITON_INTERPRET`` is unset: the interpreter
patches ``triton.language`` while it runs, so run :func:`main` as a subprocess::

    python -m toma.kernels.aot LAUNCHES.json --targets sm_75,sm_80,sm_90,gfx942

where ``LAUNCHES.json`` is a list of :func:`record` dicts.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import inspect
import json
import os
import sys
import time
from typing import Any, Callable

from toma.kernels.targets import CI_TARGETS, TARGETS, target


def _params(kernel: Any) -> list[inspect.Parameter]:
    return list(inspect.signature(kernel.fn).parameters.values())


def _is_constexpr(param: inspect.Parameter) -> bool:
    # annotations are strings here (the kernels' module uses postponed annotations)
    return "constexpr" in str(param.annotation)


def record(name: str, kernel: Any, args: tuple, meta: dict) -> dict:
    """The launch of ``kernel`` (called ``name``) with positional ``args`` and constexprs
    ``meta``, as Triton's launcher would specialise it: a JSON-ready dict."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[str, str] = {}
    positional = iter(args)
    for param in _params(kernel):
        if _is_constexpr(param):
            signature[param.name] = "constexpr"
            constexprs[param.name] = meta[param.name]
            continue
        arg = next(positional)
        kind, spec = native_specialize_impl(BaseBackend, arg, False, True, True)
        signature[param.name] = kind
        if kind == "constexpr":  # an integer 1, which the launcher makes a constant
            constexprs[param.name] = arg
        elif isinstance(spec, str) and spec:
            attrs[param.name] = spec
    return {"kernel": name, "signature": signature, "constexprs": constexprs, "attrs": attrs}


def synthetic_launches(
    tiles: list[tuple[int, int]], channels: list[int], dtypes: list[str], batch: int = 2, corners: bool = False
) -> list[dict]:
    """The launches that settings can reach, recorded without a device: for each tile of
    ``n`` slots keeping ``k``, channel count and dtype (``"fp32"``, ``"fp16"``, ``"bf16"``),
    the plan kernel with soft and hard assignment, with and without padded slots (a
    token mask, and per-tile keep counts), the merge, and the unmerge with and without the
    residual add. With ``corners``, only two plan variants (soft with mask and keeps, hard
    with neither), which set every flag both ways. Runs the public functions on ``meta``
    tensors in a dry run."""
    import torch

    from toma.kernels import LAUNCH_OBSERVERS
    from toma.kernels import triton_ops as ops

    torch_dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    seen: dict[str, dict] = {}
    observe = recorder(seen)
    meta_dev = torch.device("meta")
    LAUNCH_OBSERVERS.append(observe)
    try:
        with ops.dry_run():
            for (n, k), c, dt in ((t, c, d) for t in tiles for c in channels for d in dtypes):
                dtype = torch_dtypes[dt]
                t = 3  # tiles: more than one, so that no count is specialised to 1
                x = torch.empty(batch, t * n, c, dtype=dtype, device=meta_dev)
                rows = torch.empty(t, n, dtype=torch.int32, device=meta_dev)
                dst = torch.empty(t, k, dtype=torch.int32, device=meta_dev)
                mask = torch.empty(t, n, dtype=torch.int8, device=meta_dev)
                keep = torch.empty(t, dtype=torch.int32, device=meta_dev)
                variants = [(t, m, kp) for t in (0.1, 0.0) for m, kp in ((None, None), (mask, None), (mask, keep))]
                if corners:
                    variants = [(0.1, mask, keep), (0.0, None, None)]
                for temperature, tmask, tkeep in variants:
                    ops.plan_tiles(x, rows, k, temperature, dtype, tmask, tkeep)
                w = torch.empty(batch, t, k, n, dtype=dtype, device=meta_dev)
                merged = ops.merge_tokens(x, w, rows, dst, t * k)
                for residual in (None, x):
                    ops.unmerge_tokens(merged, w, rows, dst, t * n, residual)
    finally:
        LAUNCH_OBSERVERS.remove(observe)
    return list(seen.values())


def recorder(into: dict[str, dict]) -> Callable[[str, Any, tuple, dict], None]:
    """A launch observer (for :data:`toma.kernels.LAUNCH_OBSERVERS`) that keeps the
    :func:`record` of each distinct launch in ``into``, keyed by :func:`record_key`;
    stand-ins that are not jitted kernels (as tests put in) are left out."""

    def observe(name: str, kernel: Any, args: tuple, meta: dict) -> None:
        if hasattr(kernel, "fn"):
            rec = record(name, kernel, args, meta)
            into.setdefault(record_key(rec), rec)

    return observe


def record_key(rec: dict) -> str:
    """A stable identity of a record, to drop repeats."""
    return json.dumps(rec, sort_keys=True)


def compile_record(rec: dict, target_name: str) -> dict:
    """Compile ``rec`` for ``target_name``; returns ``{"shared", "limit", "fits", "seconds"}``
    or raises the compiler's error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    from toma.kernels import triton_ops

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile with TRITON_INTERPRET unset (run python -m toma.kernels.aot as a subprocess)")
    tgt = target(target_name)
    gpu = GPUTarget(tgt.backend, tgt.arch, tgt.warp)
    kernel = _kernel(rec["kernel"])
    names = [p.name for p in _params(kernel)]
    backend = make_backend(gpu)
    attrs = {(names.index(k),): backend.parse_attr(v) for k, v in rec["attrs"].items()}
    src = ASTSource(fn=kernel, signature=rec["signature"], constexprs=rec["constexprs"], attrs=attrs)
    start = time.perf_counter()
    compiled = triton.compile(src, target=gpu, options=dict(triton_ops._OPTIONS))
    shared = int(compiled.metadata.shared)
    return {
        "shared": shared,
        "limit": tgt.shared,
        "fits": shared <= tgt.shared,
        "seconds": round(time.perf_counter() - start, 2),
    }


def _kernel(name: str) -> Any:
    """A kernel by launch name (``"plan"``), or any jitted function as ``"module:attr"``."""
    import importlib

    from toma.kernels import triton_ops

    if ":" in name:
        module, attr = name.split(":")
        return getattr(importlib.import_module(module), attr)
    return triton_ops.KERNEL_FNS[name]


def _compile_one(job: tuple[dict, str]) -> dict:
    rec, target_name = job
    out: dict[str, Any] = {"target": target_name, "launch": describe(rec)}
    try:
        out.update(compile_record(rec, target_name))
    except Exception as err:  # reported, not raised: one bad launch should not hide the others
        out["error"] = f"{type(err).__name__}: {str(err).strip()[-2000:]}"
    return out


def describe(rec: dict) -> str:
    """One line naming a record's kernel, pointer dtypes and constexprs."""
    pointers = sorted({v for v in rec["signature"].values() if v.startswith("*")})
    consts = ",".join(f"{k}={v}" for k, v in rec["constexprs"].items())
    return f"{rec['kernel']}[{' '.join(pointers)}]({consts})"


def compile_all(records: list[dict], targets: list[str], jobs: int = 1) -> list[dict]:
    """Compile every record for every target, ``jobs`` processes at a time."""
    work = [(rec, t) for rec in records for t in targets]
    if jobs <= 1:
        return [_compile_one(w) for w in work]
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_compile_one, work))


def main(argv: list[str] | None = None) -> int:
    """Compile recorded launches; exit 1 if any fails to compile or does not fit its target
    (with ``--allow-misfit``, a launch that compiles but needs more shared memory than its
    target has only counts as one the fit check will send to the torch path)."""
    parser = argparse.ArgumentParser(prog="python -m toma.kernels.aot", description=main.__doc__)
    parser.add_argument("launches", nargs="?", help="JSON file: a list of launch records (toma.kernels.aot.record)")
    parser.add_argument(
        "--synthetic", default="", help="also compile synthetic_launches for these n:k tiles, e.g. 16:8,64:32"
    )
    parser.add_argument("--channels", default="3072", help="channel counts of the synthetic launches")
    parser.add_argument("--dtypes", default="fp32,fp16,bf16", help="dtypes of the synthetic launches")
    parser.add_argument("--targets", default=",".join(CI_TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    parser.add_argument("--jobs", type=int, default=1, help="compiles run at once")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--allow-misfit", action="store_true")
    args = parser.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    for t in targets:
        target(t)  # an unknown name fails here, before any compile
    records = []
    if args.launches:
        with open(args.launches) as f:
            records += json.load(f)
    if args.synthetic:
        tiles = [tuple(int(v) for v in pair.split(":")) for pair in args.synthetic.split(",")]
        records += synthetic_launches(tiles, [int(c) for c in args.channels.split(",")], args.dtypes.split(","))
    records = list({record_key(r): r for r in records}.values())
    start = time.perf_counter()
    results = compile_all(records, targets, args.jobs)
    failed = [r for r in results if "error" in r]
    misfit = [r for r in results if "error" not in r and not r["fits"]]
    for r in results:
        if "error" in r:
            print(f"FAIL {r['target']:8} {r['launch']}\n     {r['error'].splitlines()[-1]}")
        elif not r["fits"]:
            print(f"BIG  {r['target']:8} {r['launch']}: {r['shared']} > {r['limit']} bytes of shared memory")
    print(
        f"{len(records)} launches x {len(targets)} targets: {len(results) - len(failed)} compiled, "
        f"{len(failed)} failed, {len(misfit)} over their shared memory, in {time.perf_counter() - start:.0f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed or (misfit and not args.allow_misfit) else 0


if __name__ == "__main__":
    sys.exit(main())
