"""Cost of proportional attention's additive mask inside one merged self-attention.

Times ``scaled_dot_product_attention`` with and without a ``(B, 1, 1, K)`` float mask at the
merged shapes of SDXL's two attention levels at 1024x1024 (ratio 0.5), so the price of the
log-mass bias can be read apart from end-to-end noise:

    python benchmarks/attention_mask_cost.py [--threads 1] [--repeats 9] [--device cpu]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from hot_path import median_ms  # benchmarks/ is on sys.path when this script runs

# name: (heads, merged tokens K, head dim)
SHAPES = {"sdxl 64x64 level, K=2048": (10, 2048, 64), "sdxl 32x32 level, K=512": (20, 512, 64)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    print(f"torch {torch.__version__}, {device}, {dtype}, {torch.get_num_threads()} threads, batch 1")
    print(f"{'shape':<28}{'no mask ms':>12}{'mask ms':>10}{'ratio':>8}")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, (heads, k, d) in SHAPES.items():
            q, key, v = (torch.randn(1, heads, k, d, generator=gen).to(device, dtype) for _ in range(3))
            mask = torch.randn(1, 1, 1, k, generator=gen).to(device, dtype)
            plain = median_ms(lambda: F.scaled_dot_product_attention(q, key, v), args.repeats, device)
            masked = median_ms(lambda: F.scaled_dot_product_attention(q, key, v, attn_mask=mask), args.repeats, device)
            print(f"{name:<28}{plain:>12.1f}{masked:>10.1f}{masked / plain:>8.2f}")


if __name__ == "__main__":
    main()
