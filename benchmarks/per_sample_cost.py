"""Cost of running a merged attention once per sample (the engine's ``Rotary(shared=True)``).

Qwen-Image's and FLUX.2's attention processors apply one rotary table to the whole batch,
so with a plan per sample the engine calls the attention module once per sample. This
times one full-width Qwen-Image joint attention at 1024x1024 and ratio 0.5 (2048 merged
image tokens, 128 text tokens) at batch 2, called once on the batch (one table for both
samples: what a shared table would cost if the processor took per-sample tables) against
once per sample, interleaved, and counts the kernels each way launches:

    python benchmarks/per_sample_cost.py [--threads 1] [--repeats 7] [--batch 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from toma.tools.archs import ARCHS, build_model
from toma.tools.opcount import count_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--merged", type=int, default=2048, help="merged image tokens K")
    parser.add_argument("--text", type=int, default=128, help="text tokens")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    attn = build_model(ARCHS["qwenimage"], depth=60).transformer_blocks[0].attn
    width, batch = attn.inner_dim, args.batch
    g = torch.Generator().manual_seed(0)
    image = torch.randn(batch, args.merged, width, generator=g)
    text = torch.randn(batch, args.text, width, generator=g)
    angles = torch.rand(batch, args.merged, 64, generator=g)
    tables = [torch.polar(torch.ones_like(a), a) for a in angles]  # each sample's (K, 64) complex table
    text_table = torch.polar(torch.ones(args.text, 64), torch.rand(args.text, 64, generator=g))

    def batched() -> None:
        attn(hidden_states=image, encoder_hidden_states=text, image_rotary_emb=(tables[0], text_table))

    def per_sample() -> None:
        outs = [
            attn(
                hidden_states=image[b : b + 1],
                encoder_hidden_states=text[b : b + 1],
                image_rotary_emb=(tables[b], text_table),
            )
            for b in range(batch)
        ]
        torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

    times: dict[str, list[float]] = {"one call on the batch": [], "one call per sample": []}
    with torch.inference_mode():
        batched(), per_sample()  # warm-up
        for _ in range(args.repeats):
            for name, fn in zip(times, (batched, per_sample)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        kernels = {name: sum(count_kernels(fn).values()) for name, fn in zip(times, (batched, per_sample))}
    print(
        f"torch {torch.__version__}, cpu, float32, {torch.get_num_threads()} threads, batch {batch}, "
        f"K={args.merged} image + {args.text} text tokens, width {width}, {args.repeats} interleaved samples"
    )
    base = statistics.median(times["one call on the batch"])
    for name, samples in times.items():
        med = statistics.median(samples)
        print(
            f"{name:<24} median {1000 * med:9.1f} ms  (min {1000 * min(samples):9.1f}, max {1000 * max(samples):9.1f})"
            f"  {med / base:6.3f}x  {kernels[name]} kernels"
        )


if __name__ == "__main__":
    main()
