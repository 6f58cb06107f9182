"""Cost of proportional attention beside a model mask with a row per query (Ideogram 4's).

A bool ``(1, 1, S, S)`` mask, block-diagonal over a left padding and the rest, as Ideogram 4's
segment mask is, at its merged call's shapes (18 heads of 256). Times, by the process's CPU
time, interleaved round by round, one thread:

* building the float mask the bias needs, four passes (zeros, masked_fill, add: toma before
  bf4186f) against one ``torch.where`` (:meth:`toma.adapters.attention.KeyBias.mask`);
* torch's SDPA with the bool mask alone (what the ideal runs), with that float mask, and with
  the bias as one more key channel beside the bool mask.

    python benchmarks/per_query_mask_cost.py --positions 4096 10240 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from toma.core import proportional as P

HEADS, HEAD_DIM = 18, 256


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, nargs="+", default=[4096, 10240])
    parser.add_argument("--padding", type=float, default=0.25, help="share of the positions that are left padding")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)  # CPU time equals work only with one thread
    for s in args.positions:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, HEADS, s, HEAD_DIM, generator=g) for _ in range(3))
        pad = int(s * args.padding)
        own = torch.zeros(1, 1, s, s, dtype=torch.bool)
        own[..., :pad, :pad] = True
        own[..., pad:, pad:] = True
        log_mass = torch.rand(1, s, generator=g).log()
        bias = log_mass[:, None, None, :]

        def four_passes():
            return bias + torch.zeros(own.shape).masked_fill(~own, float("-inf"))

        def where():
            return torch.where(own, bias, float("-inf"))

        float_mask = where()
        assert torch.equal(float_mask, four_passes())
        q2, k2, v2, wide = P.key_channel(q, k, v, log_mass)
        cases = {
            "mask build: four passes": four_passes,
            "mask build: where": where,
            "SDPA, bool mask (the ideal)": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=own),
            "SDPA, float mask with the bias": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask),
            "SDPA, key channel + bool mask": lambda: F.scaled_dot_product_attention(
                q2, k2, v2, attn_mask=own, scale=wide
            ),
        }
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, fn in cases.items():
                samples[name].append(cpu_seconds(fn))
        print(f"{s} positions ({pad} padding), {HEADS} heads of {HEAD_DIM}, {args.rounds} rounds, CPU s:")
        for name, times in samples.items():
            print(f"  {name:34s} median {statistics.median(times):8.3f}  ({min(times):.3f}-{max(times):.3f})")


if __name__ == "__main__":
    main()
