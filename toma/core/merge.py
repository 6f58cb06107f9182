"""Merge and unmerge operators as attention-like dense matrices.

Inside one tile with ``n`` token slots and ``k`` destinations:

* ``A = softmax_over_destinations(sim[dest, :] / temperature)``, shape ``(k, n)``: every
  token spreads a unit of mass over the destinations (each column sums to 1);
* merge weights ``M = A / rowsum(A)``: each destination becomes the weighted mean of the
  tokens it absorbs (each row sums to 1);
* unmerge weights ``U = A^T``, shape ``(n, k)``: each token gets a convex mix of the
  destination outputs. For a hard 0/1 assignment ``U`` is the pseudo-inverse of ``M``.

Everything here is batched matmul and softmax over leading dimensions; no sort or scatter.
Weights are computed in float32 and cast to the activations' dtype by the caller, so a
small temperature cannot overflow fp16/bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cosine_similarity(tiles: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of the tokens inside each tile.

    Tokens at any scale their dtype holds give the similarities of their directions: bf16,
    float32 and float64 tokens are first scaled by powers of two (:func:`_power_of_two_scale`),
    fp16 ones need not be.

    Args:
        tiles: ``(..., n, C)`` tokens (any float dtype; zero rows are allowed).

    Returns:
        ``(..., n, n)`` float32 similarities in ``[-1, 1]``.
    """
    if tiles.dtype in _EXPONENT_BITS:
        tiles = tiles / _power_of_two_scale(tiles)
    unit = F.normalize(tiles.float(), dim=-1)
    return unit @ unit.transpose(-1, -2)


# the exponent bits of each float dtype whose squares can leave float32's range
_EXPONENT_BITS = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}


def _power_of_two_scale(tiles: torch.Tensor) -> torch.Tensor:
    """``(..., n, 1)``: the power of two at or below each token's largest magnitude (at
    least the dtype's smallest normal number).

    bf16 and float32 tokens beyond about 1e19 have squares that overflow float32, and tokens
    below about 1e-12 have norms under normalize's floor: either way their similarities came
    out 0, whatever their directions. Divided by this scale, a token's largest component is
    in [1, 2) (or, for a subnormal token, a normal number), and the division is exact (by a
    power of two), so tokens in range normalise to bitwise the same unit vectors as without
    it. fp16 needs none: its squares fit float32, and its smallest non-zero value is far
    above the floor.
    """
    # abs and amax: two kernels, but on the CPU 15x faster than vector_norm's ord=inf
    peak = tiles.abs().amax(-1, keepdim=True)
    bits, exponent = _EXPONENT_BITS[tiles.dtype]
    # keeping only the exponent bits rounds down to a power of two; subnormals and 0 give 0
    scale = (peak.view(bits) & exponent).view(tiles.dtype)
    return scale.clamp_min(torch.finfo(tiles.dtype).tiny)


def assignment(
    sim: torch.Tensor,
    dest: torch.Tensor,
    temperature: float,
    token_mask: torch.Tensor | None = None,
    slot_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Soft assignment of tokens to destinations.

    Args:
        sim: ``(..., n, n)`` float32 token similarities.
        dest: ``(..., k)`` destination slot indices.
        temperature: softmax temperature on cosine similarities; 0 gives a hard one-hot
            assignment to the most similar destination.
        token_mask: optional ``(..., n)`` bool, False for padded slots (they get no mass).
        slot_mask: optional ``(..., k)`` bool, False for unused destination slots (they
            receive no tokens).

    Returns:
        ``(..., k, n)`` float32 ``A``; every real token's column sums to 1. On the CPU,
        weights under :data:`NEGLIGIBLE_WEIGHT` are 0.
    """
    n = sim.shape[-1]
    logits = sim.gather(-2, dest.unsqueeze(-1).expand(*dest.shape, n))
    if slot_mask is not None:
        logits = logits.masked_fill(~slot_mask.unsqueeze(-1), float("-inf"))
    if temperature == 0:
        a = F.one_hot(logits.argmax(-2), dest.shape[-1]).transpose(-1, -2).to(sim.dtype)
    elif temperature * torch.finfo(logits.dtype).max > 4:
        # softmax shifts by the maximum itself, so this is stable while |logits| / temperature
        # stays finite (cosine similarities are within 1 + rounding): two kernels fewer than
        # the explicit shift below
        a = torch.softmax(logits / temperature, dim=-2)
    else:
        # shifted so that the best destination sits at 0: a tiny temperature then sends
        # the others to -inf rather than every logit to +-inf (which would give NaN)
        a = torch.softmax((logits - logits.amax(-2, keepdim=True)) / temperature, dim=-2)
    if temperature != 0 and a.device.type == "cpu":
        # a temperature of 1e-3 leaves weights of exp(-87) and below, some of them subnormal
        # floats, which made the CPU's merge and unmerge matmuls 2.5x slower. Weights under
        # 2**-100 move a merged token by under 2**-96 of the largest token it absorbs (16 at
        # most), far below float32's rounding of it, so they go to 0. (GPUs run subnormals at
        # full speed, and count kernels: there they stay.)
        a = a.masked_fill(a < NEGLIGIBLE_WEIGHT, 0.0)
    if token_mask is not None:
        a = a * token_mask.unsqueeze(-2).to(a.dtype)
    return a


NEGLIGIBLE_WEIGHT = 2.0**-100  # assignment weights below this are 0 on the CPU


def destination_mass(a: torch.Tensor) -> torch.Tensor:
    """Tokens each destination absorbs: the row sums ``(..., k, 1)`` of an assignment
    ``(..., k, n)``, floored at the smallest positive float so that they can divide and
    take logs (unused slots absorb nothing)."""
    return a.sum(-1, keepdim=True).clamp_min(torch.finfo(a.dtype).tiny)


def merge_weights(a: torch.Tensor, mass: torch.Tensor | None = None) -> torch.Tensor:
    """Row-normalise an assignment ``(..., k, n)`` into merge weights ``(..., k, n)``.

    ``mass`` is :func:`destination_mass` of ``a`` if already computed. Rows of unused
    slots (all zeros) stay zero.
    """
    return a / (destination_mass(a) if mass is None else mass)


def merge(tiles: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Merge tokens: ``(..., n, C)`` with weights ``(..., k, n)`` gives ``(..., k, C)``."""
    return weights @ tiles


def unmerge(merged: torch.Tensor, weights_t: torch.Tensor) -> torch.Tensor:
    """Unmerge: ``(..., k, C)`` with unmerge weights ``A^T`` ``(..., n, k)`` gives ``(..., n, C)``."""
    return weights_t @ merged
