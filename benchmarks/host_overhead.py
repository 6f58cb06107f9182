"""Host-side cost of each method: kernels launched and CPU time per denoiser forward.

On a GPU, an eager SDXL forward at batch 1-2 is bound by the host (Python, hooks and
kernel launches), and under CUDA graphs every extra kernel still costs a few microseconds
of GPU time. Both grow with the operations a method adds to a forward, which this script
measures without a GPU. It keeps the full architecture (every block, hook and attention
call of SDXL, SD 1.5 or Flux.1-dev) but narrows every layer to a few channels and runs a
small image on the CPU, so that the maths is negligible and what is timed is the host's
work per operation. For each method it reports

* the ATen operations per forward that launch a kernel (views excluded), and how many
  more than the unpatched forward;
* the median CPU time per forward and how much more than unpatched;
* whether the method reads device data on the host (a GPU synchronisation): the forward is
  re-run on PyTorch's ``meta`` device, which has no data to read and fails on any read.

    python benchmarks/host_overhead.py --arch sdxl [--batch 1] [--repeats 30]
    python benchmarks/host_overhead.py --arch flux

The kernels of ToMA's CUDA path (:mod:`toma.kernels`, Triton) are counted on the CPU too,
one per launch, by running them in Triton's interpreter (its host times mean nothing, and
the meta-device check is skipped, since the interpreter reads data by design):

    TRITON_INTERPRET=1 TOMA_KERNELS=triton python benchmarks/host_overhead.py --arch sdxl --repeats 1
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter
from typing import Any

import torch
from hot_path import median_ms  # benchmarks/ is on sys.path when this script runs

from toma.tools.archs import Arch, build_model, call_denoiser, default_placement, get_arch, make_inputs
from toma.kernels import kernel_mode
from toma.tools.opcount import count_kernels


def narrow(arch: Arch) -> Arch:
    """``arch`` with every block kept and every layer a few channels wide."""
    if arch.family == "flux":
        config = {
            **arch.config,
            "in_channels": 16,
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "axes_dims_rope": (4, 6, 6),
            "joint_attention_dim": 32,
            "pooled_projection_dim": 16,
        }
        return dataclasses.replace(arch, config=config, text_dim=32, pooled_dim=16)
    heads = arch.config["attention_head_dim"]
    levels = len(arch.config["block_out_channels"])
    if isinstance(heads, int):  # SD 1.x: head count per level is channels / 8... keep 8 wide heads
        channels = tuple(8 * heads * (i + 1) for i in range(levels))
    else:  # SDXL gives head counts per level: 8 channels per head
        channels = tuple(8 * h for h in heads)
    config = {**arch.config, "block_out_channels": channels, "norm_num_groups": 8, "cross_attention_dim": 32}
    if "addition_time_embed_dim" in config:
        config["addition_time_embed_dim"] = 8
        config["projection_class_embeddings_input_dim"] = 16 + 6 * 8
        return dataclasses.replace(arch, config=config, text_dim=32, pooled_dim=16)
    return dataclasses.replace(arch, config=config, text_dim=32)


def reads_device_data(arch: Arch, model: torch.nn.Module, inputs: dict[str, Any]) -> str | None:
    """Why a forward on ``meta`` copies (its error), or None when it never reads data."""
    meta = {k: _to(v, "meta") for k, v in inputs.items()}
    model.to("meta")
    hook = getattr(model, "_diffusers_hook", None)
    step_hook = hook.get_hook("toma") if hook is not None else None
    reader = getattr(step_hook, "grid", None)  # the engine's per-model grid reader (Flux: IdsGrid)
    if getattr(reader, "_known", None) is not None:
        # Flux reads its image ids once per denoising run (by design): start after that read
        reader._known = (meta["img_ids"], -1, reader._known[2])  # an inference tensor: no version
    try:
        call_denoiser(arch, model, meta)
        call_denoiser(arch, model, meta)  # a second step, where plans may be reused
    except (RuntimeError, NotImplementedError) as err:
        if "meta" not in str(err):
            raise
        return str(err).splitlines()[0]  # meta tensors have no data to read
    return None


def _to(value: Any, device: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sdxl", choices=["sdxl", "sd15", "flux"])
    parser.add_argument("--resolution", type=int, default=256, help="image pixels (small: the maths should not count)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--levels", type=int, default=2, help="UNet attention levels merged")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", default="none,toma,ideal")
    args = parser.parse_args()

    import toma
    from toma.tools import baselines

    torch.set_num_threads(args.threads)
    interpreted = kernel_mode() == "triton"  # on the CPU: Triton's interpreter
    arch = narrow(get_arch(args.arch))
    model = build_model(arch)
    inputs = make_inputs(arch, args.resolution, args.batch)
    if arch.family == "flux":
        placement: dict[str, Any] = default_placement(arch, model)
        where = "default Flux blocks"
    else:
        placement = {"levels": args.levels}
        where = f"levels {args.levels}"
    print(
        f"{arch.name}: every block, narrowed; {args.resolution}px, batch {args.batch}, ratio {args.ratio}, {where}; "
        f"torch {torch.__version__}, CPU, {torch.get_num_threads()} thread(s)"
        + (
            ", ToMA's Triton kernels in the interpreter (host ms not meaningful; syncs not checked)"
            if interpreted
            else ""
        )
    )
    print(f"{'method':<8}{'kernels':>9}{'extra':>7}{'host ms':>9}{'extra ms':>10}  {'syncs':<8}top extra ops")
    base_ops: Counter[str] | None = None
    base_ms = 0.0
    with torch.inference_mode():
        for method in args.methods.split(","):
            model.to("cpu")
            if method == "toma":
                toma.apply_toma(model, ratio=args.ratio, **placement)
            elif method == "ideal":
                baselines.apply_ideal(model, args.ratio, **placement)
            elif method == "tomesd":
                baselines.apply_tomesd(model, args.ratio, None, **placement)
            elif method != "none":
                raise SystemExit(f"unknown method {method!r}")

            def call() -> Any:
                return call_denoiser(arch, model, inputs)

            ms = median_ms(call, args.repeats, torch.device("cpu"))
            ops = count_kernels(call)
            sync = None if interpreted else reads_device_data(arch, model, inputs)
            toma.remove_toma(model)
            baselines.remove_baseline(model)
            model = build_model(arch)  # the meta run dropped the weights
            if base_ops is None:
                base_ops, base_ms = ops, ms
            total, extra = sum(ops.values()), ops - base_ops
            top = ", ".join(f"{k} {v}" for k, v in extra.most_common(5))
            verdict = "none" if sync is None else "READS"
            print(
                f"{method:<8}{total:>9}{total - sum(base_ops.values()):>+7}{ms:>9.1f}{ms - base_ms:>+10.1f}  "
                f"{verdict:<8}{top}"
            )
            if sync is not None:
                print(f"         {sync}")


if __name__ == "__main__":
    main()
