"""User-facing settings of ToMA and their validation."""

from __future__ import annotations

import ast
import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from toma.core.selection import SELECTIONS


# tile_size="auto": tiles of AUTO_BASE tokens a side, halved on small grids
AUTO_TILE = "auto"
AUTO_BASE = 4


@dataclass(frozen=True)
class ToMAConfig:
    """Settings for :func:`toma.apply_toma`.

    Attributes:
        ratio: fraction of image tokens removed before each merged computation, in [0, 1).
            0 patches nothing into the computation (outputs are bitwise unchanged).
        tile_size: tile side in tokens (int) or ``(height, width)``; selection and merging
            happen inside tiles. The authors' default is 4 (16 tokens, 8 kept at ratio 0.5).
            ``"auto"`` (the default) scales the tile to the grid: 4x4, or 2x2 where a frame
            has under half the tokens of its family's reference frame (Flux at 1024px, Wan
            at 480p, ...), so that small grids hold about as many tiles as the reference
            does (the evidence: benchmarks/builtin.md, "Defaults that follow the grid"). UNets and
            families without a reference keep 4x4.
        selection: ``"facility"`` (ToMA's submodular greedy), ``"random"`` or ``"grid"``.
        temperature: softmax temperature of the token-to-destination assignment on cosine
            similarities. 0.001 matches the authors' beta of 1000; 0 means a hard assignment.
        recompute_every: compute fresh plans every this many denoising steps and reuse
            them in between (1 = every step).
        share_batch_plan: select on batch element 0 and share its plan with the whole
            batch (the authors' behaviour; cheaper, an approximation for CFG batches).
        seed: seed of ``selection="random"``.
        levels: UNet only. How many attention resolution levels to merge, counted from the
            highest-resolution level that has attention (SD 1.x: 64x64 tokens at 512px;
            SDXL: 64x64 tokens at 1024px). At most the model's count of attention levels
            (SD 1.x: 4, SDXL: 2); more is refused, naming the allowed range.
        merge_attn: Merge the tokens of self-attention (joint attention in MMDiTs).
        merge_crossattn: UNets and DiTs with cross-attention to text (PixArt, Wan, LTX).
            Merge the queries of cross-attention; text keys and values stay whole.
        merge_mlp: UNets and DiTs whose MLP is a sub-module of its own. Merge the tokens
            of the feed-forward MLP. (Flux merges attention only and refuses both.)
        attn_ratio: ratio for self-attention; None means ``ratio``.
        crossattn_ratio: ratio for cross-attention queries (needs ``merge_crossattn``);
            None means ``ratio``.
        mlp_ratio: ratio for the MLP (needs ``merge_mlp``); None means ``ratio``. A part
            whose ratio differs from another's gets a plan of its own (one more selection
            per step); a part at ratio 0 runs unmerged.
        proportional_attention: in merged self-attention, weight each merged key by the
            number of tokens it stands for (a ``log(mass)`` bias on the attention logits), so
            that a destination absorbing many similar tokens draws the attention those
            tokens would have drawn. Exact when merged tokens are identical. None (the
            default) means on for UNets, where it was measured to help, and for
            transformers wherever its form on the attention backend was measured to cost
            at most 3% of a forward: on CPU (the float mask, or the key channel under
            context parallelism). On GPUs it stays off under None until a GPU has measured
            it; True turns it on there in the backend's exact form
            (:mod:`toma.adapters.attention`). What it buys and costs: BENCHMARKS.md.
        flux_double_blocks: Flux only. Indices of double-stream blocks to merge; None means
            every block but the first 5 (the authors' default). Same as
            ``blocks={"transformer_blocks": ...}``.
        flux_single_blocks: Flux only. Indices of single-stream blocks to merge; None means
            every block but the first 5. Same as ``blocks={"single_transformer_blocks": ...}``.
        blocks: transformers. Which blocks merge, as ``{stack: indices}`` with a stack being
            an attribute of the denoiser that holds blocks (``"transformer_blocks"``,
            ``"single_transformer_blocks"``, ``"blocks"``) and indices any iterable of ints
            (``range(5, 19)``). Stacks left out merge nothing. None: the family's default.
        tile_frames: video transformers. Frames a tile spans, so that tiles are
            ``tile_frames x tile_size`` tokens; None means 1 (2-D tiles, measured at least
            as faithful as 2-frame spatio-temporal tiles on the built-in video DiT).
        mlp_levels: UNet only, with ``merge_mlp``. The attention levels (1 = the highest
            resolution, as ``levels`` counts) whose MLPs merge, e.g. ``(2,)`` with
            ``levels=2`` merges attention at both levels and the MLP at the deeper one only;
            None: the MLPs of every merged level.
        start_step: merge only from this denoising step on (0 = the first step); earlier
            steps run unmerged, bitwise as without ToMA. Early steps lay out the image and
            late ones refine it, so a later start trades speed for fidelity.
        stop_step: merge only before this step (None: to the end). Steps are counted per
            denoising run from the denoiser's timestep (a run starts when it rises), so the
            conditional and unconditional calls of one step count once. A window reads
            the timestep on the host (one GPU synchronisation per call) and does not apply
            inside a captured CUDA graph, which replays whatever it captured.
    """

    ratio: float = 0.5
    tile_size: int | tuple[int, int] | str = "auto"
    selection: str = "facility"
    temperature: float = 0.001
    recompute_every: int = 1
    share_batch_plan: bool = False
    seed: int = 0
    levels: int = 1
    merge_attn: bool = True
    merge_crossattn: bool = False
    merge_mlp: bool = False
    proportional_attention: bool | None = None
    flux_double_blocks: tuple[int, ...] | None = None
    flux_single_blocks: tuple[int, ...] | None = None
    blocks: Any = None
    tile_frames: int | None = None
    attn_ratio: float | None = None
    crossattn_ratio: float | None = None
    mlp_ratio: float | None = None
    start_step: int = 0
    stop_step: int | None = None
    mlp_levels: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check_ratio(self.ratio)
        for name, switch in _PART_RATIOS.values():
            value = getattr(self, name)
            if value is not None:
                _check_ratio(value, name)
                if getattr(self, switch) is not True:
                    raise ValueError(f"{name} is set but {switch} is off: pass {switch}=True, or leave {name} unset")
        object.__setattr__(self, "tile_size", _check_tile(self.tile_size))
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(map(repr, SELECTIONS))}; got {self.selection!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise TypeError(f"temperature must be a number >= 0; got {type(self.temperature).__name__}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = hard assignment); got {self.temperature}")
        for name in ("recompute_every", "levels"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("seed", self.seed, minimum=None)
        if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            # torch.Generator.manual_seed's range: past it, the first forward would overflow
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1] (torch's generator seeds); got {self.seed}")
        for name in ("share_batch_plan", "merge_attn", "merge_crossattn", "merge_mlp"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False; got {getattr(self, name)!r}")
        if self.proportional_attention is not None and not isinstance(self.proportional_attention, bool):
            raise TypeError(
                f"proportional_attention must be True, False or None (the model family's default); "
                f"got {self.proportional_attention!r}"
            )
        for name in ("flux_double_blocks", "flux_single_blocks"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _check_indices(name, value))
        if self.blocks is not None:
            object.__setattr__(self, "blocks", _check_blocks(self.blocks))
        if self.tile_frames is not None:
            _check_int("tile_frames", self.tile_frames, minimum=1)
        if self.mlp_levels is not None:
            levels = _check_indices(
                "mlp_levels", self.mlp_levels, minimum=1, what="attention levels (1 = the highest resolution)"
            )
            if not self.merge_mlp:
                raise ValueError(
                    "mlp_levels is set but merge_mlp is off: pass merge_mlp=True, or leave mlp_levels unset"
                )
            beyond = [v for v in levels if v > self.levels]
            if beyond or not levels:
                raise ValueError(f"mlp_levels must name merged levels, in 1..levels={self.levels}; got {list(levels)}")
            object.__setattr__(self, "mlp_levels", tuple(sorted(set(levels))))
        _check_int("start_step", self.start_step, minimum=0)
        if self.stop_step is not None:
            _check_int("stop_step", self.stop_step, minimum=1)
            if self.stop_step <= self.start_step:
                raise ValueError(
                    "stop_step must be greater than start_step (merging runs on steps start_step <= step < "
                    "stop_step); "
                    f"got start_step={self.start_step}, stop_step={self.stop_step}"
                )

    @property
    def windowed(self) -> bool:
        """Whether merging is limited to a window of denoising steps (``start_step``/``stop_step``)."""
        return self.start_step > 0 or self.stop_step is not None

    def merges_at(self, step: int) -> bool:
        """Whether denoising step ``step`` (0 = the run's first) is inside the step window."""
        return self.start_step <= step and (self.stop_step is None or step < self.stop_step)

    def ratio_for(self, part: str) -> float:
        """The ratio of a merged part: ``"attn"``, ``"cross"`` or ``"mlp"``."""
        value = getattr(self, _PART_RATIOS[part][0])
        return self.ratio if value is None else value

    @property
    def max_ratio(self) -> float:
        """The largest ratio of any part that merges (0: nothing is merged)."""
        # a plain loop: torch.compile traces this, and cannot take max(..., default=)
        largest = 0.0
        for part, (_, switch) in _PART_RATIOS.items():
            if getattr(self, switch):
                largest = max(largest, self.ratio_for(part))
        return largest

    @property
    def auto_tile(self) -> bool:
        """Whether the tile side follows the grid (``tile_size="auto"``)."""
        return self.tile_size == AUTO_TILE

    @property
    def tile(self) -> tuple[int, int]:
        """Tile size as ``(height, width)`` in tokens; under ``"auto"`` the largest it takes
        (:func:`toma.core.tiling.scaled_tile_side` gives the one for a grid)."""
        if self.tile_size == AUTO_TILE:
            return (AUTO_BASE, AUTO_BASE)
        return self.tile_size  # type: ignore[return-value]  # normalised in __post_init__

    def to_dict(self) -> dict[str, Any]:
        """Settings as a plain dict (for logs and JSON)."""
        out = asdict(self)
        if self.blocks is not None:
            out["blocks"] = {stack: list(indices) for stack, indices in self.blocks}
        return out

    def save(self, path: str | os.PathLike, provenance: dict[str, Any] | None = None) -> Path:
        """Write the settings as a JSON config file that :func:`load_config` reads back.

        The file holds ``format`` (``"toma-config"``), ``version`` (:data:`CONFIG_VERSION`),
        ``settings`` (every field, tuples as lists) and, when given, ``provenance``: free-form
        JSON-serialisable notes on where the settings come from (``toma tune`` records what
        it measured, on which machine, model, resolution and batch). Returns ``path``.
        """
        path = Path(path)
        doc: dict[str, Any] = {
            "format": CONFIG_FORMAT,
            "version": CONFIG_VERSION,
            "settings": _jsonable(self.to_dict()),
        }
        if provenance is not None:
            if not isinstance(provenance, dict):
                raise TypeError(f"provenance must be a dict or None; got {type(provenance).__name__}")
            doc["provenance"] = provenance
        # provenance is the caller's: an object JSON cannot hold fails here, before the file is touched
        text = json.dumps(doc, indent=2, allow_nan=False) + "\n"
        path.write_text(text, encoding="utf-8")
        return path


# the JSON config files of ToMAConfig.save / load_config
CONFIG_FORMAT = "toma-config"
CONFIG_VERSION = 1


class ConfigFileError(ValueError):
    """A ToMA config file that cannot be read: the message names the file and the field."""


def load_config(path: str | os.PathLike) -> ToMAConfig:
    """Read a config file written by :meth:`ToMAConfig.save` (or ``toma tune --out``).

    Settings left out of the file take their defaults, so a hand-written
    ``{"format": "toma-config", "version": 1, "settings": {"ratio": 0.4}}`` works.

    Raises:
        FileNotFoundError: no file at ``path``.
        ConfigFileError: (a ``ValueError``) not JSON, not a toma config, a version newer
            than this toma reads, an unknown setting or a bad value; the message names the
            file and the field.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"toma config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigFileError(f"toma config file {path} cannot be read: {err}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigFileError(f"toma config file {path} is not valid JSON: {err}") from None
    if not isinstance(doc, dict) or doc.get("format") != CONFIG_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ConfigFileError(f"toma config file {path}: field 'format' must be {CONFIG_FORMAT!r}; got {got!r}")
    version = doc.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= CONFIG_VERSION:
        raise ConfigFileError(
            f"toma config file {path}: field 'version' must be an int from 1 to {CONFIG_VERSION} "
            f"(this toma's newest); got {version!r}"
        )
    settings = doc.get("settings")
    if not isinstance(settings, dict):
        raise ConfigFileError(
            f"toma config file {path}: field 'settings' must be an object of ToMAConfig fields; got {settings!r}"
        )
    known = {f.name for f in fields(ToMAConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ConfigFileError(
            f"toma config file {path}: unknown setting(s) {', '.join(unknown)} in 'settings'; allowed: "
            f"{', '.join(sorted(known))}"
        )
    if "provenance" in doc and not isinstance(doc["provenance"], dict):
        raise ConfigFileError(
            f"toma config file {path}: field 'provenance' must be an object; got {doc['provenance']!r}"
        )
    # each field on its own first, so that the error names the one that is wrong
    for f in fields(ToMAConfig):
        if f.name in settings:
            base = {} if f.name not in _PART_SWITCH else {_PART_SWITCH[f.name]: True}
            try:
                ToMAConfig(**base, **{f.name: settings[f.name]})
            except (TypeError, ValueError) as err:
                raise ConfigFileError(f"toma config file {path}: setting {f.name!r}: {err}") from None
    try:
        return ToMAConfig(**settings)
    except (TypeError, ValueError) as err:
        raise ConfigFileError(f"toma config file {path}: settings do not go together: {err}") from None


def _jsonable(value: Any) -> Any:
    """Tuples as lists, recursively (what JSON writes anyway; explicit so the result compares equal)."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def make_config(config: ToMAConfig | None = None, **options: Any) -> ToMAConfig:
    """Build a validated config from an optional base config and keyword options.

    Raises:
        TypeError: an option name that ToMAConfig does not have, or a wrong type.
        ValueError: a value outside its allowed range.
    """
    if config is not None and not isinstance(config, ToMAConfig):
        raise TypeError(f"config must be a ToMAConfig; got {type(config).__name__}")
    known = {f.name for f in fields(ToMAConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown ToMA option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
    return replace(config, **options) if config is not None else ToMAConfig(**options)


def parse_option(text: str) -> tuple[str, Any]:
    """``"levels=2"`` -> ``("levels", 2)``: a ToMAConfig option and a Python literal value.

    For command lines that pass options through (``--set levels=2 --set blocks={"blocks": (3,)}``).
    The value is checked later, by :func:`make_config`.

    Raises:
        ValueError: not ``NAME=VALUE``, a name ToMAConfig does not have, or a value that
            is not a Python literal.
    """
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f"an option must be NAME=VALUE; got {text!r}")
    known = {f.name for f in fields(ToMAConfig)}
    if name not in known:
        raise ValueError(f"unknown ToMA option {name!r}; allowed: {', '.join(sorted(known))}")
    try:
        return name, ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        raise ValueError(f"option {name}: {value!r} is not a Python literal (e.g. 2, True, 0.25, (1, 2))") from None


# per-part ratio fields and the switch each needs
_PART_RATIOS = {
    "attn": ("attn_ratio", "merge_attn"),
    "cross": ("crossattn_ratio", "merge_crossattn"),
    "mlp": ("mlp_ratio", "merge_mlp"),
}
_PART_SWITCH = {name: switch for name, switch in _PART_RATIOS.values()}


def _check_ratio(ratio: Any, name: str = "ratio") -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise TypeError(f"{name} must be a number in [0, 1); got {type(ratio).__name__}")
    if not (0.0 <= ratio < 1.0):  # also rejects NaN
        raise ValueError(f"{name} must be in [0, 1) (the fraction of tokens merged away); got {ratio}")


def _check_tile(tile: Any) -> tuple[int, int] | str:
    if tile == AUTO_TILE:
        return AUTO_TILE
    pair = (tile, tile) if isinstance(tile, int) and not isinstance(tile, bool) else tile
    if (
        not isinstance(pair, (tuple, list))
        or len(pair) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
    ):
        raise TypeError(f"tile_size must be 'auto', an int or a (height, width) pair of ints; got {tile!r}")
    if min(pair) < 1:
        raise ValueError(f"tile_size must be at least 1 token on each side; got {tile!r}")
    return (int(pair[0]), int(pair[1]))


# the seeds torch.Generator.manual_seed takes
SEED_RANGE = (-(2**63), 2**64 - 1)


def _check_int(name: str, value: Any, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")


def _check_indices(name: str, value: Any, minimum: int = 0, what: str = "block indices") -> tuple[int, ...]:
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of {what} or None; got {value!r}") from None
    for v in items:
        _check_int(f"{name} entries", v, minimum=minimum)
    return items


def _check_blocks(value: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``{stack: indices}`` as a hashable, sorted tuple of ``(stack, indices)`` pairs."""
    items = value.items() if hasattr(value, "items") else value
    try:
        pairs = [(stack, indices) for stack, indices in items]
    except (TypeError, ValueError):
        raise TypeError(
            f"blocks must map block-stack names to block indices, e.g. {{'transformer_blocks': range(5, 19)}}; "
            f"got {value!r}"
        ) from None
    out = []
    for stack, indices in pairs:
        if not isinstance(stack, str):
            raise TypeError(f"blocks keys must be block-stack names (str); got {stack!r}")
        out.append((stack, _check_indices(f"blocks[{stack!r}]", indices)))
    return tuple(sorted(out))
