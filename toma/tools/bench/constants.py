"""The vocabulary of ``toma bench`` that its parser, its harness and its report all read.

A leaf, torch-free module: the package's ``register`` builds ``--help`` from it without
torch, and the harness and the report both import it without importing each other for it.
"""

from __future__ import annotations

# rows are sorted by method in this order, overheads split in these parts
METHODS = ("none", "toma", "tomesd", "ideal", "todo")
# diffusers caches a method can be combined with, as ``<method>+<cache>`` (``toma+fbcache``)
CACHES = ("fbcache", "taylorseer")
OVERHEAD_PARTS = ("select", "weights", "merge", "unmerge")
# --clock: wall time, or the CPU time of this process (harness.CLOCKS reads them)
CLOCK_NAMES = ("wall", "cpu")
# --host: whose model classes are timed (comfyui: ComfyUI's own, see toma.tools.bench.comfyui)
HOSTS = ("diffusers", "comfyui")


def split_method(method: str) -> tuple[str, str | None]:
    """``"toma+fbcache"`` -> ``("toma", "fbcache")``; ``"toma"`` -> ``("toma", None)``."""
    base, _, cache = method.partition("+")
    return base, cache or None


def method_order(method: str) -> tuple[int, int]:
    """Sort key of a method name: its base method's rank, then its cache's."""
    base, cache = split_method(method)
    return METHODS.index(base), 0 if cache is None else 1 + CACHES.index(cache)
