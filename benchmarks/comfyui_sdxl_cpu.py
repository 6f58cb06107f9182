"""ComfyUI's own SDXL UNet at full width and reduced depth on the CPU: unpatched, ToMA (the
ComfyUI node's patch) and the ideal (the same patch with a merge that costs nothing).

A thin wrapper of ``toma bench --host comfyui --arch sdxl --clock cpu --threads 1`` that keeps
this script's report keys. The ideal is ``toma bench``'s (``toma/tools/baselines.py``): the
node's own hooks at the same levels, keeping the same number K of tokens per grid, but its
plans keep every ``N/K``-th token and repeat the outputs back, with no selection, no merge
matmuls and no attention bias. Any merging at these places is at best as fast; efficiency is
ToMA's share of its saving.

SDXL's width (320 channels, multipliers 1, 2, 4, 64-channel heads, text 2048, ADM 2816) with
``--depth`` transformer blocks per block at the 1/4 level (SDXL has 10) and 2 at 1/2, as
SDXL; the node's default merges both levels (1/2 and 1/4 of the latent). One denoiser call
per measurement, methods interleaved round by round, CPU time of this process at one thread.
Random seeded weights, fp32, batch 1. ComfyUI: ``$TOMA_COMFYUI`` or ``../shared/vendor/ComfyUI``.

    python benchmarks/comfyui_sdxl_cpu.py --resolution 1024 --depth 2 --rounds 3

is ``toma bench --host comfyui --arch sdxl --resolution 1024 --depth 5 --ratios 0.5
--repeats 3 --clock cpu --threads 1`` (10 blocks at 1/4, 5 times fewer).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import comfyui_timing  # this folder's: the script's own folder leads sys.path


def main() -> None:
    """Parse the options, time the three methods through ``toma bench``'s code and print a JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=1024, help="image side in pixels (latent /8)")
    parser.add_argument("--depth", type=int, default=2, help="transformer blocks per block at 1/4 (SDXL has 10)")
    parser.add_argument("--text", type=int, default=77, help="text tokens")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the report here too")
    args = parser.parse_args()

    d = args.depth
    overrides = {
        "transformer_depth": [0, 0, 2, 2, d, d],
        "transformer_depth_output": [0, 0, 0, 2, 2, 2, d, d, d],
        "transformer_depth_middle": d,
    }
    bench = comfyui_timing.run(
        "sdxl", args.resolution, args.ratio, args.rounds, text_tokens=args.text, overrides=overrides
    )
    toma = comfyui_timing.rows(bench)["toma"]["settings"]
    side = args.resolution // 8
    report = {
        "host": "comfyui",
        "arch": "sdxl unet (full width)",
        "depth_at_quarter": d,
        "resolution": args.resolution,
        "merged_levels": list(toma["levels"]),
        # grid "HxW" -> [N, K], as before
        "tokens": {
            f"{-(-side // int(level[2:]))}x{-(-side // int(level[2:]))}": nk for level, nk in toma["levels"].items()
        },
        "text_tokens": args.text,
        "ratio": args.ratio,
        "threads": 1,
        "load": bench["load_average_after"],
        **comfyui_timing.figures(bench),
    }
    comfyui_timing.emit(report, args.out)


if __name__ == "__main__":
    main()
