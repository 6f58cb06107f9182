"""``toma doctor``'s run: the environment, then each section of checks, then the verdict.

Imported by the subcommand only when it runs (it imports torch); triton and diffusers load
later still, after ``--kernels`` has set ``TOMA_KERNELS`` (and, for the CPU,
``TRITON_INTERPRET``, which triton reads as it loads).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from pathlib import Path
from typing import Iterator

import torch

from toma import kernels
from toma.tools.doctor import environment as env
from toma.tools.doctor.report import Outcome, Report, first_line

# sizes the kernels can go through in Triton's interpreter within seconds
INTERPRETER_SIZES = {"grid": (8, 8), "channels": 32, "attn_grid": (8, 8), "heads": 2, "head_dim": 16}
GPU_SIZES = {"grid": (64, 64), "channels": 3072, "attn_grid": (64, 64), "heads": 24, "head_dim": 128}
# the CPU keeps the merge grid (every tile of a 1024px image) at SD 1.5's first width, and
# attends over a 512px Flux image's 1024 tokens: 4096 would take ~4 s a call at 2 threads
CPU_SIZES = {**GPU_SIZES, "channels": 320, "attn_grid": (32, 32)}


def run(args: argparse.Namespace) -> int:
    """Run every check; print progress, the verdict line; write ``--json``. Returns the exit
    status: 0 when nothing failed, 1 when a check failed, 2 for bad arguments."""
    with _environment(args) as problem:
        if problem:
            print(f"toma doctor: error: {problem}", file=sys.stderr)
            return 2
        return _run(args)


@contextlib.contextmanager
def _environment(args: argparse.Namespace) -> Iterator[str | None]:
    """``TOMA_KERNELS`` (and ``TRITON_INTERPRET`` for the kernels on the CPU) as ``--kernels``
    asks, for this run only; yields an error message instead where that cannot be done."""
    saved = {name: os.environ.get(name) for name in (kernels.KERNELS_ENV, "TRITON_INTERPRET")}
    try:
        problem = None
        if args.kernels is not None:
            os.environ[kernels.KERNELS_ENV] = args.kernels
        try:
            mode = kernels.kernel_mode()
        except ValueError as err:
            problem = str(err)
        else:
            if mode == "triton" and _wants_cpu(args.device) and not env.interpreter_on():
                if env.triton_loaded():
                    problem = (
                        "--kernels triton on the CPU runs Triton's interpreter, which is switched on before "
                        "triton loads: set TRITON_INTERPRET=1 in the environment"
                    )
                else:
                    os.environ["TRITON_INTERPRET"] = "1"
        yield problem
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _wants_cpu(device: str) -> bool:
    text = device.strip().lower()
    return text == "cpu" or (text == "auto" and not torch.cuda.is_available())


def _run(args: argparse.Namespace) -> int:
    from toma.tools.doctor.attention import AttentionSetup, attention_checks, backend_checks, backend_names
    from toma.support import family_names, format_short
    from toma.tools.doctor.merge_checks import MergeSetup, kernel_checks, torch_path_checks

    try:
        device = env.resolve_device(args.device)
        json_path = _json_path(args.json_path)
        mode = kernels.kernel_mode()
        names = backend_names(args.backends)
    except ValueError as err:
        print(f"toma doctor: error: {err}", file=sys.stderr)
        return 2

    path, why = _path(device)
    # kernels on CPU tensors run in Triton's interpreter (TOMA_KERNELS=triton, or a test
    # that lets auto pick the CPU)
    interpreter = device.type == "cpu" and path != "torch" and env.interpreter_on()
    sizes = INTERPRETER_SIZES if interpreter else CPU_SIZES if device.type == "cpu" else GPU_SIZES
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else sizes[name]  # noqa: E731
    dtypes = tuple(getattr(torch, name) for name in args.dtypes)
    default_attn = torch.bfloat16 if device.type == "cuda" else torch.float32  # Flux's dtype on a GPU
    attn_dtype = getattr(torch, args.attn_dtype) if args.attn_dtype else default_attn
    repeats = args.repeats or (5 if device.type == "cuda" else 3)
    (h, w), (ah, aw) = pick("grid"), pick("attn_grid")

    report = Report()
    versions = env.versions()
    dev = env.device_info(device)
    report.say("toma doctor: does toma's merge path work on this machine?")
    report.say(f"versions: {env.format_versions(versions)}")
    for i, line in enumerate(env.format_device(dev)):
        report.say(("device:   " if i == 0 else "") + line)
    report.say(f"kernels:  {path}: {why}" + (" (Triton's interpreter: slow, tiny sizes)" if interpreter else ""))
    report.say(f"families: {format_short(family_names())}")

    merge = MergeSetup(device, h, w, pick("channels"), args.batch, args.tile, args.ratio, dtypes, args.seed)
    attn = AttentionSetup(
        device,
        ah,
        aw,
        pick("heads"),
        pick("head_dim"),
        args.attn_batch,
        attn_dtype,
        args.ratio,
        args.tile,
        repeats,
        args.seed,
    )
    size_note = ""
    if device.type == "cpu" and args.attn_grid is None and not interpreter:
        size_note = " (smaller than Flux's 4096 on the CPU; --attn-grid 64 for that)"
    elif interpreter:
        size_note = " (tiny: the kernels run in Triton's interpreter)"
    report.say(f"sizes:    merges {merge.describe()}, {', '.join(map(_dname, dtypes))}")
    report.say(f"          attention {attn.describe()}{size_note}")
    report.info = {
        "doctor": 1,
        "options": {k: v for k, v in vars(args).items() if k not in ("func", "command")},
        "versions": versions,
        "device": dev,
        "kernels": {"mode": mode, "path": path, "why": why, "interpreter": interpreter},
        "sizes": {
            "merge": {
                "grid": [h, w],
                "channels": merge.channels,
                "batch": merge.batch,
                "tile": args.tile,
                "ratio": args.ratio,
                "merged_tokens": merge.layout.num_merged,
                "temperature": merge.config.temperature,
                "dtypes": [_dname(d) for d in dtypes],
            },
            "attention": {
                "grid": [ah, aw],
                "heads": attn.heads,
                "head_dim": attn.head_dim,
                "batch": attn.batch,
                "dtype": _dname(attn_dtype),
                "repeats": repeats,
            },
        },
    }

    report.heading("torch path", "plans, merges and unmerges against a float64 reference")
    torch_path_checks(report, merge)

    report.heading("Triton kernels", "against the torch path on the same plans")
    reason = _kernel_skip(device, mode, path, why)
    if reason is None:
        kernel_checks(report, merge, interpreter)
        skipped = [r for r in report.results if r.section == "Triton kernels" and r.status == "skip"]
        if skipped:
            report.notes.append(f"{', '.join(r.name for r in skipped)} skipped")
    else:
        report.check("Triton kernels", lambda: _raise(reason))
        if reason.status == "skip":
            report.notes.append(_skip_note(device, mode))

    report.heading("attention", "merged against unmerged (torch SDPA)")
    report.notes.insert(0, f"merges on {dev['name'] if device.type == 'cuda' else 'the cpu'} take the {path} path")
    shared = attention_checks(report, attn, timings_mean_little=interpreter)

    report.heading("backends", "diffusers' attention backends on merged tokens, against float32 math SDPA")
    if not names:
        report.say("  none asked for (--backends none)")
    elif not shared:
        report.check("attention backends", lambda: _raise(Outcome("skip", "skipped: the merged attention did not run")))
    else:
        backend_checks(report, attn, shared, names, args.hub_backends)

    after, after_why = _path(device)
    report.info["kernels"].update(path_after=after, why_after=after_why)
    if (after, after_why) != (path, why):
        report.say()
        report.say(f"kernels after the checks: {after}: {after_why}")
    for r in report.results:
        if r.status == "fallback":
            report.notes.append(f"fallback: {r.detail}")

    code, line = report.verdict()
    if json_path is not None:
        report.write_json(json_path)
    report.say()
    if json_path is not None:
        report.say(f"wrote {json_path}")
    report.say(line)
    return code


def _raise(outcome: Outcome) -> None:
    raise outcome


def _dname(dtype: torch.dtype) -> str:
    from toma.tools.doctor.numerics import dtype_name

    return dtype_name(dtype)


def _json_path(text: str | None) -> Path | None:
    if text is None:
        return None
    path = Path(text)
    if path.is_dir():
        raise ValueError(f"--json: {text} is a folder; give a file name")
    if not path.parent.exists():
        raise ValueError(f"--json: the folder {path.parent} does not exist")
    return path


def _path(device: torch.device) -> tuple[str, str]:
    """:func:`toma.kernels.describe_path`, its warnings (the first use of a GPU tries each
    kernel) folded into the reason rather than printed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, why = kernels.describe_path(device)
    said = [first_line(str(w.message)) for w in caught if "toma:" in str(w.message)]
    return path, why + ("" if not said else " [" + " ".join(said) + "]")


def _kernel_skip(device: torch.device, mode: str, path: str, why: str) -> Outcome | None:
    """Why the kernel checks cannot run (an :class:`Outcome` to report), or None when they can."""
    if path != "torch":
        return None
    if mode == "torch":
        return Outcome("skip", f"skipped: {why} (the torch path is what runs; --kernels auto to check the kernels)")
    if not kernels.triton_available():
        where = "" if device.type == "cpu" else "; pip install triton (CUDA builds of torch bring it)"
        return Outcome("skip", f"skipped: triton is not installed{where}")
    if device.type != "cuda":
        return Outcome(
            "skip",
            f"skipped: no GPU here ({why}); --kernels triton runs them in Triton's interpreter (slow, tiny sizes)",
        )
    if "every kernel failed" in why:
        return Outcome("fallback", f"every Triton kernel takes the torch path: {why}")
    return Outcome("skip", f"skipped: {why}")


def _skip_note(device: torch.device, mode: str) -> str:
    """The verdict's word on skipped kernel checks."""
    if mode == "torch":
        return "kernel checks skipped (TOMA_KERNELS=torch)"
    if device.type != "cuda":
        why = env.no_gpu_reason() if not torch.cuda.is_available() else "a cpu device was asked for"
        return f"GPU kernel checks skipped: no GPU ({why})"
    return "kernel checks skipped (triton not installed)" if not kernels.triton_available() else "kernel checks skipped"
