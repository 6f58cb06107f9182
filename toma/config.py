"""User-facing settings of ToMA and their validation."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from toma.core.selection import SELECTIONS


@dataclass(frozen=True)
class ToMAConfig:
    """Settings for :func:`toma.apply_toma`.

    Attributes:
        ratio: fraction of image tokens removed before each merged computation, in [0, 1).
            0 patches nothing into the computation (outputs are bitwise unchanged).
        tile_size: tile side in tokens (int) or ``(height, width)``; selection and merging
            happen inside tiles. The authors' default is 4 (16 tokens, 8 kept at ratio 0.5).
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
            SDXL: 64x64 tokens at 1024px). Use a large number for every level.
        merge_attn: UNet only. Merge the tokens of self-attention.
        merge_crossattn: UNet only. Merge the queries of cross-attention.
        merge_mlp: UNet only. Merge the tokens of the feed-forward MLP.
        proportional_attention: in merged self-attention, weight each merged key by the
            number of tokens it stands for (a ``log(mass)`` bias on the attention logits), so
            that a destination absorbing many similar tokens draws the attention those
            tokens would have drawn. Exact when merged tokens are identical; costs an
            additive attention mask. None (the default) means on for UNets and Flux, where
            it was measured to help (on the built-in UNet and the built-in Flux DiT), and off
            for the other transformers, where it has not been measured.
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
            ``tile_frames x tile_size`` tokens; None means 2 (spatio-temporal tiles).
    """

    ratio: float = 0.5
    tile_size: int | tuple[int, int] = 4
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

    def __post_init__(self) -> None:
        _check_ratio(self.ratio)
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

    @property
    def tile(self) -> tuple[int, int]:
        """Tile size as ``(height, width)`` in tokens."""
        return self.tile_size  # type: ignore[return-value]  # normalised in __post_init__

    def to_dict(self) -> dict[str, Any]:
        """Settings as a plain dict (for logs and JSON)."""
        out = asdict(self)
        if self.blocks is not None:
            out["blocks"] = {stack: list(indices) for stack, indices in self.blocks}
        return out


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


def _check_ratio(ratio: Any) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise TypeError(f"ratio must be a number in [0, 1); got {type(ratio).__name__}")
    if not (0.0 <= ratio < 1.0):  # also rejects NaN
        raise ValueError(f"ratio must be in [0, 1) (the fraction of tokens merged away); got {ratio}")


def _check_tile(tile: Any) -> tuple[int, int]:
    pair = (tile, tile) if isinstance(tile, int) and not isinstance(tile, bool) else tile
    if (
        not isinstance(pair, (tuple, list))
        or len(pair) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
    ):
        raise TypeError(f"tile_size must be an int or a (height, width) pair of ints; got {tile!r}")
    if min(pair) < 1:
        raise ValueError(f"tile_size must be at least 1 token on each side; got {tile!r}")
    return (int(pair[0]), int(pair[1]))


def _check_int(name: str, value: Any, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")


def _check_indices(name: str, value: Any) -> tuple[int, ...]:
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of block indices or None; got {value!r}") from None
    for v in items:
        _check_int(f"{name} entries", v, minimum=0)
    return items


def _check_blocks(value: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``{stack: indices}`` as a hashable, sorted tuple of ``(stack, indices)`` pairs."""
    items = value.items() if hasattr(value, "items") else value
    try:
        pairs = [(stack, indices) for stack, indices in items]
    except (TypeError, ValueError):
        raise TypeError(f"blocks must map block-stack names to block indices, e.g. {{'transformer_blocks': range(5, 19)}}; got {value!r}") from None
    out = []
    for stack, indices in pairs:
        if not isinstance(stack, str):
            raise TypeError(f"blocks keys must be block-stack names (str); got {stack!r}")
        out.append((stack, _check_indices(f"blocks[{stack!r}]", indices)))
    return tuple(sorted(out))
