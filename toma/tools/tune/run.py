"""The measuring behind ``toma tune`` (what it does, its quality check and exit status:
:mod:`toma.tools.tune`, which holds the command line)."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from toma.tools.archs import (
    DEPTH_KEYS,
    STACKS,
    Arch,
    build_model,
    call_denoiser,
    get_arch,
    latent_frames,
    make_inputs,
    set_timestep,
    token_grid,
)
from toma.tools.bench.harness import Measurement, MethodPatcher, Variant, compile_variants, progress_bar, time_rounds
from toma.tools.bench.report import derive
from toma.tools.common.options import DTYPES, check_tile_size
from toma.tools.common.report import cell, check_output, processor_name
from toma.tools.tune.constants import DEFAULT_MIN_PSNR

PARTS = ("attn", "cross", "mlp")
NONE = Variant("none", None)


@dataclass
class Candidate:
    """One ToMA setting tried: its timed variant, what it merges and its fidelity."""

    variant: Variant
    merged: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    psnr: float | None = None  # dB against unpatched; None until checked

    @property
    def label(self) -> str:
        return self.variant.label


@dataclass
class Setup:
    """The checked options of one run."""

    arch: Arch
    builtin: bool
    resolution: int
    batch: int
    dtype: torch.dtype
    device: torch.device
    ratios: list[float]
    places: list[Any]  # UNet levels (int) or transformer block choices ("default", "all")
    parts: list[frozenset[str]]
    mlp_ratios: list[float | None]
    min_psnr: float | None
    max_psnr_drop: float | None


def run(args: argparse.Namespace) -> int:
    """Run ``toma tune`` on parsed ``args``; returns the exit code."""
    try:
        setup = _options(args)
    except (ValueError, TypeError) as err:
        print(f"toma tune: error: {err}", file=sys.stderr)
        return 2
    return _tune(args, setup)


# ---------------------------------------------------------------------------- options


def _options(args: argparse.Namespace) -> Setup:
    """Check every argument before any work; raises ValueError naming the option."""

    builtin = args.arch is None
    if builtin and args.model is not None:
        raise ValueError("--model needs --arch (the denoiser class and its inputs); the default is the built-in model")
    if not builtin and args.builtin_path is not None:
        raise ValueError("--builtin-path applies to the built-in model; drop it or --arch")
    arch = BUILTIN_ARCH if builtin else get_arch(args.arch)
    for name in ("depth", "steps", "repeats", "check_images", "check_steps", "compile_top"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0; got {args.warmup}")
    if args.freezing and not args.compile:
        raise ValueError("--freezing applies to compiled rows: add --compile")
    if args.depth != 1 and arch.family not in DEPTH_KEYS:
        raise ValueError(f"--depth applies to transformers ({', '.join(DEPTH_KEYS)}); {arch.name} is a {arch.family}")
    if args.frames is not None and not arch.frames:
        raise ValueError(f"--frames applies to video archs; {arch.name} draws images")
    latent_frames(arch, args.frames)  # checks --frames
    batch = args.batch if args.batch is not None else (2 if builtin else 1)
    if batch < 1:
        raise ValueError(f"--batch must be >= 1; got {batch}")
    resolution = args.resolution or arch.resolution
    make_inputs(arch, resolution, 1, frames=args.frames, device="meta")  # checks --resolution
    ratios = _split(args.ratios, "--ratios", float)
    if any(not 0 < r < 1 for r in ratios):
        raise ValueError(f"--ratios must lie in (0, 1); got {args.ratios}")
    unet = arch.family == "unet"
    if unet:
        if args.blocks is not None:
            raise ValueError("--blocks applies to transformers; UNets take --levels")
        places: list[Any] = _split(args.levels or "1,2", "--levels", int)
        if any(v < 1 for v in places):
            raise ValueError(f"--levels must be >= 1; got {args.levels}")
    else:
        if args.levels is not None:
            raise ValueError(f"--levels applies to UNets; {arch.name} takes --blocks (default, all)")
        places = _split(args.blocks or "default,all", "--blocks", str)
        if any(v not in ("default", "all") for v in places):
            raise ValueError(f"--blocks must be drawn from default,all; got {args.blocks}")
    default_parts = "attn" if arch.family == "flux" else "attn,attn+mlp"
    parts = []
    for item in _split(args.parts or default_parts, "--parts", str):
        chosen = frozenset(item.split("+"))
        if not chosen or not chosen <= set(PARTS) or len(chosen) != len(item.split("+")):
            raise ValueError(f"--parts entries must join distinct {', '.join(PARTS)} with '+'; got {item!r}")
        if arch.family == "flux" and chosen != {"attn"}:
            raise ValueError(f"--parts: Flux merges attention only; got {item!r}")
        parts.append(chosen)
    mlp_ratios: list[float | None] = []
    for item in _split(args.mlp_ratios, "--mlp-ratios", str):
        if item == "same":
            mlp_ratios.append(None)
            continue
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"--mlp-ratios must hold 'same' or numbers in (0, 1); got {item!r}") from None
        if not 0 < value < 1:
            raise ValueError(f"--mlp-ratios must hold 'same' or numbers in (0, 1); got {item!r}")
        mlp_ratios.append(value)
    check_tile_size(args.tile_size)
    if args.min_psnr is not None and not math.isfinite(args.min_psnr):
        raise ValueError(f"--min-psnr must be a finite number of dB; got {args.min_psnr}")
    if args.max_psnr_drop is not None and not (math.isfinite(args.max_psnr_drop) and args.max_psnr_drop >= 0):
        raise ValueError(f"--max-psnr-drop must be a finite number of dB >= 0; got {args.max_psnr_drop}")
    min_psnr = DEFAULT_MIN_PSNR if args.min_psnr is None and args.max_psnr_drop is None else args.min_psnr
    if args.budget_s is not None and not args.budget_s > 0:
        raise ValueError(f"--budget-s must be > 0; got {args.budget_s}")
    if args.device == "auto":
        device = torch.device("cpu" if builtin or not torch.cuda.is_available() else "cuda")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise ValueError(f"--device must be cpu, cuda, cuda:N or auto; got {args.device!r}") from None
    if builtin and device.type != "cpu":
        raise ValueError(f"the built-in model's sampler runs on the CPU; got --device {args.device}")
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif args.dtype in DTYPES:
        dtype = getattr(torch, DTYPES[args.dtype])  # DTYPES holds names: the CLI imports it without torch
    else:
        raise ValueError(f"--dtype must be one of auto, {', '.join(DTYPES)}; got {args.dtype!r}")
    if builtin and dtype != torch.float32:
        raise ValueError(f"the built-in model runs in float32; got --dtype {args.dtype}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1; got {args.threads}")
    if args.out.suffix.lower() != ".json":
        raise ValueError(f"--out must be a .json file; got {str(args.out)!r}")
    check_output(args.out, "--out", folder=False)
    return Setup(
        arch, builtin, resolution, batch, dtype, device, ratios, places, parts, mlp_ratios, min_psnr, args.max_psnr_drop
    )


def _split(text: str, option: str, kind: Callable[[str], Any]) -> list[Any]:
    try:
        items = [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{option} must be a comma-separated list; got {text!r}") from None
    if not items:
        raise ValueError(f"{option} must not be empty")
    return list(dict.fromkeys(items))


# the built-in digits UNet as an arch: pixel space (no VAE), 4 conditioning tokens of width 64
BUILTIN_ARCH = Arch("builtin", "unet", {"in_channels": 1}, 32, 4, 64, 0, 1, "built-in digits UNet", patch=1)


# ---------------------------------------------------------------------------- candidates


def candidates(setup: Setup, model: torch.nn.Module) -> list[Variant]:
    """The candidate settings as variants, ToMA's default setting at ratio 0.5 first."""
    family = setup.arch.family
    out: list[Variant] = []

    def place_options(place: Any) -> tuple[tuple[str, Any], ...]:
        if family == "unet":
            return (("levels", place),)
        if place == "all":
            return (("blocks", tuple((s, tuple(range(len(model.get_submodule(s))))) for s in STACKS[family])),)
        return ()  # the harness's default blocks

    def add(ratio: float, place: Any, parts: frozenset[str], mlp_ratio: float | None) -> None:
        options = place_options(place) + (
            ("merge_attn", "attn" in parts),
            ("merge_crossattn", "cross" in parts),
            ("merge_mlp", "mlp" in parts),
        )
        if mlp_ratio is not None and mlp_ratio != ratio:
            options += (("mlp_ratio", mlp_ratio),)
        where = f"L{place}" if family == "unet" else str(place)
        what = "+".join(p for p in PARTS if p in parts)
        if "mlp" in parts and mlp_ratio is not None and mlp_ratio != ratio:
            what += f"({mlp_ratio:g})"
        variant = Variant("toma", ratio, options=options, name=f"{where} {what} @{ratio:g}")
        if variant not in out:
            out.append(variant)

    out.append(DEFAULT_VARIANTS[family == "unet"])
    for place in setup.places:
        for parts in setup.parts:
            for ratio in setup.ratios:
                for mlp_ratio in setup.mlp_ratios if "mlp" in parts else [None]:
                    add(ratio, place, parts, mlp_ratio)
    return out


def resolve(harness: MethodPatcher, variants: list[Variant], log: Callable[[str], None]) -> list[Candidate]:
    """Apply each variant once to learn what it merges; drop those that merge what an earlier
    one merges at the same settings, or that the model refuses (each said in ``log``)."""
    import toma
    from toma.tuned import model_key

    seen: dict[str, str] = {}
    out = []
    for v in variants:
        try:
            harness.apply(v)
            patch = toma.get_toma(harness.model)
            merged = [p.name for p in patch.patched]
            settings = patch.config.to_dict()
        except (TypeError, ValueError) as err:
            log(f"skipping {v.label}: {err}")
            continue
        finally:
            harness.remove()
        key = model_key(harness.model, merged, settings)
        if key in seen:
            log(f"skipping {v.label}: it merges what {seen[key]} merges, at the same settings")
            continue
        seen[key] = v.label
        out.append(Candidate(v, merged, settings))
    return out


# ---------------------------------------------------------------------------- quality check


def psnr_against(reference: torch.Tensor, output: torch.Tensor) -> float:
    """PSNR in dB of ``output`` against ``reference`` (any equal shapes), the reference's value
    range as peak: ``10 log10(range^2 / MSE)``; inf when equal."""
    ref, out = reference.double(), output.double()
    mse = float((out - ref).pow(2).mean())
    peak = float(ref.max() - ref.min())
    if mse == 0:
        return math.inf
    return 10 * math.log10(peak**2 / mse) if peak > 0 else -math.inf


def check_description(setup: Setup, args: argparse.Namespace, guidance: float | None) -> str:
    """What the quality check measures, for the table and the config's provenance."""
    if setup.builtin:
        return (
            f"mean PSNR of {args.check_images} digits sampled with the built-in DDIM sampler "
            f"({args.check_steps} steps, guidance {guidance:g}, seeds {args.seed}..) against unpatched"
        )
    weights = "real weights" if args.model else "random weights, so it says little about images"
    return (
        f"PSNR of the denoiser output on the timed inputs ({args.steps} timestep(s), random latents and text, "
        f"seed {args.seed}) against unpatched, peak = its range; {weights}"
    )


def _first(output: Any) -> torch.Tensor:
    """The prediction tensor of a denoiser call's output (tuple, output object or tensor)."""
    if isinstance(output, (tuple, list)):
        return output[0]
    return getattr(output, "sample", output)


def _check(
    setup: Setup,
    args: argparse.Namespace,
    harness: MethodPatcher,
    cands: list[Candidate],
    call: Callable[[dict[str, Any]], Any],
    inputs: list[dict[str, Any]],
    builtin_model: Any,
    bar: Any,
) -> None:
    """Fill in each candidate's PSNR against the unpatched model (see :func:`check_description`)."""
    from toma.tools.eval.metrics import psnr

    def output() -> torch.Tensor:
        if builtin_model is not None:
            from toma.tools.builtin.unet import NUM_CLASSES, sample

            n = args.check_images
            return sample(
                builtin_model,
                [i % NUM_CLASSES for i in range(n)],
                list(range(args.seed, args.seed + n)),
                steps=args.check_steps,
                progress=False,
            )
        return torch.cat([_first(call(step)).flatten() for step in inputs])

    bar.set_postfix_str("quality check: unpatched")
    reference = output()
    bar.update(1)
    for c in cands:
        bar.set_postfix_str(f"quality check: {c.label}")
        harness.apply(c.variant)
        try:
            out = output()
        finally:
            harness.remove()
        # built-in: the mean over images of each image's PSNR, as toma eval reports it
        c.psnr = float(psnr(out, reference).mean()) if builtin_model is not None else psnr_against(reference, out)
        bar.update(1)


def quality_bound(setup: Setup, cands: list[Candidate]) -> tuple[float | None, str]:
    """The least PSNR a candidate needs, and the bound in words. None: no candidate can meet it
    (``--max-psnr-drop`` without a checked default setting)."""
    floor, words = -math.inf, []
    if setup.min_psnr is not None:
        floor, words = setup.min_psnr, [f"PSNR >= {setup.min_psnr:g} dB"]
    if setup.max_psnr_drop is not None:
        default = next((c for c in cands if c.variant == DEFAULT_VARIANTS.get(setup.arch.family == "unet")), None)
        if default is None or default.psnr is None:
            return None, " and ".join(
                words + [f"PSNR within {setup.max_psnr_drop:g} dB of the default setting's (not measured)"]
            )
        floor = max(floor, default.psnr - setup.max_psnr_drop)
        words.append(f"PSNR >= {default.label}'s {default.psnr:.1f} - {setup.max_psnr_drop:g} dB")
    return floor, " and ".join(words)


# ToMA's default setting at ratio 0.5 (UNet: True, transformers: False): always a candidate
DEFAULT_VARIANTS = {
    True: Variant(
        "toma",
        0.5,
        options=(("levels", 1), ("merge_attn", True), ("merge_crossattn", False), ("merge_mlp", False)),
        name="L1 attn @0.5",
    ),
    False: Variant(
        "toma",
        0.5,
        options=(("merge_attn", True), ("merge_crossattn", False), ("merge_mlp", False)),
        name="default attn @0.5",
    ),
}


def _compile_picks(
    setup: Setup, cands: list[Candidate], results: dict[tuple[Variant, int], Measurement], batch: int, top: int
) -> list[Candidate]:
    """The ``top`` fastest eager candidates within the quality bound (by median)."""
    import statistics

    floor, _ = quality_bound(setup, cands)
    ok = [
        c
        for c in cands
        if floor is not None and c.psnr is not None and c.psnr >= floor and results[(c.variant, batch)].times
    ]
    return sorted(ok, key=lambda c: statistics.median(results[(c.variant, batch)].times))[:top]


def _rows(results: dict[tuple[Variant, int], Measurement], cands: list[Candidate]) -> list[dict[str, Any]]:
    """Result rows with bench's statistics (median, speedup over unpatched in the same mode, spread
    flags) and each candidate's PSNR."""
    psnr = {c.variant.name: c.psnr for c in cands}
    rows = [
        {
            "method": v.name or v.method,
            "ratio": v.ratio,
            "batch": b,
            "compiled": v.compiled,
            "times_s": m.times,
            "psnr_db": psnr.get(v.name),
        }
        for (v, b), m in results.items()
        if m.times
    ]
    if rows:
        derive(rows, rows[0]["batch"])
    for r in rows:
        r["reliable"] = not r["flags"] and len(r["times_s"]) >= 2
    return rows


def choose(
    setup: Setup, cands: list[Candidate], rows: list[dict[str, Any]], compiled: bool
) -> tuple[Candidate, dict[str, Any]] | None:
    """The candidate with the largest speedup over unpatched (compiled rows when ``compiled``
    and measured) among those within the quality bound and faster than unpatched, with its row."""
    floor, _ = quality_bound(setup, cands)
    if floor is None:
        return None
    mode = compiled and any(r["compiled"] and r["method"] != "none" for r in rows)
    by_name = {c.variant.name: c for c in cands}
    ok = [
        r
        for r in rows
        if r["method"] in by_name
        and r["compiled"] == mode
        and r["speedup"] is not None
        and r["speedup"] > 1
        and r["psnr_db"] is not None
        and r["psnr_db"] >= floor
    ]
    if not ok:
        return None
    best = max(ok, key=lambda r: r["speedup"])
    return by_name[best["method"]], best


def format_table(
    setup: Setup,
    args: argparse.Namespace,
    cands: list[Candidate],
    rows: list[dict[str, Any]],
    choice: tuple[Candidate, dict[str, Any]] | None,
    notes: list[str],
    check: str,
) -> str:
    """The measurements as a text table, with the conditions, the bound and the verdict."""
    floor, bound = quality_bound(setup, cands)
    lines = [
        f"toma tune: {_model_name(setup, args)}, {setup.resolution}px, batch {setup.batch}, "
        f"{str(setup.dtype).replace('torch.', '')}, {setup.device} ({_device_name(setup.device)}), "
        f"{torch.get_num_threads()} torch threads",
        f"  timing: {args.steps} forward(s) per sample, up to {args.repeats} samples per setting after "
        f"{args.warmup} warm-up round(s), interleaved with unpatched",
        f"  quality check: {check}",
        f"  quality bound: {bound}",
    ]
    lines += [f"  note: {n}" for n in notes]
    head = (
        f"{'':2}{'setting':<28}{'mode':>9}{'median s':>10}{'min s':>9}{'max s':>9}{'n':>3}{'speedup':>9}"
        f"{'PSNR dB':>9}  within bound"
    )
    lines += ["", head, "-" * len(head)]
    chosen = choice[1] if choice else None
    psnr_only = {c.variant.name for c in cands} - {r["method"] for r in rows}
    for r in sorted(rows, key=lambda r: (r["compiled"], r["method"] != "none", -(r["speedup"] or 0))):
        inside = (
            ""
            if r["method"] == "none"
            else ("yes" if floor is not None and r["psnr_db"] is not None and r["psnr_db"] >= floor else "no")
        )
        flag = (
            "" if r["reliable"] or r["method"] == "none" else "  (noisy: " + "; ".join(r["flags"] or ["1 sample"]) + ")"
        )
        lines.append(
            f"{'* ' if r is chosen else '  '}{r['method']:<28}{'compiled' if r['compiled'] else 'eager':>9}"
            f"{r['median_s']:>10.4f}{r['min_s']:>9.4f}{r['max_s']:>9.4f}{len(r['times_s']):>3}"
            f"{cell(r['speedup'], '{:.3f}x'):>9}{cell(r['psnr_db'], '{:.1f}'):>9}  {inside}{flag}"
        )
    for c in cands:
        if c.variant.name in psnr_only:
            lines.append(f"  {c.label:<28}{'-':>9}{'':>40}{cell(c.psnr, '{:.1f}'):>9}  not timed")
    lines.append("")
    if choice is not None:
        cand, row = choice
        lines.append(
            f"fastest within the bound: {cand.label} ({'compiled' if row['compiled'] else 'eager'}), "
            f"{row['speedup']:.3f}x, PSNR {row['psnr_db']:.1f} dB"
            + (
                ""
                if row["reliable"]
                else "; its samples spread more than the speedup: re-run on a quieter "
                "machine or with more --repeats before trusting it"
            )
        )
    elif not cands:
        lines.append("no candidate setting could be applied to this model (see the 'skipping' lines above)")
    elif floor is None:
        lines.append(f"no candidate can meet the bound ({bound})")
    elif not any(r["psnr_db"] is not None and r["psnr_db"] >= floor for r in rows if r["method"] != "none"):
        lines.append(f"no candidate meets the quality bound ({bound})")
    else:
        compiled = args.compile and any(r["compiled"] and r["method"] != "none" for r in rows)
        lines.append(
            f"no candidate within the quality bound is faster than unpatched{' (compiled)' if compiled else ''} "
            "on this machine: ToMA does not pay here at these settings"
        )
    return "\n".join(lines)


def _model_name(setup: Setup, args: argparse.Namespace) -> str:
    if setup.builtin:
        return "built-in digits UNet"
    depth = f", 1/{args.depth} depth" if args.depth != 1 else ""
    return f"{setup.arch.description}{depth} ({args.model if args.model else 'random weights'})"


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else processor_name()


def _record_entries(
    setup: Setup,
    args: argparse.Namespace,
    cands: list[Candidate],
    rows: list[dict[str, Any]],
    measured_at: str,
    model: torch.nn.Module,
) -> list[dict[str, Any]]:
    """One tune record per measured candidate row (see :mod:`toma.tuned`)."""
    from toma.tuned import model_key

    by_name = {c.variant.name: c for c in cands}
    grid = list(token_grid(setup.arch, setup.resolution, args.frames))
    out = []
    for r in rows:
        c = by_name.get(r["method"])
        if c is None or r["speedup"] is None:
            continue
        out.append(
            {
                "key": model_key(model, c.merged, c.settings),
                "denoiser": type(model).__name__,
                "model": _model_name(setup, args),
                "grid": grid,
                "batch": setup.batch,
                "mode": "compiled" if r["compiled"] else "eager",
                "speedup": r["speedup"],
                "median_s": r["median_s"],
                "samples": len(r["times_s"]),
                "reliable": r["reliable"],
                "psnr_db": r["psnr_db"],
                "setting": c.label,
                "settings": c.settings,
                "measured_at": measured_at,
            }
        )
    return out


def _provenance(
    setup: Setup,
    args: argparse.Namespace,
    cand: Candidate,
    row: dict[str, Any],
    rows: list[dict[str, Any]],
    measured_at: str,
    model: torch.nn.Module,
    interrupted: bool,
    check: str,
    bound: str,
) -> dict[str, Any]:
    """What the written config was chosen from: the machine, model, inputs, timing and check."""
    from toma import __version__

    base = next(r for r in rows if r["method"] == "none" and r["compiled"] == row["compiled"])
    return {
        "tool": "toma tune",
        "toma_version": __version__,
        "measured_at": measured_at,
        "setting": cand.label,
        "mode": "compiled" if row["compiled"] else "eager",
        "speedup": row["speedup"],
        "median_s": row["median_s"],
        "unpatched_median_s": base["median_s"],
        "samples": len(row["times_s"]),
        "reliable": row["reliable"],
        "interrupted": interrupted,
        "psnr_db": row["psnr_db"],
        "quality_check": check,
        "quality_bound": bound,
        "model": _model_name(setup, args),
        "denoiser": type(model).__name__,
        "resolution": setup.resolution,
        "grid": list(token_grid(setup.arch, setup.resolution, args.frames)),
        "batch": setup.batch,
        "dtype": str(setup.dtype).replace("torch.", ""),
        "device": str(setup.device),
        "device_name": _device_name(setup.device),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "candidates": len({r["method"] for r in rows}) - 1,
    }


# ---------------------------------------------------------------------------- the run


class Budget:
    """``--budget-s`` as the harness's ``stop``: True when the next round, as long as the mean
    round so far, would end past ``seconds`` after ``start`` (``time.perf_counter()``)."""

    def __init__(self, seconds: float, start: float, warmup: int) -> None:
        self.seconds, self.start = seconds, start
        self.began = time.perf_counter()  # rounds are timed from here
        self.rounds = warmup  # the harness first asks after the warm-up rounds and one timed round

    def __call__(self) -> bool:
        self.rounds += 1
        now = time.perf_counter()
        return now - self.start + (now - self.began) / self.rounds > self.seconds


def _tune(args: argparse.Namespace, setup: Setup) -> int:
    log = print
    if args.threads is not None or setup.builtin:
        torch.set_num_threads(args.threads or 1)
    arch, b = setup.arch, setup.batch
    builtin_model = None
    if setup.builtin:
        from toma.tools.builtin.unet import load_builtin

        builtin_model = load_builtin() if args.builtin_path is None else load_builtin(args.builtin_path)
        model = builtin_model.unet
        log(f"built-in digits UNet, batch {b}, float32 on cpu")
    else:
        log(
            f"building {arch.description} ({'weights from ' + args.model if args.model else 'random weights'}) "
            f"in {str(setup.dtype).replace('torch.', '')} on {setup.device}"
        )
        model = build_model(
            arch, depth=args.depth, model_path=args.model, dtype=setup.dtype, device=setup.device, seed=args.seed
        )
    start = time.perf_counter()
    placement = {"levels": 1, "merge_mlp": False, "tile_size": args.tile_size}
    harness = MethodPatcher(model, arch, placement, {}, None)
    step_inputs = {
        b: [
            set_timestep(
                arch,
                make_inputs(arch, setup.resolution, b, setup.dtype, setup.device, args.seed, args.frames),
                s,
                args.steps,
            )
            for s in range(args.steps)
        ]
    }

    def call(inputs: dict[str, Any]) -> Any:
        return call_denoiser(arch, model, inputs)

    cands = resolve(harness, candidates(setup, model), log)
    variants = [NONE] + [c.variant for c in cands]
    results = {(v, b): Measurement(v, b) for v in variants}
    interrupted = stopped = False
    total = len(cands) + 1 + len(variants) * (args.warmup + args.repeats)
    if args.compile:  # unpatched and up to --compile-top candidates, compiled
        total += (1 + min(args.compile_top, len(cands))) * (args.warmup + args.repeats)
    bar = progress_bar(total, not args.no_progress, desc="toma tune")
    notes: list[str] = []
    try:
        with torch.inference_mode():
            _check(setup, args, harness, cands, call, step_inputs[b], builtin_model, bar)
            budget = None if args.budget_s is None else Budget(args.budget_s, start, args.warmup)
            stopped = time_rounds(
                harness,
                call,
                variants,
                [b],
                step_inputs,
                args.warmup,
                args.repeats,
                setup.device,
                results,
                {},
                bar,
                stop=budget,
            )
            if stopped:
                notes.append(
                    f"--budget-s {args.budget_s:g}: timing stopped after {len(results[(NONE, b)].times)} round(s)"
                )
            if args.compile:
                if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                    notes.append("--compile skipped: the --budget-s was spent")
                else:
                    picked = _compile_picks(setup, cands, results, b, args.compile_top)
                    bar.set_postfix_str("compiling")
                    # compiled rows interleave with each other (the eager ones are done)
                    compiled = compile_variants(
                        harness,
                        [NONE] + [c.variant for c in picked],
                        [b],
                        step_inputs,
                        args.warmup,
                        setup.device,
                        log,
                        args.freezing,
                    )
                    results.update({(v, b): Measurement(v, b) for v in compiled})
                    time_rounds(
                        harness,
                        call,
                        list(compiled),
                        [b],
                        step_inputs,
                        args.warmup,
                        args.repeats,
                        setup.device,
                        results,
                        {},
                        bar,
                        fixed=compiled,
                    )
    except KeyboardInterrupt:
        interrupted = True
        harness.remove()
        notes.append("interrupted: the table holds what was measured")
    finally:
        bar.close()
    rows = _rows(results, cands)
    choice = choose(setup, cands, rows, compiled=args.compile)
    check = check_description(setup, args, builtin_model.guidance_scale if builtin_model is not None else None)
    print(format_table(setup, args, cands, rows, choice, notes, check))
    measured_at = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    if not args.no_record and rows:
        from toma.tuned import record

        path = record(_record_entries(setup, args, cands, rows, measured_at, model))
        print(f"recorded {sum(r['method'] != 'none' for r in rows)} measurement(s) in {path}")
    if choice is None:
        if args.out.exists():
            print(f"wrote no config; {args.out} was left as it was")
        else:
            print("wrote no config")
        return 130 if interrupted else 1
    cand, row = choice
    from toma import ToMAConfig

    config = ToMAConfig(**cand.settings)
    provenance = _provenance(
        setup, args, cand, row, rows, measured_at, model, interrupted, check, quality_bound(setup, cands)[1]
    )
    config.save(args.out, provenance=provenance)
    print(f"wrote {args.out}: apply it with toma.apply_toma(pipe, config=toma.load_config({str(args.out)!r}))")
    return 130 if interrupted else 0
