"""FLOPs of one transformer block of a video DiT, split by part, unmerged and at a merge ratio.

Counts multiply-adds x 2 of the matmuls (the rest is a few percent) for Wan 2.1 from its
published config: self-attention projections and scores (QK^T and PV over all video
tokens), cross-attention to the text, and the MLP. At ``--ratio r`` ToMA's default merges
the self-attention's tokens: its projections see ``(1 - r) N`` tokens and its scores
``((1 - r) N)^2``; the rest is unchanged. The ratio of the two totals is the speedup an
ideal merge gives a block whose time follows its FLOPs (a GPU at a fixed efficiency).

    python benchmarks/attention_share.py                      # Wan 2.1 1.3B, 480p x 81 frames
    python benchmarks/attention_share.py --frames 25 --arch wan
"""

from __future__ import annotations

import argparse

from toma.tools.archs import ARCHS, token_grid


def block_flops(dim: int, ffn: int, tokens: int, text: int, merged: int) -> dict[str, float]:
    """FLOPs of one Wan-style block with ``merged`` of ``tokens`` tokens in self-attention."""
    return {
        "self-attention scores": 4.0 * merged * merged * dim,  # QK^T and PV
        "self-attention projections": 8.0 * merged * dim * dim,  # q, k, v, out
        "cross-attention": 4.0 * tokens * dim * dim + 4.0 * text * dim * dim + 4.0 * tokens * text * dim,
        "MLP": 4.0 * tokens * dim * ffn,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="wan", choices=["wan"])
    p.add_argument("--resolution", type=int, default=480)
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--ratio", type=float, default=0.5)
    args = p.parse_args()
    arch = ARCHS[args.arch]
    cfg = arch.config
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    grid = token_grid(arch, args.resolution, args.frames)
    tokens = grid[0] * grid[1] * grid[2]
    full = block_flops(dim, cfg["ffn_dim"], tokens, arch.text_tokens, tokens)
    merged = block_flops(dim, cfg["ffn_dim"], tokens, arch.text_tokens, round(tokens * (1 - args.ratio)))
    total, total_m = sum(full.values()), sum(merged.values())
    print(f"{arch.description}, {args.resolution}p x {args.frames} frames: grid {grid} = {tokens} tokens, width {dim}")
    print(f"{'part':28s} {'GFLOP':>10s} {'share':>7s} {'merged GFLOP':>13s}")
    for part in full:
        print(f"{part:28s} {full[part] / 1e9:10.0f} {full[part] / total:7.1%} {merged[part] / 1e9:13.0f}")
    print(f"{'block':28s} {total / 1e9:10.0f} {1:7.1%} {total_m / 1e9:13.0f}")
    print(f"ideal speedup at ratio {args.ratio} (FLOPs): {total / total_m:.2f}x")


if __name__ == "__main__":
    main()
