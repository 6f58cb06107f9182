"""What ``toma tune`` measured on this machine, and the warning :func:`toma.apply_toma` gives from it.

``toma tune`` records one entry per measured setting in ``tune.json`` under the cache folder
(``$TOMA_CACHE_DIR``, else ``$XDG_CACHE_HOME/toma``, else ``~/.cache/toma``). An entry is keyed
by :func:`setting_key`: the denoiser class, its device type and dtype, the sub-modules merged
and the settings that change the computation. :func:`warn_if_measured_slower` looks the key up
when the file exists and warns once per process per key when tune measured the setting as
slower than the unpatched model. This module imports nothing heavy: ``import toma`` loads it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Iterable

CACHE_ENV = "TOMA_CACHE_DIR"
CACHE_FORMAT = "toma-tune-cache"
CACHE_VERSION = 1
CACHE_FILE = "tune.json"

# settings that only choose where to merge: the merged sub-modules' names say that exactly
_PLACEMENT = ("levels", "blocks", "flux_double_blocks", "flux_single_blocks")
_PARTS = (
    ("attn", "merge_attn", "attn_ratio"),
    ("cross", "merge_crossattn", "crossattn_ratio"),
    ("mlp", "merge_mlp", "mlp_ratio"),
)


class SlowerSettingWarning(UserWarning):
    """``toma tune`` measured these settings as slower than the unpatched model on this machine."""


def cache_path() -> Path:
    """The tune record file: ``$TOMA_CACHE_DIR/tune.json``, else under ``$XDG_CACHE_HOME/toma`` or ``~/.cache/toma``."""
    folder = os.environ.get(CACHE_ENV)
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "toma")
    return Path(folder) / CACHE_FILE


def setting_key(denoiser: str, device: str, dtype: str, merged: Iterable[str], settings: dict[str, Any]) -> str:
    """A short hash naming one setting on one kind of denoiser.

    Args:
        denoiser: the denoiser's class name (``"UNet2DConditionModel"``).
        device: the device type its weights are on (``"cpu"``, ``"cuda"``).
        dtype: their dtype (``"torch.float32"``).
        merged: qualified names of the merged sub-modules (order does not matter).
        settings: :meth:`toma.ToMAConfig.to_dict` of the settings.

    Placement options are left out (the merged names say where), and each part's ratio is
    resolved (``mlp_ratio=None`` with ``ratio=0.5`` keys like ``mlp_ratio=0.5``), so two
    spellings of one computation get one key.
    """
    norm = {k: v for k, v in settings.items() if k not in _PLACEMENT and k != "ratio" and not k.endswith("_ratio")}
    for part, switch, field in _PARTS:
        if settings.get(switch):
            value = settings.get(field)
            norm[field] = float(settings["ratio"] if value is None else value)
    text = json.dumps([denoiser, device, dtype, sorted(merged), norm], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def model_key(model: Any, merged: Iterable[str], settings: dict[str, Any]) -> str:
    """:func:`setting_key` of settings on a denoiser module, from its class and its first
    parameter's device type and dtype."""
    return setting_key(type(model).__name__, *_device_dtype(model), merged, settings)


def _device_dtype(model: Any) -> tuple[str, str]:
    param = next(iter(model.parameters()), None)
    return (param.device.type, str(param.dtype)) if param is not None else ("cpu", "torch.float32")


def read_entries(path: Path | None = None) -> list[dict[str, Any]]:
    """The entries of the tune record file (none when it does not exist).

    Raises:
        ValueError: the file is not a tune record file this toma can read (names the file).
    """
    path = cache_path() if path is None else path
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"tune record file {path} cannot be read: {err}") from None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != CACHE_FORMAT
        or doc.get("version") != CACHE_VERSION
        or not isinstance(doc.get("entries"), list)
    ):
        raise ValueError(f"tune record file {path} is not a version-{CACHE_VERSION} {CACHE_FORMAT!r} file")
    return [e for e in doc["entries"] if isinstance(e, dict)]


def record(entries: list[dict[str, Any]], path: Path | None = None) -> Path:
    """Add measured entries to the tune record file, replacing older ones of the same
    ``key``, ``grid``, ``batch`` and ``mode``; returns the file's path.

    Each entry holds at least ``key`` (:func:`setting_key`), ``speedup`` (unpatched median
    time over the setting's) and ``reliable`` (False when its samples spread by more than the
    effect). An unreadable existing file is replaced.
    """
    path = cache_path() if path is None else path

    def ident(e: dict[str, Any]) -> tuple:
        return (e.get("key"), json.dumps(e.get("grid")), e.get("batch"), e.get("mode"))

    try:
        old = read_entries(path)
    except ValueError:
        old = []
    new = {ident(e) for e in entries}
    kept = [e for e in old if ident(e) not in new] + list(entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(
        json.dumps({"format": CACHE_FORMAT, "version": CACHE_VERSION, "entries": kept}, indent=1) + "\n",
        encoding="utf-8",
    )
    os.replace(tmp, path)  # readers never see half a file
    return path


def warn_if_measured_slower(model: Any, merged: Iterable[str], settings: dict[str, Any]) -> None:
    """Warn (once per process per setting) when ``toma tune`` measured these settings on this
    kind of denoiser as slower than unpatched, reliably. Costs one ``stat`` when there is no
    record file; an unreadable one is reported once and otherwise ignored."""
    path = cache_path()
    if not path.is_file():
        return
    try:
        entries = read_entries(path)
    except ValueError as err:
        _warn_once(f"unreadable:{path}", f"{err}; toma tune's records are ignored (delete the file to silence this)")
        return
    key = model_key(model, merged, settings)
    device, dtype = _device_dtype(model)
    slower = [
        e
        for e in entries
        if e.get("key") == key
        and e.get("reliable")
        and isinstance(e.get("speedup"), (int, float))
        and e["speedup"] < 1.0
    ]
    if not slower:
        return
    where = "; ".join(
        f"{e['speedup']:.2f}x at {_grid(e.get('grid'))} tokens, batch {e.get('batch', '?')}, {e.get('mode', 'eager')}"
        + (f" ({e['measured_at']})" if e.get("measured_at") else "")
        for e in slower
    )
    _warn_once(
        key,
        f"toma tune measured these ToMA settings on {type(model).__name__} ({device}, "
        f"{dtype.replace('torch.', '')}) as slower than unpatched on this machine: {where}. "
        f"Run `toma tune` for a faster setting (records: {path})",
    )


def _grid(grid: Any) -> str:
    return "x".join(map(str, grid)) if isinstance(grid, list) else str(grid)


@functools.cache
def _warn_once(key: str, message: str) -> None:
    # the cache is the once-per-process memory: a second call with the same key and text does nothing
    # stacklevel 4: this function, the caller in this module, apply_toma, the user's call
    warnings.warn(message, SlowerSettingWarning, stacklevel=4)
