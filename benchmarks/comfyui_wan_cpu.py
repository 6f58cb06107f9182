"""ComfyUI's own Wan 2.1 (T2V 1.3B width) at reduced depth on the CPU: unpatched, ToMA (the
ComfyUI node's patch) and the ideal (the same patch with a merge that costs nothing).

A thin wrapper of ``toma bench --host comfyui --arch wan --clock cpu --threads 1`` that keeps
this script's report keys and its absolute block count. The ideal is ``toma bench``'s
(``toma/tools/baselines.py``): the node's own block replacements, keeping the same number K
of video tokens, but its plans keep every ``N/K``-th token and repeat the outputs back, with
no selection, no merge matmuls and no attention bias. Any merging at these places is at best
as fast; efficiency is ToMA's share of its saving.

Wan 2.1 T2V 1.3B's width (dim 1536, 12 heads, MLP 8960, text 4096) with ``--layers`` blocks
(it has 30), every block merged (``blocks:all``; the default skips the first 5). One denoiser
call per measurement, methods interleaved round by round, CPU time of this process at one
thread. Random seeded weights, fp32, batch 1. ComfyUI: ``$TOMA_COMFYUI`` or
``../shared/vendor/ComfyUI``.

    python benchmarks/comfyui_wan_cpu.py --width 832 --height 480 --frames 9 --layers 2 --rounds 3

is ``toma bench --host comfyui --arch wan --resolution 480 --frames 9 --depth 15 --ratios 0.5
--repeats 3 --clock cpu --threads 1`` (30 blocks, 15 times fewer).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import comfyui_timing  # this folder's: the script's own folder leads sys.path


def main() -> None:
    """Parse the options, time the three methods through ``toma bench``'s code and print a JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=832, help="video width in pixels (latent /8, tokens /16)")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--frames", type=int, default=9, help="video frames (latent frames: (frames - 1) / 4 + 1)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (Wan 2.1 1.3B has 30)")
    parser.add_argument("--text", type=int, default=512, help="text tokens (ComfyUI pads umt5's to 512)")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the report here too")
    args = parser.parse_args()

    bench = comfyui_timing.run(
        "wan",
        args.height,
        args.ratio,
        args.rounds,
        width=args.width,
        frames=args.frames,
        text_tokens=args.text,
        overrides={"num_layers": args.layers},
    )
    toma = comfyui_timing.rows(bench)["toma"]["settings"]
    report = {
        "host": "comfyui",
        "arch": "wan2.1 t2v 1.3B (full width)",
        "layers": args.layers,
        "video": [args.frames, args.height, args.width],
        "token_grid": bench["token_grid"],
        "image_tokens": bench["image_tokens"],
        "kept_tokens": toma["kept_tokens"],
        "text_tokens": args.text,
        "ratio": args.ratio,
        "threads": 1,
        "load": bench["load_average_after"],
        **comfyui_timing.figures(bench),
    }
    comfyui_timing.emit(report, args.out)


if __name__ == "__main__":
    main()
