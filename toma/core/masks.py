"""A model's attention mask over a joint ``[text; image]`` sequence, fitted to merged image tokens.

Families such as Flux (a mask in ``joint_attention_kwargs``) and Chroma (its text padding
mask, made ``(B, 1, S, S)`` by each block) pass masks laid out over the unmerged sequence.
When every image position of the mask holds the same value within a sample (on the key
axis, and on the query axis where there is one), the image positions are interchangeable:
any ``K`` of them give the mask over ``K`` merged image tokens, and so does a permutation
of them (tile order). Such a mask is fitted by slicing: the text part unchanged, ``K``
image positions left. A mask whose image positions differ (a structured mask: regions,
causal rows) has no merged form; its call runs unmerged.

Layouts are those diffusers' dispatch takes: ``(B, S)`` key masks, ``(B, Sq, S)`` and
``(B, H, Sq, S)`` with ``Sq`` 1 (broadcast over queries) or ``S`` (one row per query), bool
(True keeps a key) or additive. The sequence is text first: the image (and any
conditioning tokens after it, which the caller then counts as image) is the last
``tokens`` positions of each axis.
"""

from __future__ import annotations

import torch


def layout_problem(mask: torch.Tensor, keys: int) -> str | None:
    """Why ``mask`` is not one of the layouts above over ``keys`` keys, or None if it is."""
    if mask.ndim not in (2, 3, 4):
        return f"an attention mask of {mask.ndim} dimensions (toma fits (B, S), (B, Sq, S) and (B, H, Sq, S))"
    if mask.shape[-1] != keys:
        return f"an attention mask over {mask.shape[-1]} keys, where the call's joint sequence has {keys}"
    if mask.ndim > 2 and mask.shape[-2] not in (1, keys):
        return f"an attention mask with {mask.shape[-2]} query rows (toma fits 1 or the {keys} of the sequence)"
    return None


def image_uniform(mask: torch.Tensor, tokens: int) -> bool:
    """Whether every one of the last ``tokens`` positions of ``mask`` holds the same value
    per sample: along the keys (in every row) and, for one row per query, along the queries.

    One read of the result: a host sync on an accelerator.
    """
    if tokens <= 1:
        return True
    keys = mask[..., -tokens:]
    if not bool((keys == keys[..., :1]).all()):
        return False
    if mask.ndim == 2 or mask.shape[-2] == 1:
        return True
    rows = mask[..., -tokens:, :]
    return bool((rows == rows[..., :1, :]).all())


def slice_joint_mask(mask: torch.Tensor, tokens: int, kept: int) -> torch.Tensor:
    """``mask`` over a sequence whose last ``tokens`` positions merged to ``kept``: its first
    ``S - tokens + kept`` positions on the key axis and, for one row per query, on the query
    axis (a view). Exact only where :func:`image_uniform` holds."""
    if not 0 <= kept <= tokens <= mask.shape[-1]:
        raise ValueError(f"kept must be in [0, tokens] and tokens at most the mask's {mask.shape[-1]} keys")
    length = mask.shape[-1] - tokens + kept
    out = mask[..., :length]
    if mask.ndim > 2 and mask.shape[-2] == mask.shape[-1] != 1:
        out = out[..., :length, :]
    return out


def slice_image_first_mask(mask: torch.Tensor, tokens: int, kept: int) -> torch.Tensor:
    """``mask`` over a sequence whose first ``tokens`` positions merged to ``kept`` (an
    image-first one, ``[image; suffix]``): its last ``S - tokens + kept`` positions on the key
    axis and, for one row per query, on the query axis (a view). Exact only where the mask
    holds one value over the image per sample, which the family must guarantee."""
    if not 0 <= kept <= tokens <= mask.shape[-1]:
        raise ValueError(f"kept must be in [0, tokens] and tokens at most the mask's {mask.shape[-1]} keys")
    start = tokens - kept
    out = mask[..., start:]
    if mask.ndim > 2 and mask.shape[-2] == mask.shape[-1] != 1:
        out = out[..., start:, :]
    return out


def fit_joint_mask(mask: torch.Tensor, tokens: int, kept: int) -> torch.Tensor | None:
    """The model's ``mask`` over ``text + tokens`` positions fitted to ``kept`` merged image
    tokens, or None where it has no merged form (an unknown layout, or image positions that
    differ: the call must then run unmerged)."""
    if layout_problem(mask, mask.shape[-1]) is not None or tokens > mask.shape[-1]:
        return None
    if not image_uniform(mask, tokens):
        return None
    return slice_joint_mask(mask, tokens, kept)
