"""How toma reaches a ComfyUI family's blocks: the kinds of site a family file picks.

A family (:mod:`toma.comfyui.families`) states its facts as one :class:`Site`: which block
stacks the ``blocks`` input may name, the latent's patch, and the patches it puts on a
clone. The shared kinds are here:

* :class:`BlockReplace`, ComfyUI's block replacement (``patches_replace["dit"]``) around each
  chosen block of each :class:`Stack`, with a family-made replacement per block;
* :class:`JointBlock`, the replacement of the joint-stream families (Flux, Chroma,
  HunyuanVideo, Qwen-Image, SD3), whose block arguments differ only as :class:`JointArgs` say.

The token layout of a merged call is :data:`toma.adapters.layouts.BETWEEN`'s, as on the
diffusers path: the image sits between tokens that pass whole. A family whose hook is its
own (NextDiT's object patches, the UNet's attn1 patches) subclasses :class:`Site` in its file.
Nothing here names a family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from toma.adapters.layouts import BETWEEN
from toma.comfyui import hooks

# the authors' Flux default, which toma's diffusers path keeps for Wan too: every block but
# the first few, which lay out the image
SKIPPED_BLOCKS = 5


class Site:
    """How toma merges a ComfyUI family. Subclasses state the blocks and install the patches.

    Attributes:
        whole_blocks: the merge spans whole blocks (attention and MLP together), so
            ``merge_mlp="off"`` is refused; False: attention only, so ``"on"`` is refused.
        override: proportional attention goes through ComfyUI's attention override.
        first: the number the ``blocks`` input counts this family's blocks from.
    """

    whole_blocks: bool = True
    override: bool = True
    first: int = 0

    def counts(self, dm: Any) -> dict[str, int]:
        """Blocks per stack of denoiser ``dm``: the stacks the ``blocks`` input may name."""
        raise NotImplementedError

    def patch(self, dm: Any) -> int | tuple[int, int, int]:
        """Latent pixels per token side, or ``(frames, height, width)`` for video."""
        raise NotImplementedError

    def defaults(self, dm: Any, counts: dict[str, int]) -> dict[str, tuple[int, ...]]:
        """The blocks merged when the ``blocks`` input is empty: all but the first few."""
        return {s: tuple(range(min(SKIPPED_BLOCKS, c), c)) for s, c in counts.items()}

    def resolve(self, dm: Any, chosen: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[int, ...]], tuple]:
        """``(chosen as the log names them, levels)``; only the UNet has levels."""
        return chosen, ()

    def mlp_refusal(self, merge_mlp: str, title: str) -> str | None:
        """Why ``merge_mlp`` cannot be honoured here, or None."""
        if self.whole_blocks and merge_mlp == "off":
            return (
                f"merge_mlp: 'off' is not available on {title}: toma merges around whole blocks there "
                "(attention and MLP together); use 'auto' or 'on'"
            )
        return None

    def install(self, clone: Any, model: Any, dm: Any, run: Any, chosen: dict, proportional: bool) -> None:
        """Put the patches on ``clone`` (a clone of ``model``) for the ``chosen`` blocks."""
        raise NotImplementedError


@dataclass(frozen=True)
class Stack:
    """One stack of blocks: its name in the ``blocks`` input and the log, the denoiser's
    attribute holding it, and the block-replacement kind ComfyUI looks its blocks up under."""

    name: str
    attr: str
    kind: str = hooks.DOUBLE_BLOCK


def patch_side(dm: Any, default: int = 2) -> int:
    """An image family's patch side: ``dm.patch_size``, an int or a sequence ending in it."""
    side = getattr(dm, hooks.PATCH_SIZE, default)
    return int(side[-1] if isinstance(side, (tuple, list)) else side)


def patch_video(dm: Any, default: tuple[int, int, int] = (1, 2, 2)) -> tuple[int, int, int]:
    """A video family's ``(frames, height, width)`` patch: ``dm.patch_size``, or an image
    family's side with one frame."""
    side = getattr(dm, hooks.PATCH_SIZE, default)
    if isinstance(side, (tuple, list)):
        return tuple(int(p) for p in side)  # type: ignore[return-value]
    return (1, int(side), int(side))


@dataclass(frozen=True)
class BlockReplace(Site):
    """ComfyUI's block replacement around each chosen block.

    Attributes:
        stacks: the stacks, in the order their blocks run.
        block: ``block(run, stack, index, proportional)`` -> the replacement of one block.
        patch_of: the latent's patch, read from the denoiser.
        override: proportional attention goes through the attention override (False where
            the block takes a key mask that carries it).
    """

    stacks: tuple[Stack, ...]
    block: Callable[[Any, Stack, int, bool], Callable]
    patch_of: Callable[[Any], int | tuple[int, int, int]] = patch_side
    override: bool = True

    def counts(self, dm: Any) -> dict[str, int]:
        return {s.name: len(getattr(dm, s.attr)) for s in self.stacks}

    def patch(self, dm: Any) -> int | tuple[int, int, int]:
        return self.patch_of(dm)

    def install(self, clone: Any, model: Any, dm: Any, run: Any, chosen: dict, proportional: bool) -> None:
        for stack in self.stacks:
            for i in chosen.get(stack.name, ()):
                clone.set_model_patch_replace(self.block(run, stack, i, proportional), hooks.DIT_REPLACE, stack.kind, i)


# -- the joint-stream families' block -----------------------------------------------------------


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in a block's ``vec``: a tensor, a tuple of them, or of ComfyUI's
    modulation records (whose ``shift`` is one)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = first_tensor(item)
            if found is not None:
                return found
        return None
    return first_tensor(getattr(value, hooks.MODULATION_SHIFT, None))


def segment_modulation(vec: Any, batch: int) -> bool:
    """Whether the block modulates spans of the sequence apart (Kontext's reference tokens at
    timestep zero): the modulation then addresses tokens by position, which merging moves."""
    t = first_tensor(vec)
    return t is not None and (t.shape[0] != batch or (t.ndim == 3 and t.shape[1] > 1))


def slice_key_mask(mask: torch.Tensor, text: int, n: int, image_bias: torch.Tensor) -> torch.Tensor | None:
    """A key mask ``(B', 1, text + n + tail)`` over ``[text; image; tail]`` rebuilt for the
    merged sequence with ``image_bias`` ``(Bp, K)`` on the image's keys: ``(B, 1, 1, L')``.
    None where the mask is not such a key mask or is not 0 over the image's keys (a mask
    on the image itself, which merging cannot keep)."""
    if mask.ndim != 3 or mask.shape[1] != 1 or not mask.is_floating_point():
        return None
    if bool(mask[..., text : text + n].any()):
        return None
    b = max(mask.shape[0], image_bias.shape[0])
    head = mask[..., :text].expand(b, -1, -1)
    tail = mask[..., text + n :].expand(b, -1, -1)
    return torch.cat((head, image_bias.to(mask.dtype).expand(b, -1)[:, None], tail), -1)[:, :, None]


@dataclass(frozen=True)
class JointArgs:
    """How a joint-stream family's block replacement passes its block.

    Attributes:
        mask_key: the ``args`` key of the attention mask (an additive key mask over
            ``[text; image]``), or None where the block takes none: proportional attention
            then goes through the attention override.
        fixed_keys: ``args`` keys which, when set, address tokens by position (modulation
            spans): such a call runs unmerged, with the reason.
        tail: whether tokens may follow the image's (Kontext's references, passed whole).
    """

    mask_key: str | None
    fixed_keys: tuple[str, ...] = ()
    tail: bool = True

    def block(self, run: Any, stack: Stack, index: int, proportional: bool) -> JointBlock:
        """A :class:`JointBlock` for block ``index`` of ``stack`` (a :class:`BlockReplace` maker)."""
        return JointBlock(run, self, stack.kind, index, proportional, stack.name)


class JointBlock:
    """A joint-stream family's block replacement: merge the image tokens entering a double or
    single block, run the block on ``K`` of them, and add the unmerged change to the
    full-size stream.

    The rotary table ``pe`` (over ``[text; image; tail]``) gets each merged token's
    destination's row, so that positions stay those of real tokens; text and any tokens
    after the image (Kontext's references) pass whole. Single blocks carry ``[text; image]``
    in ``img`` (``img_slice`` says where the image starts). ControlNet residuals are added
    by the model after the block, on full-size tokens. Proportional attention is the key
    mask the block takes anyway where it takes one (the family's text mask, with
    ``log(mass)`` on merged keys), else the attention override's bias.
    """

    def __init__(self, run: Any, layout: JointArgs, kind: str, index: int, proportional: bool, stack: str = "") -> None:
        self.run, self.layout, self.kind, self.index, self.proportional = run, layout, kind, index, proportional
        self.stack = stack or kind.split("_")[0]  # the blocks input's name for the block's stack

    def __call__(self, args: dict, extra: dict) -> dict:
        """The replacement, as ComfyUI calls it: ``args`` of the block, ``extra["original_block"]``."""
        original = extra[hooks.ORIGINAL_BLOCK]
        run, layout = self.run, self.layout
        if not run.merging or run.grid is None:
            return original(args)
        grid = run.grid
        n = math.prod(grid)
        seq = args[hooks.ARG_IMG]
        single = self.kind == hooks.SINGLE_BLOCK
        text = (args.get(hooks.TO_TRANSFORMER_OPTIONS) or {}).get(hooks.TO_IMG_SLICE, [0])[0] if single else 0
        tail = seq.shape[1] - text - n
        if tail < 0 or (tail and not layout.tail):
            run.skipped = "the sequence holds tokens besides the image's where this family keeps none"
            return original(args)
        if any(args.get(key) is not None for key in layout.fixed_keys) or segment_modulation(
            args.get(hooks.ARG_VEC), seq.shape[0]
        ):
            run.skipped = "parts of the sequence are modulated apart (reference or guiding-frame timesteps)"
            return original(args)
        head, image, rest = BETWEEN.split(seq, text, n)
        plan = run.plan(image, grid, "dit")
        if plan is None:
            return original(args)
        pe_text = text if single else args[hooks.ARG_TXT].shape[1]
        mask = args.get(layout.mask_key) if layout.mask_key is not None else None
        bias = plan.log_mass if self.proportional else plan.log_mass.new_zeros(plan.log_mass.shape)
        new = dict(args)
        if mask is not None:
            new[layout.mask_key] = slice_key_mask(mask, pe_text, n, bias)
            if new[layout.mask_key] is None:
                run.skipped = "the attention mask covers image tokens, which toma does not merge yet"
                return original(args)
        elif self.proportional and layout.mask_key is not None:
            new[layout.mask_key] = BETWEEN.bias(plan.log_mass, pe_text, tail, seq.dtype)[:, None, None, :]
        merged = plan.merge(image)
        k = merged.shape[1]
        if args.get(hooks.ARG_PE) is not None:
            kept = BETWEEN.kept(plan.dest_tokens.to(seq.device), pe_text, n, pe_text + n + tail)
            new[hooks.ARG_PE] = BETWEEN.gather(args[hooks.ARG_PE], kept, dim=2)
        # the block adds to its input in place: it gets a copy, ``merged`` stays M x
        new[hooks.ARG_IMG] = torch.cat((head, merged, rest), 1)
        if self.proportional and layout.mask_key is None:  # the block's joint attention takes it
            run.bias = BETWEEN.bias(plan.log_mass, pe_text, tail, seq.dtype)
        try:
            out = original(new)
        finally:
            run.bias = None
        y = out[hooks.ARG_IMG]
        y_head, y_image, y_rest = BETWEEN.split(y, text, k)
        image_out = plan.unmerge(y_image - merged, residual=image)
        run.count(self.stack, self.index, n, k)
        result = dict(out)
        result[hooks.ARG_IMG] = torch.cat((y_head, image_out, y_rest), 1)
        return result


# -- the blocks whose image stream is alone -------------------------------------------------------


def rows_on_dim1(table: Any, positions: torch.Tensor) -> Any:
    """A rotary table with tokens on dim 1, taken at ``positions`` ``(Bp, K)``."""
    return BETWEEN.gather(table, positions, dim=1)


@dataclass(frozen=True)
class AloneArgs:
    """How a video family's block replacement passes its block, whose ``img`` is the video's
    tokens alone (Wan, LTX-Video): the block (self-attention, cross-attention's queries and
    the MLP) runs on ``K`` merged tokens, and its change is unmerged onto the full stream.

    Attributes:
        per_token: why a call whose timestep embedding (``vec``) is per token runs unmerged.
        table: ``table(pe, positions)``: the rotary table ``pe`` at the kept positions.
        fixed_keys: ``args`` keys which, when set, address tokens by position (a mask over
            the video's own tokens): such a call runs unmerged, with the reason.
    """

    per_token: str
    table: Callable[[Any, torch.Tensor], Any] = rows_on_dim1
    fixed_keys: tuple[str, ...] = ()

    def block(self, run: Any, stack: Stack, index: int, proportional: bool) -> AloneBlock:
        """An :class:`AloneBlock` for block ``index`` of ``stack`` (a :class:`BlockReplace` maker)."""
        return AloneBlock(run, self, index, proportional, stack.name)


class AloneBlock:
    """One block of a video family, merged (see :class:`AloneArgs`). Proportional attention
    goes through the attention override, armed for the block's first attention call, its
    self-attention."""

    def __init__(self, run: Any, layout: AloneArgs, index: int, proportional: bool, stack: str = "blocks") -> None:
        self.run, self.layout, self.index, self.proportional, self.stack = run, layout, index, proportional, stack

    def __call__(self, args: dict, extra: dict) -> dict:
        """The replacement, as ComfyUI calls it: ``args`` of the block, ``extra["original_block"]``."""
        original = extra[hooks.ORIGINAL_BLOCK]
        run = self.run
        if not run.merging or run.grid is None:
            return original(args)
        x, vec = args[hooks.ARG_IMG], args[hooks.ARG_VEC]
        n = math.prod(run.grid)
        if x.shape[1] != n:
            run.skipped = "the sequence holds tokens besides the video's (reference or context latents)"
            return original(args)
        if vec.ndim >= 3 and vec.shape[1] != 1:
            run.skipped = self.layout.per_token
            return original(args)
        if any(args.get(key) is not None for key in self.layout.fixed_keys):
            run.skipped = "a mask over the video's own tokens addresses them by position"
            return original(args)
        plan = run.plan(x, run.grid, "dit")
        if plan is None:
            return original(args)
        merged = plan.merge(x)
        new = dict(args)
        new[hooks.ARG_IMG] = merged
        if args.get(hooks.ARG_PE) is not None:
            new[hooks.ARG_PE] = self.layout.table(args[hooks.ARG_PE], plan.dest_tokens.to(x.device))
        if self.proportional:
            run.bias = plan.log_mass
        try:
            out = original(new)
        finally:
            run.bias = None
        result = dict(out)
        result[hooks.ARG_IMG] = plan.unmerge(out[hooks.ARG_IMG] - merged, residual=x)
        run.count(self.stack, self.index, n, merged.shape[1])
        return result
