"""Token grids read from position ids, which several families share.

Flux.1 and its kin (Chroma, FLUX.2, FLUX.3) pass the image's positions as ``img_ids``, one
row per token; Krea 2 and Ideogram 4 read their grids from similar rows. The readers here
turn such rows into a grid, remember what they read while the same tensors come back
(:func:`tensor_version` tells when one changed in place), and cope with context
parallelism's shards. The latent-shaped readers
(:func:`toma.adapters.spec.image_grid`, :func:`toma.adapters.spec.video_grid`) stay in
:mod:`toma.adapters.spec`.
"""

from __future__ import annotations

import weakref

import torch

from toma.adapters.parallel import cp_config, shard_index, unsplit, world_size
from toma.adapters.spec import Grid
from toma.core.masks import image_uniform, layout_problem


def ids_grid(img_ids: torch.Tensor) -> tuple[int, int]:
    """Token grid ``(h, w)`` of raster-ordered Flux image ids ``(N, 3)`` (or ``(B, N, 3)``;
    Flux.2's have a fourth column), whose columns 1 and 2 are the row and column.

    Ids may go on with conditioning images' (Flux Kontext's reference, with a first column
    of 1; FLUX.2's, 10, 20, ...): the grid is that of the leading rows that share the first
    row's first column, the generated image's. Its width is the run of them that shares the
    first row's row: positions need not step by 1 (FLUX.3's pipeline scales them by 0.5).
    """
    ids = img_ids[0] if img_ids.ndim == 3 else img_ids
    # one read of the ids: one host sync, and one graph break under torch.compile
    rows = ids[:, :3].tolist()
    first, line = rows[0][0], rows[0][1]
    count = next((i for i, row in enumerate(rows) if row[0] != first), len(rows))
    width = next((i for i, row in enumerate(rows[:count]) if row[1] != line), count)
    return -(-count // width), width  # rows that are not whole: more tokens than the call's


class IdsGrid:
    """Reads the image token grid from ``img_ids`` (Flux.1, Flux.2); one per patched model.

    Reading the ids waits for the GPU; pipelines pass the same ids tensor at every step, so
    they are read once per denoising run rather than once per forward. So is the check of
    an attention mask of the model's own (:meth:`model_mask`): the same mask tensors (two,
    under classifier-free guidance) come back at every step.
    """

    MASK_NAME = "joint_attention_kwargs['attention_mask']"

    def __init__(self) -> None:
        self._known: tuple[torch.Tensor, int, tuple[int, int]] | None = None  # (ids, version, grid)
        self._masks: list[tuple[weakref.ref, int, int, bool]] = []  # (mask, version, tokens, uniform)

    def model_mask(self, call: dict) -> torch.Tensor | None:
        """The attention mask over the joint ``[text; image]`` sequence in the call, if any."""
        return (call.get("joint_attention_kwargs") or {}).get("attention_mask")

    def __call__(self, model: torch.nn.Module, call: dict) -> Grid | str | None:
        hidden, img_ids = call.get("hidden_states"), call.get("img_ids")
        if hidden is None or img_ids is None:
            return "a Flux call without img_ids gives no token grid"
        mask = self.model_mask(call)
        cp = cp_config(model)
        if mask is not None:
            why = self._mask_problem(mask, call, hidden.shape[1], cp is not None)
            if why is not None:
                return why
        if cp is not None:  # the ids are this rank's shard's; hidden_states count every rank's tokens
            whole = unsplit(img_ids, world_size(cp), shard_index(cp), img_ids.ndim - 2)
            if whole is None:
                return whole_grid(img_ids, hidden.shape[1])
            grid = self._read(whole)
            if grid[0] * grid[1] != hidden.shape[1]:
                return (
                    "under context parallelism, conditioning images' tokens (Kontext, references) are split "
                    "with the image's"
                )
            return (1, *grid)
        grid = self._read(img_ids)
        if grid[0] * grid[1] > hidden.shape[1]:
            return f"img_ids span a {grid[0]}x{grid[1]} grid but the call has {hidden.shape[1]} image tokens"
        # any tokens after the grid's are conditioning images' (Kontext, FLUX.2 references)
        return (1, *grid)

    def _mask_problem(self, mask: torch.Tensor, call: dict, tokens: int, parallel: bool) -> str | None:
        """Why the model's ``mask`` cannot follow the ``tokens`` image (and conditioning)
        tokens into merged calls, or None where every merged call can take its slice."""
        name = self.MASK_NAME
        if parallel:
            return f"under context parallelism, a call with {name} runs unmerged"
        text = call.get("encoder_hidden_states")
        keys = tokens + (text.shape[1] if isinstance(text, torch.Tensor) else 0)
        problem = layout_problem(mask, keys)
        if problem is not None:
            return f"{name} is {problem}, which toma cannot fit to merged tokens"
        if not self._uniform(mask, tokens):
            return (
                f"{name} differs over the image tokens (a structured mask), so merged tokens cannot keep it; "
                "only masks that hold one value over the image per sample (text padding) merge"
            )
        return None

    def _uniform(self, mask: torch.Tensor, tokens: int) -> bool:
        """:func:`~toma.core.masks.image_uniform`, remembered for the last two masks while they come back unchanged."""
        version = tensor_version(mask)
        for ref, known_version, known_tokens, uniform in self._masks:
            if ref() is mask and known_version == version and known_tokens == tokens:
                return uniform
        uniform = image_uniform(mask, tokens)
        self._masks = [*self._masks[-1:], (weakref.ref(mask), version, tokens, uniform)]
        return uniform

    def _read(self, img_ids: torch.Tensor) -> tuple[int, int]:
        """The image grid of ``img_ids``, read once while the same ids come back unchanged."""
        known = self._known
        if known is not None and known[0] is img_ids and known[1] == tensor_version(img_ids):
            return known[2]
        grid = ids_grid(img_ids)
        self._known = (img_ids, tensor_version(img_ids), grid)
        return grid


def whole_grid(img_ids: torch.Tensor, tokens: int) -> Grid | str:
    """Under context parallelism, where the whole ids cannot be read (:func:`unsplit`): the
    whole ``(1, h, w)`` grid of ``tokens`` image tokens from one shard's raster ids. ``w`` is
    the number of columns they take, which is every column where the shard spans at least
    two rows. Shards within one row run unmerged (whether such a shard is a whole row cannot
    be told from it, and every rank must decide alike)."""
    ids = img_ids[0] if img_ids.ndim == 3 else img_ids
    rows = ids[:, :3].tolist()  # one read of the ids: one host sync per forward
    if len({row[0] for row in rows}) > 1:
        return "under context parallelism, conditioning images' tokens (Kontext, references) are split with the image's"
    lines = {row[1] for row in rows}
    columns = {row[2] for row in rows}
    if len(lines) < 2 or len(columns) != max(columns) - min(columns) + 1:
        return "under context parallelism, a rank's shard spans less than two rows of the image"
    width = len(columns)
    if tokens % width:
        return f"under context parallelism, {tokens} image tokens are no whole rows of {width}"
    return (1, tokens // width, width)


def tensor_version(t: torch.Tensor) -> int:
    """In-place modification count of ``t``; -1 for inference tensors, which keep none."""
    return -1 if t.is_inference() else t._version
