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

This module is torch-free at import: the CLI builds its parser from :data:`CACHES`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

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
    kind = cache_dit.DBCacheConfig if cache == "cachedit" else cache_dit.DBPruneConfig
    settings: dict[str, Any] = {"Fn_compute_blocks": 1, "Bn_compute_blocks": 0, "num_inference_steps": steps}
    if threshold is not None:
        settings["residual_diff_threshold"] = threshold
    try:
        cache_dit.enable_cache(denoiser, cache_config=kind(**settings))
    except (ValueError, AssertionError) as err:
        raise ValueError(f"--methods +{cache}: cache-dit cannot cache {type(denoiser).__name__}: {err}") from err
    return lambda: cache_dit.disable_cache(denoiser)


def quiet_cache_dit() -> None:
    """cache-dit logs every enable at INFO; an eval enables it once per batch."""
    import logging

    logging.getLogger("cache_dit").setLevel(logging.WARNING)
