"""Where ToMA's time goes beside the ideal's: self CPU time per op over one forward of each.

``python benchmarks/profile_ops.py --arch kandinsky5 --depth 32 --frames 5 [--shapes]``: one
thread, one warm-up forward each, then one profiled forward of ToMA and of the ideal at the
default placement (ratio 0.5); the ops sorted by what ToMA spends on them more than the ideal.
With ``--shapes`` the ops are told apart by their input shapes, which says which call of the
model an op belongs to. A profile, not a timing: quote ``cpu_time_ab.py`` for speed.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import profile

from toma.tools.archs import build_model, call_denoiser, default_placement, get_arch, make_inputs
from toma.tools.bench.harness import MethodPatcher, Variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", required=True)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--resolution", type=int, default=None, help="the arch's default if not given")
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--shapes", action="store_true", help="one row per op and input shapes")
    parser.add_argument("--top", type=int, default=25, help="rows to print")
    args = parser.parse_args()
    torch.set_num_threads(1)
    arch = get_arch(args.arch)
    model = build_model(arch, depth=args.depth)
    inputs = make_inputs(arch, args.resolution or arch.resolution, 1, frames=args.frames)
    patcher = MethodPatcher(model, arch, default_placement(arch, model), {}, None)
    tables: dict[str, dict[str, tuple[float, int]]] = {}
    for method in ("toma", "ideal"):
        patcher.apply(Variant(method, args.ratio))
        with torch.inference_mode():
            call_denoiser(arch, model, inputs)
            with profile(record_shapes=args.shapes) as prof:
                call_denoiser(arch, model, inputs)
        patcher.remove()
        tables[method] = {
            f"{e.key} {e.input_shapes}" if args.shapes else e.key: (e.self_cpu_time_total / 1e3, e.count)
            for e in prof.key_averages(group_by_input_shape=args.shapes)
        }

    def diff(key: str) -> float:
        return tables["toma"].get(key, (0.0, 0))[0] - tables["ideal"].get(key, (0.0, 0))[0]

    print(f"{'op':70s} {'toma ms':>9s} {'n':>4s} {'ideal ms':>9s} {'n':>4s} {'more':>8s}")
    for key in sorted(set(tables["toma"]) | set(tables["ideal"]), key=diff, reverse=True)[: args.top]:
        (a, na), (b, nb) = tables["toma"].get(key, (0.0, 0)), tables["ideal"].get(key, (0.0, 0))
        print(f"{key[:70]:70s} {a:9.1f} {na:4d} {b:9.1f} {nb:4d} {a - b:8.1f}")


if __name__ == "__main__":
    main()
