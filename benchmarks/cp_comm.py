"""What diffusers' context parallelism moves between ranks per forward, with and without
ToMA, and how long a forward takes on CPU processes.

Run under torchrun (gloo on CPU, or NCCL on GPUs with ``--device cuda``)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/cp_comm.py \
        --out benchmarks/results/cpu/cp_comm_2.json
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 benchmarks/cp_comm.py --modes both --time 0

Bytes: diffusers' functional collectives (``all_to_all_single``, ``all_gather_tensor``) and
``dist.all_gather`` are wrapped, and each call adds the size of the buffer this rank hands
it. They are grouped by caller: ``attention`` (Ulysses' all-to-alls of queries, keys,
values and outputs; ring attention's key/value gathers; the Ulysses mask gather) and
``output`` (the gather of the model's output, the same with and without ToMA).

Time: the median of ``--time`` forwards of each model, the unmerged and the merged one
called in turn in one process, after a warm-up, ranks synchronised before each call. On a
CPU with gloo this is not what NVLink GPUs see: the ratio of the bytes carries over, the
times do not.

The models are Wan- and Flux-shaped, with random weights (nothing is downloaded); on CPU
the tests' math attention backend (tests/cp_worker.py), which ring attention needs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

BYTES: dict[str, int] = {}


def _caller() -> str:
    frame = sys._getframe(2)
    return "attention" if "attention_dispatch" in frame.f_code.co_filename else "output"


def _count(name: str, module, tensor_arg: int = 0) -> None:
    original = getattr(module, name)

    def counted(*args, **kwargs):
        x = args[tensor_arg]
        where = _caller()
        BYTES[where] = BYTES.get(where, 0) + x.numel() * x.element_size()
        return original(*args, **kwargs)

    setattr(module, name, counted)


HEADS = 4  # --heads; Ulysses needs a multiple of its degree
BACKEND: str | None = None  # --backend


def wan(seed: int = 0):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=HEADS,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=16,
        ffn_dim=128,
        num_layers=4,
        rope_max_seq_len=64,
    ).eval()


def wan_call(frames: int, side: int) -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 4, frames, 2 * side, 2 * side, generator=g),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
    }


def flux(seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=HEADS,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    ).eval()


def flux_call(side: int, text: int = 8) -> dict:
    g = torch.Generator().manual_seed(1)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    return {
        "hidden_states": torch.randn(1, side * side, 16, generator=g),
        "encoder_hidden_states": torch.randn(1, text, 32, generator=g),
        "pooled_projections": torch.randn(1, 32, generator=g),
        "timestep": torch.tensor([0.7]),
        "img_ids": ids,
        "txt_ids": torch.zeros(text, 3),
    }


def models(frames: int, side: int) -> dict:
    """Wan on ``frames x side x side`` tokens, Flux on ``2 side x 2 side`` (the same count at 4 frames)."""
    return {
        "wan": (
            wan,
            lambda: wan_call(frames, side),
            {"blocks": {"blocks": range(4)}},
            f"{frames}x{side}x{side} = {frames * side * side:,} video tokens, 4 blocks",
        ),
        "flux": (
            flux,
            lambda: flux_call(2 * side),
            {"flux_double_blocks": (0, 1), "flux_single_blocks": (0, 1)},
            f"{2 * side}x{2 * side} = {4 * side * side:,} image tokens + 8 text, 2+2 blocks",
        ),
    }


MODELS: dict = {}
MODES = {
    "ulysses": lambda p: {"ulysses_degree": p},
    "ring": lambda p: {"ring_degree": p},
    "both": lambda p: {"ulysses_degree": 2, "ring_degree": p // 2},
}


def forward(model, kw: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**kw, return_dict=False)[0]
    if out.is_cuda:
        torch.cuda.synchronize()
    return out


def measure(name: str, mode: str, world: int, repeats: int, ratio: float, device: str, dtype: torch.dtype) -> dict:
    import toma
    from diffusers import ContextParallelConfig

    make, call, options, what = MODELS[name]
    kw = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in call().items()}
    models = {}
    for merged in (False, True):
        model = make().to(device, dtype)
        if BACKEND:
            model.set_attention_backend(BACKEND)
        model.enable_parallelism(config=ContextParallelConfig(**MODES[mode](world)))
        if merged:
            toma.apply_toma(model, ratio, **options)
        models[merged] = model
    row = {"model": name, "shape": what, "mode": mode, "world": world, "ratio": ratio}
    for merged, model in models.items():
        BYTES.clear()
        forward(model, kw)
        row["merged" if merged else "unmerged"] = dict(BYTES)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for merged, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            forward(model, kw)
            times[merged].append(time.perf_counter() - start)
    if repeats:
        row["seconds_unmerged"] = statistics.median(times[False])
        row["seconds_merged"] = statistics.median(times[True])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="wan,flux")
    parser.add_argument("--modes", default=None, help="ulysses,ring (2 ranks) or both (4 ranks) by default")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--time", type=int, default=5, help="timed forwards of each model (0: bytes only)")
    parser.add_argument("--out", default=None, help="a JSON file for rank 0's rows")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cuda: NCCL, one GPU per rank, bfloat16, diffusers' own attention backends",
    )
    parser.add_argument(
        "--backend",
        default=None,
        help="set_attention_backend before enable_parallelism (GPU ring attention needs one that "
        "returns the log-sum-exp, e.g. _native_cudnn or flash)",
    )
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--side", type=int, default=24)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    global HEADS, BACKEND
    HEADS, BACKEND = args.heads, args.backend
    MODELS.update(models(args.frames, args.side))
    if args.device == "cuda":
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device, dtype = f"cuda:{torch.cuda.current_device()}", torch.bfloat16
    else:
        dist.init_process_group("gloo")
        device, dtype = "cpu", torch.float32
        import cp_worker  # noqa: F401  (the CPU shims: device count, math attention with log-sum-exp)
    world = dist.get_world_size()

    _count("all_to_all_single", funcol)
    _count("all_gather_tensor", funcol)
    _count("all_gather", dist, tensor_arg=1)
    modes = args.modes.split(",") if args.modes else (["ulysses", "ring"] if world == 2 else ["both"])
    rows = [
        measure(m, mode, world, args.time, args.ratio, device, dtype) for m in args.models.split(",") for mode in modes
    ]
    if dist.get_rank() == 0:
        print(f"{'model':6} {'mode':8} P  attention MB unmerged -> merged   output MB   s/forward unmerged -> merged")
        for r in rows:
            a0, a1 = r["unmerged"].get("attention", 0) / 1e6, r["merged"].get("attention", 0) / 1e6
            o0 = r["unmerged"].get("output", 0) / 1e6
            t = f"{r['seconds_unmerged']:.3f} -> {r['seconds_merged']:.3f}" if "seconds_merged" in r else "-"
            print(f"{r['model']:6} {r['mode']:8} {world}  {a0:8.2f} -> {a1:8.2f} ({a1 / a0:.2f}x)   {o0:6.2f}     {t}")
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(
                    {
                        "rows": rows,
                        "device": args.device,
                        "load": os.getloadavg(),
                        "threads": torch.get_num_threads(),
                        "command": " ".join(sys.argv),
                    },
                    f,
                    indent=1,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
