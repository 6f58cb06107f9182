"""Proportional attention's key bias, three exact ways.

A merged key stands for ``mass`` tokens; proportional attention adds ``log(mass)`` to every
logit against it, so that ``softmax(s + log m)`` weighs the merged key as its ``m`` copies
would. The bias depends on the key only, which allows three exact forms of it:

* the **float mask** (:func:`additive_mask`): ``(Bp, 1, 1, Sk)`` added to the logits, which
  keeps flash kernels out (they take no mask);
* the **key channel** (:func:`key_channel`): one more channel holding 1 in the queries,
  ``log(mass) / scale`` in the keys and 0 in the values, so that
  ``scale * q'.k' = scale * q.k + log(mass)`` and the extra output channel is 0. The softmax
  scale must be the original one, passed explicitly: the default ``1 / sqrt(D)`` would
  follow the widened head dimension;
* a **FlexAttention score_mod** (:func:`bias_score_mod`): ``score + log_mass[b, kv_idx]``,
  which torch compiles into the fused kernel.

``log_mass`` is ``(Bp, Sk)`` over the call's keys, ``Bp`` 1 (one plan for the batch) or the
batch; keys that are not merged (text) have log mass 0 (:func:`with_text_keys`), and keys
a model masks out (text padding) ``-inf`` (:func:`masked_out`), in every form. Attention
tensors are ``(B, H, S, D)`` (``layout="bhsd"``, torch's) or ``(B, S, H, D)``
(``"bshd"``, diffusers' dispatch).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

LAYOUTS = ("bhsd", "bshd")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)} (got {layout!r})")


def with_text_keys(log_mass: torch.Tensor, before: int = 0, after: int = 0) -> torch.Tensor:
    """Log masses ``(Bp, K)`` of merged image keys with ``before`` and ``after`` unmerged
    keys of log mass 0 around them: ``(Bp, before + K + after)``."""
    if before < 0 or after < 0:
        raise ValueError(f"before and after must be >= 0 (got {before}, {after})")
    if not before and not after:
        return log_mass
    parts = [log_mass.new_zeros(log_mass.shape[0], before), log_mass, log_mass.new_zeros(log_mass.shape[0], after)]
    return torch.cat(parts, dim=1)


def masked_out(log_mass: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Log masses ``(Bp, Sk)`` with ``-inf`` where ``keep`` ``(Bk, Sk)`` (bool, ``Bk`` 1 or
    the batch) is False: a key padding mask folded into the bias, ``(max(Bp, Bk), Sk)``."""
    if keep is None:
        return log_mass
    if keep.dtype != torch.bool or keep.ndim != 2 or keep.shape[1] != log_mass.shape[1]:
        raise ValueError(
            f"keep must be a bool (Bk, {log_mass.shape[1]}) mask over the keys (got {keep.dtype}, {tuple(keep.shape)})"
        )
    # a Python scalar, not a 0-dim tensor made on the device: that would be a copy from the
    # host at every call
    return torch.where(keep, log_mass, float("-inf"))


def _check_log_mass(log_mass: torch.Tensor, batch: int, keys: int) -> None:
    if log_mass.ndim != 2 or log_mass.shape[0] not in (1, batch) or log_mass.shape[1] != keys:
        raise ValueError(
            f"log_mass must be (1 or {batch}, {keys}) over the batch and keys (got {tuple(log_mass.shape)})"
        )


def additive_mask(log_mass: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The bias as a float attention mask ``(Bp, 1, 1, Sk)``, broadcast over heads and
    queries of ``(B, H, Sq, Sk)`` logits (the mask's layout whatever the tensors' layout)."""
    mask = log_mass[:, None, None, :]
    return mask if dtype is None else mask.to(dtype)


def default_scale(head_dim: int) -> float:
    """``1 / sqrt(head_dim)``: SDPA's softmax scale when none is given."""
    return 1.0 / math.sqrt(head_dim)


def key_channel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_mass: torch.Tensor,
    scale: float | None = None,
    layout: str = "bhsd",
    multiple: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Query, key and value with the bias as one more channel, and the softmax scale to pass.

    The new head dimension is ``D + 1`` rounded up to ``multiple`` (zero channels after the
    bias channel change no dot product): kernels pad odd head dimensions anyway, and a
    multiple of 8 is what torch's fused kernels take without copying. The result of
    attention over them, ``(..., D')``, gives the original output as ``out[..., :D]``
    (:func:`drop_key_channel`).

    Args:
        query, key, value: ``(B, H, S, D)`` or ``(B, S, H, D)`` per ``layout``; the value's
            head dimension may differ from the query's.
        log_mass: ``(Bp, Sk)`` over the keys.
        scale: the softmax scale of the original attention (None: ``1 / sqrt(D)``).
        layout: ``"bhsd"`` or ``"bshd"``.
        multiple: round the widened head dimension up to this (1: just ``D + 1``).

    Returns:
        ``(query', key', value', scale)``: call the attention with ``scale=scale``.
    """
    _check_layout(layout)
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1 (got {multiple})")
    seq = 2 if layout == "bhsd" else 1
    batch, keys, d = key.shape[0], key.shape[seq], query.shape[-1]
    _check_log_mass(log_mass, batch, keys)
    scale = default_scale(d) if scale is None else float(scale)
    if scale <= 0:
        raise ValueError(f"scale must be > 0 (got {scale})")
    extra = -(-(d + 1) // multiple) * multiple - d
    # one rounding to the keys' dtype, from float32 or wider: the bias is as exact as the mask's
    wide = torch.promote_types(torch.promote_types(log_mass.dtype, key.dtype), torch.float32)
    bias = (log_mass.to(wide) / scale).to(key.dtype)
    bias = bias[:, None, :, None] if layout == "bhsd" else bias[:, :, None, None]
    heads_shape = list(key.shape[:-1])
    k_extra = torch.cat([bias.expand(batch, *heads_shape[1:], 1), key.new_zeros(*heads_shape, extra - 1)], -1)
    q_extra = torch.cat([query.new_ones(*query.shape[:-1], 1), query.new_zeros(*query.shape[:-1], extra - 1)], -1)
    v_extra = value.new_zeros(*value.shape[:-1], extra) if value.shape[-1] == d else None
    q = torch.cat([query, q_extra], -1)
    k = torch.cat([key, k_extra], -1)
    # values need the width only where a kernel wants q, k and v of one head dimension
    v = value if v_extra is None else torch.cat([value, v_extra], -1)
    return q, k, v, scale


def drop_key_channel(out: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Attention output over :func:`key_channel`'s tensors, back to the values' ``head_dim``."""
    return out if out.shape[-1] == head_dim else out[..., :head_dim]


def key_channel_attention(
    attend: Callable[..., torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_mass: torch.Tensor,
    scale: float | None = None,
    layout: str = "bhsd",
    multiple: int = 8,
) -> torch.Tensor:
    """``attend(q', k', v', scale=scale)`` over :func:`key_channel`'s tensors, with the
    extra output channels dropped: attention with the key bias on a kernel that takes no
    mask. ``attend`` is e.g. ``F.scaled_dot_product_attention`` (``"bhsd"``)."""
    q, k, v, scale = key_channel(query, key, value, log_mass, scale, layout, multiple)
    return drop_key_channel(attend(q, k, v, scale=scale), value.shape[-1])


def bias_score_mod(log_mass: torch.Tensor) -> Callable:
    """A FlexAttention ``score_mod`` adding ``log_mass[b, kv_idx]`` to each score (``Bp`` 1:
    the same row for every sample)."""
    if log_mass.ndim != 2:
        raise ValueError(f"log_mass must be (Bp, Sk) (got {tuple(log_mass.shape)})")
    if log_mass.shape[0] == 1:
        row = log_mass[0]

        def shared(score, b, h, q_idx, kv_idx):
            return score + row[kv_idx]

        return shared

    def per_sample(score, b, h, q_idx, kv_idx):
        return score + log_mass[b, kv_idx]

    return per_sample


def flex_attention_with_bias(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_mass: torch.Tensor,
    scale: float | None = None,
    layout: str = "bhsd",
    flex: Callable | None = None,
) -> torch.Tensor:
    """FlexAttention with the key bias as its ``score_mod``, in ``layout``.

    ``flex`` is the ``flex_attention`` to call (a compiled one, say; None: torch's, which
    runs unfused unless the caller is compiled).
    """
    _check_layout(layout)
    if flex is None:
        from torch.nn.attention.flex_attention import flex_attention as flex
    seq = 2 if layout == "bhsd" else 1
    _check_log_mass(log_mass, key.shape[0], key.shape[seq])
    if layout == "bshd":
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    out = flex(query, key, value, score_mod=bias_score_mod(log_mass), scale=scale)
    return out if layout == "bhsd" else out.transpose(1, 2)
