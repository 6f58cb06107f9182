"""The timing harness of ``toma bench``: variants, their timed samples and profiles.

:func:`benchmark` builds one denoiser, applies each method in turn
(:class:`MethodPatcher`) and times denoiser forwards round by round, interleaved, so
that a slow spell of a shared machine hits every variant alike; optionally as CUDA graph
replays or under torch.compile. It returns the report dict of :mod:`toma.tools.bench.report`.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from toma.tools.archs import (
    STACKS,
    Arch,
    build_model,
    call_denoiser,
    count_parameters,
    default_placement,
    latent_frames,
    make_inputs,
    set_timestep,
)
from toma.tools.bench.constants import OVERHEAD_PARTS, split_method
from toma.tools.bench.report import RunConditions, build_report
from toma.tools.opcount import count_kernels


# --clock: wall time, or the CPU time of this process (steadier on a shared machine at one
# thread; with more threads it adds theirs up)
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass(frozen=True)
class Variant:
    """One timed configuration: a method at a ratio (None for the unpatched model).

    ``options`` are ToMA settings of this variant on top of the harness's placement and
    options (``(("levels", 2), ("merge_mlp", True))``), and ``name`` its label; ``toma tune``
    times several ToMA settings at one ratio this way.
    """

    method: str
    ratio: float | None
    compiled: bool = False
    options: tuple[tuple[str, Any], ...] = ()
    name: str | None = None

    @property
    def label(self) -> str:
        """Readable name, e.g. ``toma@0.5`` or ``none+compile``."""
        name = self.name or (self.method if self.ratio is None else f"{self.method}@{self.ratio:g}")
        return name + ("+compile" if self.compiled else "")


@dataclass
class Measurement:
    """Per-forward seconds of one variant at one batch size, and its overhead profile."""

    variant: Variant
    batch: int
    times: list[float] = field(default_factory=list)
    overhead: dict[str, float] | None = None  # part -> share of the forward
    kernels: int | None = None  # kernel-launching ops in one forward


class MethodPatcher:
    """Applies and removes each method on one model."""

    def __init__(
        self,
        model: torch.nn.Module,
        arch: Arch,
        placement: dict[str, Any],
        toma_options: dict[str, Any],
        tomesd_max_downsample: int | None,
        cache_options: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.model = model
        self.arch = arch
        self.placement = {k: v for k, v in placement.items() if v is not None}
        if arch.family in STACKS:  # transformers: no levels; the default blocks, scaled to --depth
            self.placement.pop("levels", None)
            self.placement.update(default_placement(arch, model))
        self.toma_options = toma_options
        self.tomesd_max_downsample = tomesd_max_downsample
        self.cached = False  # whether a diffusers cache is enabled on the model now
        self.cache_options = cache_options or {}

    def unavailable(self, method: str) -> str | None:
        """Why ``method`` (e.g. ``toma`` or ``toma+fbcache``) cannot run here, or None."""
        from toma.tools.baselines import tomesd_available

        method, cache = split_method(method)
        if cache is not None:
            if not hasattr(self.model, "enable_cache"):
                return f"{cache} is a diffusers cache for transformers; {type(self.model).__name__} cannot take it"
            try:  # a family diffusers has not registered the blocks of refuses here
                self.model.enable_cache(cache_config(cache, **self.cache_options.get(cache, {})))
                self.model.disable_cache()
            except Exception as e:  # noqa: BLE001 -- diffusers raises various types
                return f"diffusers' {cache} does not support {type(self.model).__name__}: {e}"
        if method in ("tomesd", "todo") and self.arch.family != "unet":
            return f"{method} supports UNets only"
        if method == "tomesd" and not tomesd_available():
            return "tomesd is not installed (pip install 'toma-diffusion[peers]')"
        return None

    def apply(self, variant: Variant) -> dict[str, Any]:
        """Patch the model for ``variant``; returns the settings in force."""
        import toma
        from toma.tools import baselines

        r, (m, cache) = variant.ratio, split_method(variant.method)
        if m == "none":
            settings: dict[str, Any] = {}
        elif m == "toma":
            # measuring a setting is no reason to warn that it was measured slower
            patch = toma.apply_toma(
                self.model,
                ratio=r,
                warn_slower=False,
                **{**self.placement, **self.toma_options, **dict(variant.options)},
            )
            settings = {"merged_modules": len(patch.patched), **patch.config.to_dict()}
        else:
            if m == "ideal":
                patch = baselines.apply_ideal(self.model, r, **self.placement)
            elif m == "todo":
                patch = baselines.apply_todo(self.model, r, **self.placement)
            else:
                patch = baselines.apply_tomesd(self.model, r, self.tomesd_max_downsample, **self.placement)
            settings = {"merged_modules": len(patch.patched), **patch.settings}
        if cache is not None:
            # enabled per sample: each timed sample is a fresh run with a fresh cache state
            config = cache_config(cache, **self.cache_options.get(cache, {}))
            self.model.enable_cache(config)
            self.cached = True
            settings["cache"] = repr(config)
        return settings

    def remove(self) -> None:
        """Undo whatever is applied."""
        import toma
        from toma.tools import baselines

        toma.remove_toma(self.model)
        baselines.remove_baseline(self.model)
        if self.cached:
            self.model.disable_cache()
            self.cached = False


def cache_config(name: str, **options: Any) -> Any:
    """diffusers' config for a cache named in ``--methods`` (``fbcache``, ``taylorseer``): its
    defaults, overridden by ``options``."""
    from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

    return {"fbcache": FirstBlockCacheConfig, "taylorseer": TaylorSeerCacheConfig}[name](**options)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_sample(
    call: Callable[[dict[str, Any]], Any],
    inputs: list[dict[str, Any]],
    device: torch.device,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds per forward over one run of ``len(inputs)`` consecutive steps, read on ``clock``."""
    _sync(device)
    start = clock()
    for step_inputs in inputs:
        call(step_inputs)
    _sync(device)
    return (clock() - start) / len(inputs)


# what PyTorch's profiler library (Kineto) prints straight to file descriptor 2 at every
# profiler start and stop, whatever KINETO_LOG_LEVEL says
_KINETO_NOISE = re.compile(r"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+\.cpp:\d+\] ")


@contextlib.contextmanager
def _kineto_lines_dropped() -> Iterator[None]:
    """Drop Kineto's ``USDT: ... profiler_start`` lines from stderr while the block runs.

    They bypass Python, so the file descriptor itself is pointed at a temporary file; any
    other text written to stderr meanwhile is passed on when the block ends.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not _KINETO_NOISE.match(line))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


def _profile_forward(
    call: Callable[[dict[str, Any]], Any], inputs: dict[str, Any], device: torch.device, method: str
) -> dict[str, float]:
    """Share of one forward spent in each overhead part of ``method``, from profiler ranges."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from toma.tools.baselines import tomesd_profiled

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _kineto_lines_dropped(), tomesd_profiled(), profile(activities=activities) as prof:
        with record_function("bench::forward"):
            call(inputs)
        _sync(device)
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        # on CUDA the device time is what counts; CPU ranges then only measure launches
        us = max(event.cpu_time_total, getattr(event, "device_time_total", 0.0) or 0.0)
        totals[event.key] = totals.get(event.key, 0.0) + us
    forward = totals.get("bench::forward", 0.0)
    if forward <= 0:
        return {}
    prefix = {"toma": "toma", "ideal": "ideal", "todo": "todo", "tomesd": "tomesd"}[split_method(method)[0]]
    shares = {part: totals.get(f"{prefix}::{part}", 0.0) / forward for part in OVERHEAD_PARTS}
    shares["total"] = sum(shares.values())
    return shares


def benchmark(
    arch: Arch,
    resolution: int,
    methods: list[str],
    ratios: list[float],
    batches: list[int] = (1,),  # type: ignore[assignment]
    steps: int = 1,
    repeats: int = 3,
    warmup: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    model_path: str | None = None,
    depth: int = 1,
    frames: int | None = None,
    placement: dict[str, Any] | None = None,
    toma_options: dict[str, Any] | None = None,
    tomesd_max_downsample: int | None = None,
    cache_options: dict[str, dict[str, Any]] | None = None,
    compile: bool = False,
    freezing: bool = False,
    cuda_graph: bool = False,
    profile: bool = True,
    seed: int = 0,
    progress: bool = False,
    log: Callable[[str], None] = lambda s: None,
    clock: str = "wall",
) -> dict[str, Any]:
    """Time every method side by side on one denoiser; returns the report dict.

    Each timed sample is ``steps`` consecutive denoiser forwards with falling timesteps
    (a fresh denoising run each sample), reported as seconds per forward. Variants are
    timed round-robin (with the order rotated every round) after ``warmup`` untimed
    samples each. With ``cuda_graph`` every variant's forward is captured once as a CUDA
    graph (on the first step's inputs) and a sample times ``steps`` replays of it. Ctrl-C
    stops the rounds and returns what was measured, with ``report["interrupted"] = True``.
    ``clock`` is ``"wall"`` or ``"cpu"`` (:data:`CLOCKS`).
    """
    from toma.tools.common.report import load_average

    load_before = load_average()
    device = torch.device(device)
    placement = {"levels": 1, "merge_mlp": False, "tile_size": "auto", **(placement or {})}
    toma_options = dict(toma_options or {})
    notes: list[str] = []
    log(
        f"building {arch.description} ({'weights from ' + model_path if model_path else 'random weights'}) "
        f"in {str(dtype).replace('torch.', '')} on {device}"
    )
    model = build_model(arch, depth=depth, model_path=model_path, dtype=dtype, device=device, seed=seed)
    if depth != 1:
        built = " and ".join(f"{len(model.get_submodule(s))} {s}" for s in STACKS[arch.family])
        notes.append(f"{arch.description} at full width but reduced depth: {built} (--depth {depth} of the full model)")
    if arch.frames:
        notes.append(f"video of {frames or arch.frames} frames, {latent_frames(arch, frames)} latent frames")
    harness = MethodPatcher(model, arch, placement, toma_options, tomesd_max_downsample, cache_options)
    skipped: dict[str, str] = {}
    variants = [Variant("none", None)] if "none" in methods else []
    for m in methods:
        if m == "none":
            continue
        why = harness.unavailable(m)
        if why:
            skipped[m] = why
            log(f"skipping {m}: {why}")
            continue
        if split_method(m)[1] is not None and not any(split_method(n) == (split_method(m)[0], None) for n in methods):
            notes.append(f"{m} has no {split_method(m)[0]} row to compare with: add it to --methods")
        variants += [Variant(m, None)] if split_method(m)[0] == "none" else [Variant(m, r) for r in ratios]
    if any(split_method(v.method)[1] for v in variants):
        notes.append(
            "a cache skips work when consecutive steps change little, which depends on the weights and "
            "the latents: with random weights and fixed inputs its saving here is not the real one; "
            "what this run shows is whether ToMA's saving and the cache's add up on the steps it computes"
        )

    def call(inputs: dict[str, Any]) -> Any:
        if harness.cached:  # diffusers' caches keep their state per context, as pipelines open it
            with model.cache_context("cond"):
                return call_denoiser(arch, model, inputs)
        return call_denoiser(arch, model, inputs)

    step_inputs = {
        b: [
            set_timestep(arch, make_inputs(arch, resolution, b, dtype, device, seed, frames), s, steps)
            for s in range(steps)
        ]
        for b in batches
    }

    settings: dict[str, Any] = {}
    graphs: dict[tuple[Variant, int], Callable[[], None]] = {}
    if cuda_graph:
        notes.append("timed as CUDA graph replays of one captured forward per variant (no Python or launch overhead)")
        with torch.inference_mode():
            variants = _capture_graphs(
                harness, call, variants, batches, step_inputs, device, graphs, settings, skipped, log
            )
    picked = [v for v in variants if v.method == "none"][:1] + [v for v in variants if v.method == "toma"][:1]
    picked = picked if compile else []
    if picked:
        notes.append(
            "compiled rows: each compiled once on its own weight-sharing copy of the model, then timed in "
            "the same interleaved rounds as the eager ones" + (", with inductor's freezing" if freezing else "")
        )
    results = {(v, b): Measurement(v, b) for v in variants for b in batches}
    interrupted = False
    total = (len(variants) + len(picked)) * len(batches) * (warmup + repeats)
    bar = progress_bar(total, progress)
    try:
        with torch.inference_mode():
            bar.set_postfix_str("compiling" if picked else "")
            compiled = compile_variants(harness, picked, batches, step_inputs, warmup, device, log, freezing)
            timed = variants + list(compiled)
            results.update({(v, b): Measurement(v, b) for v in compiled for b in batches})
            time_rounds(
                harness,
                call,
                timed,
                batches,
                step_inputs,
                warmup,
                repeats,
                device,
                results,
                settings,
                bar,
                graphs if cuda_graph else None,
                fixed=compiled,
                clock=CLOCKS[clock],
            )
            if profile:
                for v in variants:
                    bar.set_postfix_str(f"profiling {v.label}")
                    harness.apply(v)
                    try:
                        first = step_inputs[batches[0]][0]
                        results[(v, batches[0])].kernels = sum(count_kernels(lambda: call(first)).values())
                        if split_method(v.method)[0] != "none":
                            results[(v, batches[0])].overhead = _profile_forward(call, first, device, v.method)
                    finally:
                        harness.remove()
    except KeyboardInterrupt:
        interrupted = True
        harness.remove()
        log("interrupted: reporting what was measured so far")
    finally:
        bar.close()
    conditions = RunConditions(
        arch=arch,
        parameters=count_parameters(model),
        blocks=_blocks(model, arch),
        resolution=resolution,
        dtype=dtype,
        device=device,
        depth=depth,
        steps=steps,
        repeats=repeats,
        warmup=warmup,
        methods=methods,
        ratios=ratios,
        batches=batches,
        placement=_placement_in_force(harness, methods, skipped),
        toma_options=harness.toma_options,
        compiled=compile,
    )
    report = build_report(conditions, _rows(results, settings), skipped, notes, interrupted)
    report["cuda_graph"] = cuda_graph
    report["clock"] = clock
    report["freezing"] = freezing and bool(picked)
    report["load_average_before"], report["load_average_after"] = load_before, load_average()
    return report


def _rows(results: dict[tuple[Variant, int], Measurement], settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's plain rows: one per variant and batch size that has timed samples."""
    return [
        {
            "method": v.method,
            "ratio": v.ratio,
            "batch": b,
            "compiled": v.compiled,
            "times_s": m.times,
            "overhead": m.overhead,
            "kernels": m.kernels,
            "settings": settings.get(v.label),
        }
        for (v, b), m in results.items()
        if m.times
    ]


def _placement_in_force(harness: MethodPatcher, methods: list[str], skipped: dict[str, str]) -> dict[str, Any]:
    """Where the methods merged; with tomesd run, the ``max_downsample`` it was given."""
    placement = dict(harness.placement)
    if "tomesd" in methods and "tomesd" not in skipped:
        from toma.tools.baselines import tomesd_max_downsample

        placement["tomesd_max_downsample"] = harness.tomesd_max_downsample or tomesd_max_downsample(
            harness.model, **harness.placement
        )
    return placement


def _blocks(model: torch.nn.Module, arch: Arch) -> dict[str, int]:
    """The blocks of the model as built, per stack (Flux: double and single; UNets: transformer blocks)."""
    if arch.family == "flux":
        return {"double": len(model.transformer_blocks), "single": len(model.single_transformer_blocks)}
    if arch.family in STACKS:
        return {stack: len(model.get_submodule(stack)) for stack in STACKS[arch.family]}
    from diffusers.models.attention import BasicTransformerBlock

    return {"transformer_blocks": sum(isinstance(m, BasicTransformerBlock) for m in model.modules())}


def time_rounds(
    harness: MethodPatcher,
    call: Callable[[dict[str, Any]], Any],
    variants: list[Variant],
    batches: list[int],
    step_inputs: dict[int, list[dict[str, Any]]],
    warmup: int,
    repeats: int,
    device: torch.device,
    results: dict[tuple[Variant, int], Measurement],
    settings: dict[str, Any],
    bar: Any,
    graphs: dict[tuple[Variant, int], Callable[[], None]] | None = None,
    stop: Callable[[], bool] | None = None,
    fixed: dict[Variant, Callable[[dict[str, Any]], Any]] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> bool:
    """Time every variant and batch size round by round, interleaved, into ``results``.

    ``warmup`` untimed rounds, then ``repeats`` timed ones; each round applies every variant
    in turn (the order rotated by one each round, so that no variant always follows the
    same one), times one sample per batch size and removes it. With ``graphs`` a sample
    replays the variant's captured CUDA graph instead. A variant in ``fixed`` (the calls of
    :func:`compile_variants`) is not applied: its own call is timed. ``settings`` receives
    each variant's settings in force. ``stop`` is asked before every timed round after the first; True ends
    the rounds there (a time budget). Returns whether ``stop`` ended them. A
    KeyboardInterrupt propagates with the samples taken so far kept in ``results``. ``clock``
    reads the time (``time.process_time``: the CPU time of this process, steadier than wall
    time on a shared machine at one thread).
    """
    for rnd in range(warmup + repeats):
        if stop is not None and rnd > warmup and stop():
            return True
        order = variants[rnd % len(variants) :] + variants[: rnd % len(variants)] if variants else []
        for v in order:
            own = (fixed or {}).get(v)
            if graphs is None and own is None:
                settings[v.label] = harness.apply(v)
            try:
                for b in batches:
                    bar.set_postfix_str(f"{v.label} b{b} {'warm-up' if rnd < warmup else f'round {rnd - warmup + 1}'}")
                    if own is not None:
                        t = _time_sample(own, step_inputs[b], device, clock)
                    elif graphs is not None:
                        replay = graphs[(v, b)]
                        t = _time_sample(lambda _: replay(), step_inputs[b], device, clock)
                    else:
                        t = _time_sample(call, step_inputs[b], device, clock)
                    if rnd >= warmup:
                        results[(v, b)].times.append(t)
                    bar.update(1)
            finally:
                if own is None:
                    harness.remove()
    return False


def _capture_graphs(
    harness: MethodPatcher,
    call: Callable[[dict[str, Any]], Any],
    variants: list[Variant],
    batches: list[int],
    step_inputs: dict[int, list[dict[str, Any]]],
    device: torch.device,
    graphs: dict[tuple[Variant, int], Callable[[], None]],
    settings: dict[str, Any],
    skipped: dict[str, str],
    log: Callable[[str], None],
) -> list[Variant]:
    """Capture one CUDA graph per variant and batch into ``graphs``; returns the variants captured.

    A variant whose forward cannot be captured (it synchronises with the host, say) is
    reported in ``skipped`` instead of stopping the benchmark.
    """
    kept = []
    for v in variants:
        settings[v.label] = harness.apply(v)
        try:
            for b in batches:
                graphs[(v, b)] = _capture(call, step_inputs[b][0], device)
            kept.append(v)
        except RuntimeError as err:
            skipped[v.label] = f"CUDA graph capture failed: {str(err).splitlines()[0]}"
            log(f"skipping {v.label}: {skipped[v.label]}")
            torch.cuda.synchronize(device)
        finally:
            harness.remove()
    return kept


def _capture(call: Callable[[dict[str, Any]], Any], inputs: dict[str, Any], device: torch.device) -> Callable[[], None]:
    """Record ``call(inputs)`` as a CUDA graph; returns its replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-ups off the default stream, as capture requires
        for _ in range(2):
            call(inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(inputs)
    return graph.replay


def weight_sharing_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose modules are its own (so hooks patch one copy only) but whose
    parameters and buffers are ``model``'s, so memory stays that of one model."""
    import copy

    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def compile_variants(
    harness: MethodPatcher,
    picked: list[Variant],
    batches: list[int],
    step_inputs: dict[int, list[dict[str, Any]]],
    warmup: int,
    device: torch.device,
    log: Callable[[str], None],
    freezing: bool = False,
) -> dict[Variant, Callable[[dict[str, Any]], Any]]:
    """Each of ``picked`` patched for good on its own copy of the model and compiled once.

    A compiled model keeps the patch it was compiled with, so the compiled variants cannot
    share one model that rounds patch and unpatch; with a :func:`weight_sharing_copy` each,
    :func:`time_rounds` can time them interleaved with each other and with the eager ones.
    Every call is warmed up ``max(warmup, 2)`` times per batch (the first compiles, the
    second settles the guards). Returns the compiled variant -> its call; each call carries
    the eager variant it was built from as ``call.toma_variant``. ``freezing`` compiles with
    inductor's freezing (weights as constants, prepacked for the CPU's libraries; inference
    only), which on the project's CPU beat plain inductor (figures: BENCHMARKS.md).
    """
    calls: dict[Variant, Callable[[dict[str, Any]], Any]] = {}
    for v in picked:
        cv = Variant(v.method, v.ratio, compiled=True, options=v.options, name=v.name)
        model = weight_sharing_copy(harness.model)
        MethodPatcher(
            model, harness.arch, harness.placement, harness.toma_options, harness.tomesd_max_downsample
        ).apply(v)
        compiled = torch.compile(model, options={"freezing": True} if freezing else None)

        def ccall(inputs: dict[str, Any], compiled: Any = compiled) -> Any:
            return call_denoiser(harness.arch, compiled, inputs)

        ccall.toma_variant = v  # type: ignore[attr-defined]
        start = time.perf_counter()
        for b in batches:
            for _ in range(max(warmup, 2)):
                _time_sample(ccall, step_inputs[b], device)
        log(f"{cv.label}: compiled and warmed up in {time.perf_counter() - start:.1f}s")
        calls[cv] = ccall
    return calls


class _NoBar:
    def update(self, n: int) -> None: ...
    def set_postfix_str(self, s: str) -> None: ...
    def close(self) -> None: ...


def progress_bar(total: int, enabled: bool, desc: str = "toma bench") -> Any:
    """A tqdm bar on stderr counting samples, or a stand-in that shows nothing."""
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="sample", file=sys.stderr, dynamic_ncols=True)
