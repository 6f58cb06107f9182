"""ComfyUI's own Flux at full width and reduced depth on the CPU: unpatched, ToMA (the
ComfyUI node's patch) and the ideal (the same model on K image tokens, no selection).

A thin wrapper of ``toma bench --host comfyui --arch flux --clock cpu --threads 1`` (one
denoiser call per measurement, methods interleaved round by round, CPU time of this process,
random seeded weights, fp32, batch 1) that keeps this script's report keys and its absolute
block counts. ComfyUI: ``$TOMA_COMFYUI`` or ``../shared/vendor/ComfyUI``.

    python benchmarks/comfyui_flux_cpu.py --resolution 512 --double 1 --single 2 --rounds 3

is ``toma bench --host comfyui --arch flux --resolution 512 --depth 19 --text-tokens 64
--ratios 0.5 --repeats 3 --clock cpu --threads 1`` (Flux.1-dev's 19 and 38 blocks, 19 times fewer).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import comfyui_timing  # this folder's: the script's own folder leads sys.path


def main() -> None:
    """Parse the options, time the three methods through ``toma bench``'s code and print a JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=512, help="image side in pixels (latent /8, tokens /16)")
    parser.add_argument("--double", type=int, default=1, help="double-stream blocks (Flux.1-dev has 19)")
    parser.add_argument("--single", type=int, default=2, help="single-stream blocks (Flux.1-dev has 38)")
    parser.add_argument("--text", type=int, default=64, help="text tokens")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the report here too")
    args = parser.parse_args()

    bench = comfyui_timing.run(
        "flux",
        args.resolution,
        args.ratio,
        args.rounds,
        text_tokens=args.text,
        overrides={"depth": args.double, "depth_single_blocks": args.single},
    )
    toma = comfyui_timing.rows(bench)["toma"]["settings"]
    report = {
        "host": "comfyui",
        "arch": "flux (full width)",
        "double_blocks": args.double,
        "single_blocks": args.single,
        "resolution": args.resolution,
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
