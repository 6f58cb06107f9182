"""Step caches that ``toma eval`` stacks with a method: ``--methods toma+fbcache,none+cachedit:0.12``.

A method name is ``BASE`` or ``BASE+CACHE`` or ``BASE+CACHE:THRESHOLD``, with ``BASE`` one of
the merging methods (``none`` for the cache alone). The caches:

* ``fbcache``: diffusers' FirstBlockCache (threshold: the first block's relative residual
  change under which the later blocks are skipped; diffusers' default 0.05);
* ``taylorseer``: diffusers' TaylorSeer (no threshold);
* ``cachedit``: cache-dit's DBCache, the first block computing (threshold: its
  ``residual_diff_threshold``, default 0.08), cache-dit's other defaults;
* ``dbprune``: cache-dit's DBPrune, likewise.

Each is enabled on the bare denoiser for one sampling run and removed after it, so that
every run starts with an empty cache, as a pipeline call does; for diffusers' caches the
cache context a pipeline opens is opened here, since the built-in samplers call the bare
transformer.

Each run records which steps the cache skipped (:func:`count_skips`), so that a table can
say whether merging moves the steps a cache skips.

This module is torch-free at import: the CLI builds its parser from :data:`CACHES`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

CACHES = ("fbcache", "taylorseer", "cachedit", "dbprune")
_THRESHOLDED = ("fbcache", "cachedit", "dbprune")


def split_method(method: str) -> tuple[str, str | None, float | None]:
    """``"toma+cachedit:0.1"`` -> ``("toma", "cachedit", 0.1)``; ``"toma"`` -> ``("toma", None, None)``.

    Raises:
        ValueError: an unknown cache, or a threshold that is not a positive number (or given
            to a cache that takes none), naming ``--methods``.
    """
    base, plus, rest = method.partition("+")
    if not plus:
        return base, None, None
    cache, colon, value = rest.partition(":")
    if cache not in CACHES:
        raise ValueError(f"--methods: {method!r} names cache {cache!r}; the caches are {', '.join(CACHES)}")
    if not colon:
        return base, cache, None
    if cache not in _THRESHOLDED:
        raise ValueError(f"--methods: {method!r}: {cache} takes no threshold (those of {', '.join(_THRESHOLDED)} do)")
    try:
        threshold = float(value)
    except ValueError:
        threshold = float("nan")
    if not threshold > 0:
        raise ValueError(f"--methods: {method!r}: the threshold after ':' must be a number > 0; got {value!r}")
    return base, cache, threshold


def enable(denoiser: Any, cache: str, threshold: float | None, steps: int | None) -> Callable[[], None]:
    """Enable ``cache`` on ``denoiser`` (a bare diffusers transformer); returns its removal.

    Raises:
        ValueError: the denoiser takes no diffusers cache (UNets, SD3, PixArt), or cache-dit
            does not support it.
        ImportError: cache-dit is not installed (``pip install --no-deps cache-dit``).
    """
    if cache in ("fbcache", "taylorseer"):
        if not hasattr(denoiser, "enable_cache"):
            raise ValueError(f"--methods +{cache}: {type(denoiser).__name__} takes no diffusers cache")
        from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

        config = (
            FirstBlockCacheConfig(**({} if threshold is None else {"threshold": threshold}))
            if cache == "fbcache"
            else TaylorSeerCacheConfig()
        )
        denoiser.enable_cache(config)
        stack = contextlib.ExitStack()
        stack.enter_context(denoiser.cache_context("cond"))  # as pipelines open it around each call

        def remove() -> None:
            stack.close()
            denoiser.disable_cache()

        return remove
    try:
        import cache_dit
    except ImportError as err:
        raise ImportError(f"--methods +{cache} needs cache-dit (pip install --no-deps cache-dit)") from err
    quiet_cache_dit()
    kind = cache_dit.DBCacheConfig if cache == "cachedit" else cache_dit.DBPruneConfig
    settings: dict[str, Any] = {"Fn_compute_blocks": 1, "Bn_compute_blocks": 0, "num_inference_steps": steps}
    if threshold is not None:
        settings["residual_diff_threshold"] = threshold
    order = list(denoiser._modules)
    try:
        cache_dit.enable_cache(denoiser, cache_config=kind(**settings))
    except (ValueError, AssertionError) as err:
        raise ValueError(f"--methods +{cache}: cache-dit cannot cache {type(denoiser).__name__}: {err}") from err

    def remove() -> None:
        cache_dit.disable_cache(denoiser)
        _restore(denoiser, order)

    return remove


def _restore(denoiser: Any, order: list[str]) -> None:
    """Undo what ``cache_dit.disable_cache`` leaves behind, which the next variant of an eval
    would otherwise inherit.

    * It puts the block stacks back as the last submodules: the modules are the same, but
      diffusers' FirstBlockCache takes the first block of the first stack in that order for
      the one that decides, and on Flux it then picks a single-stream block, calls the
      tail before it, and fails. The order the model had goes back.
    * For some families (Flux.1 among them) it first replaces the transformer's forward
      with its own copy (a "patch functor") and keeps it; the class's forward goes back
      wherever no diffusers hook (ToMA's) still wraps it.
    """
    from toma.adapters import _private

    for name in order:
        if name in denoiser._modules:
            denoiser._modules[name] = denoiser._modules.pop(name)
    for module in denoiser.modules():
        func = getattr(module.__dict__.get("forward"), "__func__", None)
        if func is None or not getattr(func, "__module__", "").startswith("cache_dit"):
            continue
        registry = _private.registry(module)  # diffusers' caches leave theirs, empty
        if registry is None or not registry.hooks:
            del module.forward
            module.__dict__.pop(_private.CACHE_DIT_PATCHED, None)  # so that cache-dit patches it again next time


@dataclass
class Skips:
    """What :func:`count_skips` saw: the denoiser's calls (one per sampling step on the
    built-ins) and the 0-based indices of those in which the cache skipped the block stack."""

    calls: int = 0
    skipped: list[int] = field(default_factory=list)


@contextlib.contextmanager
def count_skips(denoiser: Any) -> Iterator[Skips]:
    """Count, over the block, the calls of ``denoiser`` and those in which a step cache skipped
    the rest of the block stacks: those in which the last block of no stack ran.

    FirstBlockCache and DBCache (first block computing, none at the end) skip every block
    after the first together, so the stacks' last blocks stand for them all (cache-dit
    reorders the stacks among the model's submodules, so no one stack is taken for the
    last). A skipped block's children are not called, whatever wraps the block
    (FirstBlockCache's hook returns before the block's own forward; cache-dit does not call
    it), so torch hooks on the children see only the calls that computed it.

    Raises:
        ValueError: ``denoiser`` has no block stack (a non-empty ``nn.ModuleList`` child).
    """
    import torch

    stacks = [s for s in denoiser.children() if isinstance(s, torch.nn.ModuleList) and len(s)]
    lasts = [stack[-1] for stack in stacks]
    if not lasts or not all(list(block.children()) for block in lasts):
        raise ValueError(f"count_skips: {type(denoiser).__name__} has no block stack (nn.ModuleList of modules)")
    seen = Skips()
    ran = [True]

    def close_call() -> None:
        if not ran[0]:
            seen.skipped.append(seen.calls - 1)

    def before_call(module: Any, args: Any) -> None:
        close_call()
        seen.calls += 1
        ran[0] = False

    def block_ran(module: Any, args: Any) -> None:
        ran[0] = True

    handles = [denoiser.register_forward_pre_hook(before_call)]
    handles += [child.register_forward_pre_hook(block_ran) for block in lasts for child in block.children()]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()
        close_call()


def skip_stats(skipped: list[list[int]], calls: list[int], alone: list[list[int]] | None) -> dict[str, Any]:
    """A variant's row entries on what its cache skipped, from :class:`Skips` per batch.

    Args:
        skipped: per batch, the indices of the steps skipped.
        calls: per batch, the denoiser calls (steps).
        alone: the same for the cache alone on the unmerged model (``none+CACHE``) at the
            same threshold, for a merged variant; None otherwise.

    Returns:
        ``steps_skipped``, the fraction of all steps skipped; ``skip_steps``, ``skipped``
        itself; ``skip_overlap``, the Jaccard index of the (batch, step) pairs skipped here
        and by the cache alone (1: the same steps), None without ``alone`` or when neither
        skipped any.
    """
    total = sum(calls)
    overlap = None
    if alone is not None:
        mine = {(b, step) for b, steps in enumerate(skipped) for step in steps}
        theirs = {(b, step) for b, steps in enumerate(alone) for step in steps}
        if mine | theirs:
            overlap = len(mine & theirs) / len(mine | theirs)
    return {
        "steps_skipped": sum(map(len, skipped)) / total if total else float("nan"),
        "skip_steps": skipped,
        "skip_overlap": overlap,
    }


def quiet_cache_dit() -> None:
    """cache-dit logs every enable at INFO (its logger is ``CACHE_DIT``); an eval enables it
    once per batch and variant."""
    import logging

    logging.getLogger("CACHE_DIT").setLevel(logging.WARNING)
