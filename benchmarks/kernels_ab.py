"""ToMA's Triton kernels against its torch path, interleaved in one process.

On CUDA, plans and merges run the Triton kernels of :mod:`toma.kernels` unless
``TOMA_KERNELS=torch``; this script flips that switch between samples on one patched
model, so that both paths see the same machine state. It prints

* the hot path at the token grids of ``benchmarks/hot_path.py`` (plan build, merge and
  unmerge from raster order), per path;
* whole denoiser forwards: unpatched, ToMA on the torch path and on the Triton path,
  alternating for ``--rounds`` rounds, with each path's speedup over unpatched;
* how far the two paths' outputs are apart (they pick the same destinations up to
  float32 rounding of the similarities; the merges differ by summation order).

    python benchmarks/kernels_ab.py --arch sdxl --levels 2 --device cuda --dtype bfloat16 --batch 1,2
    # a CPU smoke run:
    TRITON_INTERPRET=1 python benchmarks/kernels_ab.py --narrow --resolution 128 --repeats 1 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any, Callable

import torch
from hot_path import SHAPES, sample_seconds  # benchmarks/ is on sys.path when this script runs

import toma
from toma.config import ToMAConfig
from toma.adapters.state import PlanCache
from toma.kernels import KERNELS_ENV
from toma.tools.archs import build_model, call_denoiser, get_arch, make_inputs

PATHS = ("torch", "triton")


def timed(fn: Callable[[], Any], path: str | None, repeats: int, device: torch.device) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn()`` on ``path`` (None: leave the switch alone)."""
    if path is not None:
        os.environ[KERNELS_ENV] = path
    return sample_seconds(fn, repeats, device, warmup=1)


def hot_path(device: torch.device, dtype: torch.dtype, repeats: int, rounds: int) -> None:
    print(f"{'grid':<40}{'path':<8}{'build ms':>10}{'merge ms':>10}{'unmerge ms':>12}")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, (side, channels, *_) in SHAPES.items():
            x = torch.randn(1, side * side, channels, generator=gen).to(device, dtype)
            samples: dict[str, list[list[float]]] = {p: [[], [], []] for p in PATHS}
            for _ in range(rounds):
                for path in PATHS:
                    os.environ[KERNELS_ENV] = path
                    cache = PlanCache(ToMAConfig(ratio=0.5))

                    def build() -> Any:
                        cache.begin_forward((side, side), None)  # a new run: the plan is recomputed
                        return cache.get(x, (side, side), group="g")

                    plan = build()
                    merged = plan.merge(x)
                    for i, fn in enumerate((build, lambda: plan.merge(x), lambda: plan.unmerge(merged))):
                        samples[path][i] += timed(fn, None, repeats, device)
            for path in PATHS:
                b, m, u = (1000 * statistics.median(s) for s in samples[path])
                print(f"{name:<40}{path:<8}{b:>10.3f}{m:>10.3f}{u:>12.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sdxl", choices=["sdxl", "sd15", "flux"])
    parser.add_argument("--resolution", type=int, default=None)
    parser.add_argument("--depth", type=int, default=1, help="Flux: build this many times fewer blocks")
    parser.add_argument("--levels", type=int, default=2)
    parser.add_argument("--batch", default="1")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--narrow", action="store_true", help="every layer a few channels wide (host_overhead.py's model)"
    )
    parser.add_argument("--no-hot-path", action="store_true")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("the Triton path needs --device cuda, or TRITON_INTERPRET=1 (a slow smoke run on the CPU)")
    print(f"torch {torch.__version__}, {device}, {args.dtype}")
    if not args.no_hot_path:
        hot_path(device, dtype, args.repeats, args.rounds)
    arch = get_arch(args.arch)
    if args.narrow:
        from host_overhead import narrow

        arch = narrow(arch)
    resolution = args.resolution or arch.resolution
    model = build_model(arch, depth=args.depth, dtype=dtype, device=device)
    placement = {} if arch.family == "flux" else {"levels": args.levels}
    print(
        f"{arch.name} {resolution}px, ratio 0.5, {placement}: forward median ms over {args.rounds} interleaved rounds"
    )
    print(
        f"{'batch':<7}{'none':>10}{'torch':>10}{'triton':>10}{'torch x':>9}{'triton x':>10}{'max |torch - triton|':>22}"
    )
    with torch.inference_mode():
        for batch in map(int, args.batch.split(",")):
            inputs = make_inputs(arch, resolution, batch, dtype=dtype, device=device)
            call = lambda: call_denoiser(arch, model, inputs)  # noqa: E731
            samples: dict[str, list[float]] = {"none": [], **{p: [] for p in PATHS}}
            outputs: dict[str, torch.Tensor] = {}
            for _ in range(args.rounds):
                samples["none"] += timed(call, None, args.repeats, device)
                toma.apply_toma(model, 0.5, **placement)
                for path in PATHS:
                    samples[path] += timed(call, path, args.repeats, device)
                    out = call()
                    outputs[path] = (out[0] if isinstance(out, tuple) else out.sample).float()
                toma.remove_toma(model)
            ms = {k: 1000 * statistics.median(v) for k, v in samples.items()}
            gap = (outputs["torch"] - outputs["triton"]).abs().max().item()
            print(
                f"{batch:<7}{ms['none']:>10.2f}{ms['torch']:>10.2f}{ms['triton']:>10.2f}"
                f"{ms['none'] / ms['torch']:>9.3f}{ms['none'] / ms['triton']:>10.3f}{gap:>22.3g}",
                flush=True,
            )
    os.environ.pop(KERNELS_ENV, None)


if __name__ == "__main__":
    main()
