"""Cost of proportional attention's exact forms: no bias, the float mask, the key channel, flex.

One interleaved run (each round times every method once, the lead rotating; medians of the
rounds after a warm-up), wall and CPU time, batch 1:

1. **At one attention shape** (default Flux's: 4096 tokens, 24 heads of 128), per dtype:
   SDPA without a bias, SDPA with the ``(1, 1, 1, K)`` float mask, SDPA over the key channel
   (head dim 136, and 129 unpadded; the concatenations are timed with it), and compiled
   FlexAttention with the ``score_mod`` (its compile is timed apart, on the first call).
2. **As a share of a merged forward** (``--forward flux,wan``): Flux.1-dev at 1/10 depth,
   1024px, and Wan 2.1 1.3B with one block, 832x480x25, full width, ToMA at ratio 0.5 and
   its default blocks. The forward with proportional attention on (today's mask) records
   the shapes of the attention calls that get the bias; each method's extra time over no
   bias at those shapes, summed over the calls, is divided by the forward's time without
   the bias. The mask's end-to-end forward is timed too, as a check of that sum.

    python benchmarks/proportional_cost.py [--repeats 5] [--dtypes float32,bfloat16]
        [--forward flux,wan,sd35,qwenimage,ltx] [--forward-rounds R]
        [--threads N] [--json benchmarks/results/cpu/proportional_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from typing import Callable

import torch
import torch.nn.functional as F

from toma.core import proportional as P

Method = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def methods(flex: Callable) -> dict[str, Method]:
    """The attention forms on ``(B, H, S, D)`` tensors and ``(Bp, K)`` log masses."""
    return {
        "none": lambda q, k, v, lm: F.scaled_dot_product_attention(q, k, v),
        "mask": lambda q, k, v, lm: F.scaled_dot_product_attention(q, k, v, attn_mask=P.additive_mask(lm, q.dtype)),
        "key channel 136": lambda q, k, v, lm: P.key_channel_attention(F.scaled_dot_product_attention, q, k, v, lm),
        "key channel 129": lambda q, k, v, lm: P.key_channel_attention(
            F.scaled_dot_product_attention, q, k, v, lm, multiple=1
        ),
        "flex": lambda q, k, v, lm: P.flex_attention_with_bias(q, k, v, lm, flex=flex),
    }


def interleaved(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds of each call over ``repeats`` rounds after one warm-up round."""
    names = list(calls)
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for round_ in range(repeats + 1):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            cpu, wall = time.process_time(), time.perf_counter()
            calls[name]()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            if round_:
                samples[name].append((wall, cpu))
    return {
        n: {"wall_s": statistics.median(w for w, _ in s), "cpu_s": statistics.median(c for _, c in s)}
        for n, s in samples.items()
    }


def attention_inputs(shape: tuple[int, int, int, int, int], dtype: torch.dtype, seed: int = 0):
    """``(B, H, Sq, Sk, D)`` queries, keys, values and a log mass per key (masses 1 to 4)."""
    b, h, sq, sk, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g).to(dtype)
    k, v = (torch.randn(b, h, sk, d, generator=g).to(dtype) for _ in range(2))
    log_mass = torch.randint(1, 5, (1, sk), generator=g).float().log().to(dtype)
    return q, k, v, log_mass


def compile_flex(forms: dict[str, Method], inputs) -> float:
    """Seconds of the first (compiling) flex call at these inputs."""
    start = time.perf_counter()
    forms["flex"](*inputs)
    return time.perf_counter() - start


def time_shape(forms: dict[str, Method], shape, dtype, repeats: int) -> dict:
    inputs = attention_inputs(shape, dtype)
    compile_s = compile_flex(forms, inputs)
    with torch.inference_mode():
        times = interleaved({n: (lambda f=f: f(*inputs)) for n, f in forms.items()}, repeats)
    return {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "flex_compile_s": compile_s, "times": times}


def print_shape(result: dict) -> None:
    times = result["times"]
    base = times["none"]["wall_s"]
    b, h, sq, sk, d = result["shape"]
    print(
        f"  {result['dtype']}, {h} heads x {d}, {sq} queries x {sk} keys (flex compile "
        f"{result['flex_compile_s']:.1f} s)"
    )
    for name, t in times.items():
        print(
            f"    {name:<17}{t['wall_s'] * 1e3:9.1f} ms wall {t['wall_s'] / base - 1:+7.1%}"
            f"   {t['cpu_s'] * 1e3:9.1f} ms CPU {t['cpu_s'] / times['none']['cpu_s'] - 1:+7.1%}",
            flush=True,
        )


# name: (arch, depth divisor, resolution, frames); the last three are the families whose
# bias rides outside their processor's mask argument (SD3's own joint attention, LTX's and
# Qwen-Image's through_dispatch)
FORWARDS = {
    "flux": ("flux", 10, 1024, None),
    "wan": ("wan", 30, 480, 25),
    "sd35": ("sd35", 8, 1024, None),
    "qwenimage": ("qwenimage", 10, 1024, None),
    "ltx": ("ltx", 28, 512, 25),
}


def forward_share(name: str, forms: dict[str, Method], repeats: int, rounds: int | None = None) -> dict:
    """Each method's extra time in the biased attention calls of one merged forward, as a
    share of that forward without the bias (see the module docstring)."""
    import toma
    from toma.tools.archs import build_model, call_denoiser, default_placement, get_arch, make_inputs

    arch_name, depth, resolution, frames = FORWARDS[name]
    arch = get_arch(arch_name)
    model = build_model(arch, depth=depth)
    inputs = make_inputs(arch, resolution, 1, frames=frames)
    placement = default_placement(arch, model)

    shapes: list[tuple] = []
    real = F.scaled_dot_product_attention

    def recording(*args, **kw):
        q, k = (args[i] if len(args) > i else kw[name] for i, name in enumerate(("query", "key")))
        mask = args[3] if len(args) > 3 else kw.get("attn_mask")
        # toma's bias is on self- and joint attention only: a float mask on a cross-attention
        # (LTX's text mask) is the model's own
        if mask is not None and mask.dtype != torch.bool and q.shape[2] == k.shape[2]:
            shapes.append((q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3]))
        return real(*args, **kw)

    toma.apply_toma(model, ratio=0.5, proportional_attention=True, **placement)
    F.scaled_dot_product_attention = recording
    try:
        with torch.inference_mode():
            call_denoiser(arch, model, inputs)
    finally:
        F.scaled_dot_product_attention = real
    toma.remove_toma(model)

    def forward(bias: bool) -> Callable[[], object]:
        def run() -> None:
            toma.apply_toma(model, ratio=0.5, proportional_attention=bias, **placement)
            try:
                call_denoiser(arch, model, inputs)
            finally:
                toma.remove_toma(model)

        return run

    with torch.inference_mode():
        forwards = interleaved({"toma": forward(False), "toma + mask": forward(True)}, rounds or max(2, repeats // 2))
    per_shape = {}
    for shape in sorted(set(shapes)):
        per_shape[shape] = time_shape(forms, shape, torch.float32, repeats)
        print_shape(per_shape[shape])
    base = forwards["toma"]
    shares = {}
    for method in forms:
        if method == "none":
            continue
        extra = {
            kind: sum(per_shape[s]["times"][method][kind] - per_shape[s]["times"]["none"][kind] for s in shapes)
            for kind in ("wall_s", "cpu_s")
        }
        shares[method] = {kind: extra[kind] / base[kind] for kind in extra}
    measured = {kind: forwards["toma + mask"][kind] / base[kind] - 1 for kind in ("wall_s", "cpu_s")}
    print(
        f"  {name}: {len(shapes)} biased attention calls {sorted(set(shapes))}; merged forward "
        f"{base['wall_s']:.2f} s wall / {base['cpu_s']:.2f} s CPU; with the mask, end to end: "
        f"{measured['wall_s']:+.1%} wall, {measured['cpu_s']:+.1%} CPU"
    )
    for method, share in shares.items():
        print(
            f"    {method:<17}{share['wall_s']:+7.2%} of the forward (wall)   {share['cpu_s']:+7.2%} (CPU)", flush=True
        )
    return {
        "arch": arch_name,
        "depth": depth,
        "resolution": resolution,
        "frames": frames,
        "calls": shapes,
        "forward": forwards,
        "mask_end_to_end": measured,
        "shares": shares,
        "attention": [{**r, "shape": list(r["shape"])} for r in per_shape.values()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--shape", default="1,24,4096,4096,128", help="B,H,Sq,Sk,D of the attention")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="of the attention shape's timing; none skips it")
    parser.add_argument("--forward", default="flux,wan", help=f"comma-separated of {', '.join(FORWARDS)}, or none")
    parser.add_argument(
        "--forward-rounds", type=int, default=None, help="interleaved rounds of the end-to-end forwards (repeats / 2)"
    )
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = tuple(int(x) for x in args.shape.split(","))
    if len(shape) != 5:
        raise SystemExit("--shape must be B,H,Sq,Sk,D")
    wanted = [] if args.forward == "none" else [n.strip() for n in args.forward.split(",")]
    unknown = [n for n in wanted if n not in FORWARDS]
    if unknown:
        raise SystemExit(f"--forward: unknown {unknown}; choose from {', '.join(FORWARDS)} or none")
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    forms = methods(flex)
    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch 1, median of {args.repeats} "
        f"interleaved rounds; load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}",
        flush=True,
    )
    out = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "load_before": load,
        "commit": _commit(),
        "attention": [],
        "forwards": {},
    }
    for name in [] if args.dtypes == "none" else args.dtypes.split(","):
        result = time_shape(forms, shape, getattr(torch, name.strip()), args.repeats)
        print_shape(result)
        out["attention"].append(result)
    for name in wanted:
        out["forwards"][name] = forward_share(name, forms, args.repeats, args.forward_rounds)
    out["load_after"] = os.getloadavg()
    print(f"load after: {' '.join(f'{x:.1f}' for x in out['load_after'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
