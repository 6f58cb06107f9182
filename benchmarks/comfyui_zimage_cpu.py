"""ComfyUI's own Z-Image (NextDiT) at reduced width and depth on the CPU: unpatched, ToMA (the
ComfyUI node's patch) and the ideal (the same patch with a merge that costs nothing).

A thin wrapper of ``toma bench --host comfyui --arch zimage --clock cpu --threads 1`` that
keeps this script's report keys, its width ``--dim`` and its absolute layer counts. The ideal
is ``toma bench``'s (``toma/tools/baselines.py``): the node's own layer object patches run
the same main layers on the same number K of image tokens, but its plans keep every
``N/K``-th token and repeat the outputs back, with no selection, no merge matmuls and no
attention bias. Any merging at these layers is at best as fast; efficiency is ToMA's share
of its saving. The refiners (noise and caption) run on every token in all three, as toma
never merges them.

Z-Image's layout (:mod:`toma.tools.bench.comfyui`: heads of 128 channels, rotary axes
32/48/48, Z-Image's modulation and padding to 32 tokens, FFN ``dim * 8 / 3``, 16 latent
channels, caption features 2560) at width ``--dim`` (Z-Image-Turbo: 3840) with ``--layers``
main layers (it has 30) and ``--refiners`` layers in each refiner (it has 2), every main layer
merged (``layers:all``; the default skips the first 5). One denoiser call per measurement,
methods interleaved round by round, each method's patcher loaded untimed before its call (its
layer object patches are put in place by loading, once per sampling run), CPU time of this
process at one thread. Random seeded weights, fp32, batch 1. ComfyUI: ``$TOMA_COMFYUI`` or
``../shared/vendor/ComfyUI``.

    python benchmarks/comfyui_zimage_cpu.py --resolution 1024 --dim 1536 --layers 2 --refiners 1 --rounds 3

is ``toma bench --host comfyui --arch zimage --resolution 1024 --depth 15 --text-tokens 128
--ratios 0.5 --repeats 3 --clock cpu --threads 1`` at width 1536 with 1 refiner layer (the
bench builds Z-Image-Turbo's width 3840 and its 2 refiner layers).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import comfyui_timing  # this folder's: the script's own folder leads sys.path

HEAD_DIM = 128  # Z-Image's: 3840 / 30 heads, the rotary axes' 32 + 48 + 48


def main() -> None:
    """Parse the options, time the three methods through ``toma bench``'s code and print a JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=1024, help="image side in pixels (latent /8, tokens /16)")
    parser.add_argument("--dim", type=int, default=1536, help="width, a multiple of 128 (Z-Image-Turbo: 3840)")
    parser.add_argument("--layers", type=int, default=2, help="main layers (Z-Image-Turbo has 30)")
    parser.add_argument("--refiners", type=int, default=1, help="layers per refiner (Z-Image-Turbo has 2)")
    parser.add_argument("--text", type=int, default=128, help="caption tokens (padded to a multiple of 32)")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the report here too")
    args = parser.parse_args()
    if args.dim % HEAD_DIM:
        parser.error(f"--dim must be a multiple of {HEAD_DIM} (Z-Image's head width); got {args.dim}")

    heads = args.dim // HEAD_DIM
    bench = comfyui_timing.run(
        "zimage",
        args.resolution,
        args.ratio,
        args.rounds,
        text_tokens=args.text,
        overrides={
            "dim": args.dim,
            "n_heads": heads,
            "n_kv_heads": heads,
            "n_layers": args.layers,
            "n_refiner_layers": args.refiners,
        },
    )
    toma = comfyui_timing.rows(bench)["toma"]["settings"]
    report = {
        "host": "comfyui",
        "arch": f"z-image layout, dim {args.dim} (Z-Image-Turbo: 3840)",
        "layers": args.layers,
        "refiner_layers": args.refiners,
        "resolution": args.resolution,
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
