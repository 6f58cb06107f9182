"""The harness of ``toma eval``: methods, the processes that share the images, and statistics.

Shared by the built-in model (:mod:`toma.tools.eval.builtin`) and diffusers pipelines
(:mod:`toma.tools.eval.pipeline`): how each method is applied and removed, which
(method, ratio) variants run, how a data-parallel launch splits and gathers work, and
the per-variant statistics both summaries compute.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from toma.tools.eval.constants import METHODS

if TYPE_CHECKING:
    import torch
# torch and the metrics load in the functions that use them

# Frechet distances estimate a covariance from the images' features: below this many
# images per variant they swing with the seeds drawn (the usual advice is thousands)
FD_MIN_IMAGES = 100
TOMA_SELECTION = {"toma": "facility", "toma-random": "random", "toma-grid": "grid"}


def first_attention_downsample(unet: Any) -> int:
    """Downsampling factor of the UNet's highest-resolution level that has attention."""
    for i, block in enumerate(getattr(unet, "down_blocks", [])):
        if getattr(block, "attentions", None):
            return 2**i
    return 1


def apply_method(
    denoiser: Any, method: str, ratio: float, options: dict[str, Any], steps: int | None = None
) -> Callable[[], None]:
    """Patch ``denoiser`` with a merging method, and the step cache it names after ``+``
    (:mod:`toma.tools.eval.caches`; ``steps`` per run, which cache-dit counts); returns the
    function that removes both.

    ``options`` are ToMA settings; ``levels`` is translated to tomesd's ``max_downsample``
    so both merge the same UNet levels.

    Raises:
        ValueError: unknown method, tomesd on a model without a UNet, or a cache the model
            does not take.
        ImportError: tomesd or cache-dit requested but not installed.
    """
    from toma.tools.eval.caches import enable, split_method

    base, cache, threshold = split_method(method)
    if cache is None:
        return _apply_base(denoiser, base, ratio, options)
    from toma.api import denoiser_of

    remove_base = _apply_base(denoiser, base, ratio, options)
    try:
        remove_cache = enable(denoiser_of(denoiser), cache, threshold, steps)
    except BaseException:
        remove_base()
        raise

    def remove() -> None:
        # ToMA first: cache-dit's removal restores the forward it wrapped, which must not be ToMA's
        remove_base()
        remove_cache()

    return remove


def _apply_base(denoiser: Any, method: str, ratio: float, options: dict[str, Any]) -> Callable[[], None]:
    """:func:`apply_method` for a merging method alone."""
    if method == "none":
        return lambda: None
    if method in TOMA_SELECTION:
        from toma import apply_toma, remove_toma

        apply_toma(denoiser, ratio=ratio, selection=TOMA_SELECTION[method], **options)
        return lambda: remove_toma(denoiser)
    if method == "tomesd":
        import tomesd

        unet = getattr(denoiser, "unet", denoiser)
        if not hasattr(unet, "down_blocks"):
            raise ValueError("tomesd only supports UNet models (SD 1.x/2.x, SDXL, the built-in model)")
        max_downsample = first_attention_downsample(unet) * 2 ** (options.get("levels", 1) - 1)
        tomesd.apply_patch(unet, ratio=ratio, max_downsample=max_downsample)
        return lambda: tomesd.remove_patch(unet)
    raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")


def variants(methods: Sequence[str], ratios: Sequence[float]) -> list[tuple[str, float]]:
    """(method, ratio) pairs to run; the reference ``none`` once, with ratio 0, and a cache
    alone (``none+fbcache``) once too, with ratio 0: it merges nothing."""
    return [("none", 0.0)] + [
        (m, r) for m in methods if m != "none" for r in ((0.0,) if m.startswith("none+") else ratios)
    ]


def tomesd_available() -> bool:
    """Whether ToMeSD can be imported."""
    try:
        import tomesd  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------- generation


@contextlib.contextmanager
def image_progress(total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """Progress over ``total`` images; yields the function to call with each batch's size.

    The bar clears itself at the end and one line says what was done: tqdm redraws a
    finished bar once more when it closes, which a log (not a terminal) kept as a second
    copy of the last line.
    """
    from tqdm.auto import tqdm

    done = 0
    start = time.perf_counter()
    bar = tqdm(total=total, desc="eval images", disable=not enabled, leave=False, file=sys.stderr)

    def update(n: int) -> None:
        nonlocal done
        done += n
        bar.update(n)

    try:
        yield update
    finally:
        bar.close()
        if enabled:
            print(f"eval images: {done}/{total} generated in {time.perf_counter() - start:.1f} s", file=sys.stderr)


def generate_interleaved(
    target: Any,
    runs: Sequence[tuple[str, float]],
    batches: Sequence[Sequence[Any]],
    options: dict[str, Any],
    generate: Callable[[Sequence[Any]], torch.Tensor],
    warm_up: Callable[[], Any],
    progress: Callable[[int], None] = lambda n: None,
    steps: int | None = None,
) -> dict[tuple[str, float], tuple[list[torch.Tensor], list[float]]]:
    """Generate every batch with every variant, timed batch by batch with the variants interleaved.

    For each batch the variants run one after another, each patched onto ``target`` (see
    :func:`apply_method`) for that batch only, in an order that rotates by one every batch.
    A slow spell of a shared machine then hits every variant alike; timing one variant's
    images in one block and then the next's let it land on a single variant. Before a
    variant's first batch, ``warm_up()`` runs once untimed (one-off set-up); a variant with
    a step cache is then patched afresh, so that every batch starts with the cache empty.
    ``steps`` is each batch's step count, for the caches that count steps.

    Returns:
        per ``(method, ratio)``: the images ``generate(batch)`` returned, in batch order, and
        the seconds each batch took.
    """
    from toma.tools.common.pipelines import timed

    out: dict[tuple[str, float], tuple[list[Any], list[float]]] = {run: ([], []) for run in runs}
    for i, batch in enumerate(batches):
        shift = i % len(runs)
        for run in [*runs[shift:], *runs[:shift]]:
            remove = apply_method(target, run[0], run[1], options, steps)
            try:
                if i == 0:
                    warm_up()
                    if "+" in run[0]:  # a step cache starts the timed batch empty
                        remove()
                        remove = apply_method(target, run[0], run[1], options, steps)
                images, seconds = timed(lambda: generate(batch))
            finally:
                remove()
            out[run][0].append(images)
            out[run][1].append(seconds)
            progress(len(batch))
    return out


# ---------------------------------------------------------------------------- processes


@dataclass
class Processes:
    """Data-parallel context: this process's rank and how to gather Python objects."""

    rank: int
    world: int
    state: Any = None

    @property
    def is_main(self) -> bool:
        """Whether this is the process that summarises and writes the outputs."""
        return self.rank == 0

    def split(self, items: list[Any]) -> list[Any]:
        """This process's contiguous share of ``items``."""
        if self.state is None:
            return items
        with self.state.split_between_processes(items) as mine:
            return list(mine)

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` from every process, in rank order (only meaningful on the main process)."""
        if self.world == 1:
            return [obj]
        from accelerate.utils import gather_object

        return gather_object([obj])

    def barrier(self) -> None:
        """Wait until every process gets here."""
        if self.state is not None and self.world > 1:
            self.state.wait_for_everyone()


def init_processes(cpu: bool) -> Processes:
    """Join the process group when started by ``accelerate launch``/``torchrun``, else run alone.

    ``cpu`` selects the gloo backend; accelerate only picks it for multi-process runs
    when told explicitly.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        try:
            from accelerate import PartialState
        except ImportError as err:
            raise RuntimeError("multi-process eval needs accelerate: pip install accelerate") from err
        state = PartialState(cpu=cpu)
        if state.num_processes != world:
            raise RuntimeError(
                f"launched with WORLD_SIZE={world} but accelerate set up {state.num_processes} process(es); "
                "launch with `accelerate launch --multi_gpu --num_processes N` or `torchrun --nproc_per_node N`"
            )
        return Processes(state.process_index, state.num_processes, state)
    return Processes(0, 1, None)


# ---------------------------------------------------------------------------- statistics


def mean_and_sem(name: str, values: torch.Tensor) -> dict[str, float]:
    """``{name: mean, name_sem: standard error}`` over the finite per-image values.

    The standard error says whether two methods' means differ by more than seed noise.
    """
    import torch

    from toma.tools.eval.metrics import mean_finite

    finite = values.double()[torch.isfinite(values.double())]
    sem = float(finite.std() / math.sqrt(finite.numel())) if finite.numel() > 1 else float("nan")
    return {name: mean_finite(values), f"{name}_sem": sem}


def frechet_to(feats: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> float:
    """Frechet distance of the features ``feats`` to the Gaussian ``(mu, sigma)``; NaN below 2 samples.

    One feature vector has no covariance; a process or a variant with a single image
    reports NaN (shown as n/a) rather than failing.
    """
    from toma.tools.eval.metrics import feature_stats, frechet_distance

    if len(feats) < 2:
        return float("nan")
    return frechet_distance(*feature_stats(feats), mu, sigma)


def timing(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Latency per image of one variant from every process's records, and its spread.

    Each record holds ``batch_seconds`` and ``batch_sizes``. ``spread`` is (max - min) /
    median of the seconds per image of the timed batches, as in ``toma bench``; a smaller
    last batch is left out of it (a batch's size changes its time per image). None with
    fewer than two batches.
    """
    count = sum(p["count"] for p in parts)
    samples = [(s / n, n) for p in parts for s, n in zip(p["batch_seconds"], p["batch_sizes"]) if n]
    full = max((n for _, n in samples), default=0)
    per_image = [t for t, n in samples if n == full]
    spread = (max(per_image) - min(per_image)) / statistics.median(per_image) if len(per_image) > 1 else None
    return {
        "latency_s": sum(sum(p["batch_seconds"]) for p in parts) / max(count, 1),
        "timed_batches": len(per_image),
        "spread": spread,
    }


def add_speedup(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add ``speedup`` = unmerged latency / latency to every row, and the ``flags`` of rows
    whose timing cannot be trusted (the rules of ``toma bench``: samples that spread by more
    than the effect measured)."""
    from toma.tools.common.report import timing_flags

    base = rows[0]
    for row in rows:
        row["speedup"] = base["latency_s"] / row["latency_s"] if row["latency_s"] > 0 else float("nan")
    for row in rows:
        measured = row.get("spread") is not None and base.get("spread") is not None
        row["flags"] = timing_flags(row, base) if measured else []
    return rows


def fd_warning(rows: Sequence[dict[str, Any]]) -> str | None:
    """The warning that Frechet distances rest on too few images, or None."""
    fd = [k for k in ("fd_real", "fd_vs_none", "fd_dino_reference") if k in rows[0]]
    fewest = min(r["n_images"] for r in rows)
    if not fd or fewest >= FD_MIN_IMAGES:
        return None
    return (
        f"Frechet distances ({', '.join(fd)}) from {fewest} images per variant are unreliable: "
        f"they need about {FD_MIN_IMAGES} or more (--num-images)"
    )


def key(method: str, ratio: float) -> str:
    """The name a variant's records are kept under, e.g. ``toma@0.5``."""
    return f"{method}@{ratio:g}"
