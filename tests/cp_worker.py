"""Context-parallel cases on CPU processes: what tests/adapters/test_context_parallel.py reads.

Run as ``python tests/cp_worker.py --world P OUT_DIR [CASE ...]`` (P ranks forked after one
import of everything) or ``torchrun --nproc_per_node=P tests/cp_worker.py OUT_DIR [CASE ...]``:
every rank runs every case of world size P in the same order (each under a time limit), and
writes ``OUT_DIR/rank{r}.json`` with one record per case. One spawn per world size keeps the
start-up cost (gloo, imports) to one per size.

Two things stand between diffusers' context parallelism and a CPU:

* diffusers picks the device ``rank % torch.accelerator.device_count()``, which is 0 on a
  CPU: the count is patched to 1 (every rank on ``cpu``);
* ring attention merges each key/value chunk's partial result with its log-sum-exp, which
  none of diffusers' CPU backends returns: a small math backend, which does, is
  registered in diffusers' dispatch registry under ``native`` (the backend the tiny
  models use), for the single-process references too, so that a reference and a CP run
  differ only in how CP splits and exchanges the work.

Each backend call records its local query and key counts, which is how a case sees what
attention ran on.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
import traceback
import warnings
from typing import Any, Callable

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)
torch.accelerator.device_count = lambda: 1  # see the module docstring

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from diffusers import ContextParallelConfig  # noqa: E402
from diffusers.models import attention_dispatch as dispatch  # noqa: E402
from tiny_models import (  # noqa: E402
    flux2_inputs,
    flux_inputs,
    ltx2_inputs,
    ltx_inputs,
    minimax_h3_inputs,
    make_flux,
    make_flux2,
    make_ltx,
    make_ltx2,
    make_minimax_h3,
    make_qwen,
    make_wan,
    qwen_inputs,
    wan_inputs,
)

import toma  # noqa: E402

LAST: dict[str, torch.Tensor] = {}  # the last compare's CP + ToMA output
CASE_SECONDS = 60  # one case's limit; a hang in a collective ends there, not at the spawn's.
# 60, not 20: under xdist the ranks share the two cores with the other worker, and a Triton
# case in the interpreter passed 20 s there (CaseTimeout, a full run at load 3-4)
CALLS: list[tuple[int, int, bool]] = []  # (local queries, local keys, under CP) per attention call


def _math_forward_op(
    ctx,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    return_lse=False,
    _save_ctx=True,
    _parallel_config=None,
):
    """Attention on ``(B, S, H, D)`` tensors by its definition, with the log-sum-exp
    ``(B, S, H)`` of each query's scores when ``return_lse`` (ring attention's need)."""
    if dropout_p or is_causal or enable_gqa:
        raise ValueError("the test backend does attention without dropout, causal masks or GQA")
    q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    lse = scores.logsumexp(-1)
    out = (torch.softmax(scores, -1) @ v).permute(0, 2, 1, 3)
    return (out, lse.permute(0, 2, 1)) if return_lse else out


def math_backend(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    return_lse=False,
    _parallel_config=None,
):
    """The test's ``native`` backend: the math above, through diffusers' Ulysses and ring
    templates under CP."""
    CALLS.append((query.shape[1], key.shape[1], _parallel_config is not None))
    if attn_mask is not None and attn_mask.ndim == 2 and attn_mask.shape == (query.shape[0], key.shape[1]):
        attn_mask = attn_mask[:, None, None, :]
    if _parallel_config is None:
        return _math_forward_op(None, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse)
    return dispatch._templated_context_parallel_attention(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        return_lse,
        forward_op=_math_forward_op,
        backward_op=dispatch._native_attention_backward_op,
        _parallel_config=_parallel_config,
    )


dispatch._AttentionBackendRegistry.register(dispatch.AttentionBackendName.NATIVE, supports_context_parallel=True)(
    math_backend
)


# ---- the families, at sizes whose shards (P ranks) are tile-aligned runs of whole rows ----

ALL_BLOCKS = {
    "flux": {"flux_double_blocks": (0, 1), "flux_single_blocks": (0, 1)},
    "flux2": {"blocks": {"transformer_blocks": range(2), "single_transformer_blocks": range(2)}},
    "wan": {"blocks": {"blocks": range(2)}},
    "qwenimage": {"blocks": {"transformer_blocks": range(2)}},
    "ltx": {"blocks": {"transformer_blocks": range(2)}},
    "ltx2": {"blocks": {"transformer_blocks": range(2)}},
    "minimax-h3": {"blocks": {"transformer_blocks": range(2)}},
}
MAKERS = {
    "flux": make_flux,
    "flux2": make_flux2,
    "wan": lambda: make_wan(layers=2),
    "qwenimage": lambda: make_qwen(layers=2),
    "ltx": lambda: make_ltx(layers=2),
    "ltx2": lambda: make_ltx2(layers=2),
    "minimax-h3": lambda: make_minimax_h3(layers=2),
}
# merged self-attention calls per forward with ALL_BLOCKS (double and single blocks alike)
MERGED_CALLS = {"flux": 4, "flux2": 4, "wan": 2, "qwenimage": 2, "ltx": 2, "ltx2": 2, "minimax-h3": 2}


def inputs(family: str, world: int, rows: int | None = None, cols: int = 8, frames: int | None = None) -> dict:
    """A call whose token grid splits into ``world`` tile-aligned shards (4 rows of 8 per
    rank for images; whole frames or 4-row bands for video), or ``rows x cols`` (``frames``)."""
    rows = 4 * world if rows is None else rows
    if family == "flux":
        return flux_inputs(1, rows, cols, text=4)  # CP splits Flux's text too: 4 tokens
    if family == "flux2":
        return flux2_inputs(1, rows, cols, text=4)
    if family == "qwenimage":
        # without a text mask (one of ones): under Ulysses x ring, diffusers' unified
        # attention fails on Qwen-Image's joint mask
        return {**qwen_inputs(1, rows, cols, text=4), "encoder_hidden_states_mask": None}
    if family == "wan":  # 3 frames of 8x8 at P=2 (1.5 frames, 12 rows, per rank), 4 at P=4
        frames = (3 if world == 2 else world) if frames is None else frames
        return wan_inputs(1, frames, 2 * (8 if rows == 4 * world else rows), 2 * cols)
    if family == "ltx":
        # without a text mask: diffusers' ring attention applies a rank's mask to every
        # rank's keys, and its Ulysses path fails on LTX's (B, 1, S) text bias
        frames = 2 if frames is None else frames
        return {**ltx_inputs(1, frames, 8 if rows == 4 * world else rows, cols, text=4), "encoder_attention_mask": None}
    if family == "ltx2":
        # isolate_modalities: diffusers 0.42.1's plan splits the video but leaves the audio-video
        # attentions' time tables (cross_attn_rope) whole, so those attentions fail under CP
        # unless they are off; without text masks, as LTX's
        frames = 2 if frames is None else frames
        kw = ltx2_inputs(1, frames, 8 if rows == 4 * world else rows, cols, text=4)
        return {**kw, "encoder_attention_mask": None, "audio_encoder_attention_mask": None, "isolate_modalities": True}
    if family == "minimax-h3":
        # diffusers splits the packed [text; audio; video] sequence: 4 text rows and 4 audio
        # rows before 2 frames of 8x8 video, so that with the prefix spread each shard holds
        # one frame (P=2) or 4 rows (P=4); or rows x cols latents (2x2 patches) of one frame
        if rows == 4 * world:
            return minimax_h3_inputs(1, 2, 16, 16, text=4, audio=2)
        return minimax_h3_inputs(1, 1 if frames is None else frames, 2 * rows, 2 * cols, text=5, audio=2)
    raise KeyError(family)


def ltx2_coords(world: int) -> dict:
    """LTX-2's aligned call with the pipelines' ``video_coords``."""
    kw = inputs("ltx2", world)
    coords = ltx2_inputs(1, 2, 8, 8, coords=True)["video_coords"]
    return {**kw, "video_coords": coords}


def sliced_ids(kw: dict) -> dict:
    """``kw`` with its image ids a slice of a longer tensor: a shard's ids are then no view
    of the whole ids alone."""
    ids = kw["img_ids"]
    longer = torch.cat([ids, torch.zeros(8, ids.shape[1])])
    return {**kw, "img_ids": longer[: ids.shape[0]]}


def kontext(world: int) -> dict:
    """Flux Kontext's call: an 8x8 image's tokens, then a 4x4 reference's (ids of first column 1)."""
    kw = flux_inputs(1, 8, 8, text=4)
    rows, cols = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    ref = torch.stack([torch.ones_like(rows), rows, cols], -1).reshape(-1, 3).float()
    g = torch.Generator().manual_seed(7)
    return {
        **kw,
        "img_ids": torch.cat([kw["img_ids"], ref]),
        "hidden_states": torch.cat([kw["hidden_states"], torch.randn(1, 16, 16, generator=g)], dim=1),
    }


MODES = {
    "ulysses": lambda p: {"ulysses_degree": p},
    "ring": lambda p: {"ring_degree": p},
    "both": lambda p: {"ulysses_degree": 2, "ring_degree": p // 2},
}


def _sample(model: torch.nn.Module, kw: dict) -> torch.Tensor:
    # diffusers' CP hook on the model itself takes tensors only, not an output dataclass
    with torch.no_grad():
        return model(**kw, return_dict=False)[0]


def _run(model: torch.nn.Module, kw: dict) -> tuple[torch.Tensor, list[tuple[int, int, bool]]]:
    """The model's output for ``kw`` and the attention calls it made."""
    CALLS.clear()
    out = _sample(model, kw)
    return out, list(CALLS)


def _cp(model: torch.nn.Module, mode: str, world: int, **extra: Any) -> torch.nn.Module:
    model.enable_parallelism(config=ContextParallelConfig(**MODES[mode](world), **extra))
    return model


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference as a share of ``b``'s range."""
    return float((a - b).abs().max() / (b.max() - b.min()))


def _enable(model: torch.nn.Module, mode: str, world: int, order: str, options: dict) -> Any:
    if order == "cp_first":
        _cp(model, mode, world)
        return toma.apply_toma(model, 0.5, **options)
    patch = toma.apply_toma(model, 0.5, **options)
    _cp(model, mode, world)
    return patch


def compare(
    family: str, mode: str, world: int, order: str = "cp_first", kw: dict | None = None, **toma_options: Any
) -> dict:
    """CP + ToMA against single-process ToMA, unmerged CP and the plain model, in ``order``
    of enabling; with the local query counts of the CP attention calls."""
    make, options = MAKERS[family], {**ALL_BLOCKS[family], **toma_options}
    kw = inputs(family, world) if kw is None else kw
    plain = _sample(make(), kw)
    reference = make()
    toma.apply_toma(reference, 0.5, **options)
    ref = _sample(reference, kw)
    unmerged, plain_calls = _run(_cp(make(), mode, world), kw)
    model = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patch = _enable(model, mode, world, order, options)
        out, calls = _run(model, kw)
        shard = patch.cache.forward.shard
        grid = patch.cache.forward.grid
        kept = patch.cache.layout(*grid).num_merged if grid[-1] else None  # the shard's merged length
        toma.remove_toma(model)
        removed = _sample(model, kw)
    LAST["out"] = out
    return {
        "gap_to_single": _gap(out, ref),
        "gap_to_unmerged_cp": _gap(out, unmerged),
        "unmerged_cp_gap": _gap(unmerged, plain),  # diffusers' own CP against one process
        "equals_unmerged_cp": bool(torch.equal(out, unmerged)),
        "removed_equals_unmerged_cp": bool(torch.equal(removed, unmerged)),
        "cp_queries": sum(q for q, _, cp in calls if cp),
        "cp_queries_unmerged": sum(q for q, _, cp in plain_calls if cp),
        "shard": shard,
        "grid": grid,
        "kept": kept,
        "warnings": sorted({str(w.message) for w in caught if "ToMA" in str(w.message)}),
    }


def refused(family: str, mode: str, world: int, order: str, cp_extra: dict | None = None, **toma_options: Any) -> dict:
    """The error CP + ToMA raises (at apply_toma with ``order="cp_first"``, else at the first
    forward), or None."""
    make, options = MAKERS[family], {**ALL_BLOCKS[family], **toma_options}
    model = make()
    where = "apply_toma"
    try:
        if order == "cp_first":
            _cp(model, mode, world, **(cp_extra or {}))
            toma.apply_toma(model, 0.5, **options)
        else:
            toma.apply_toma(model, 0.5, **options)
            _cp(model, mode, world, **(cp_extra or {}))
        where = "forward"
        _sample(model, inputs(family, world))
    except ValueError as e:
        return {"raised": where, "error": str(e)}
    return {"raised": None}


def on_triton(case: Callable[[], dict]) -> dict:
    """``case`` with toma's Triton kernels (in the interpreter): its record, how far its
    output is from the torch path's, and the kernels it launched with their tensors' devices."""
    from toma.kernels import LAUNCH_OBSERVERS

    launches: list[tuple[str, list[str]]] = []

    def observe(name, kernel, args, constexprs):
        launches.append((name, sorted({str(a.device) for a in args if isinstance(a, torch.Tensor)})))

    case()
    torch_path = LAST["out"]
    LAUNCH_OBSERVERS.append(observe)
    os.environ["TOMA_KERNELS"] = "triton"
    try:
        record = case()
    finally:
        del os.environ["TOMA_KERNELS"]
        LAUNCH_OBSERVERS.remove(observe)
    record["gap_to_torch_path"] = _gap(LAST["out"], torch_path)
    record["kernels"] = sorted({name for name, _ in launches})
    record["kernel_devices"] = sorted({d for _, devices in launches for d in devices})
    return record


def table(world: int) -> dict[str, Callable[[], dict]]:
    """The cases of world size ``world``, by name."""
    cases: dict[str, Callable[[], dict]] = {}
    modes = ("ulysses", "ring") if world == 2 else ("both",)
    for family in MAKERS:
        for mode in modes:
            # both orders of enabling at P=2; at P=4 (4 processes on the CI's 2 cores) one
            for order in ("cp_first", "toma_first") if world == 2 or family == "wan" else ("cp_first",):
                cases[f"aligned/{family}/{mode}/{order}"] = functools.partial(compare, family, mode, world, order)
    for mode in modes:
        # shards off the tile grid: Wan's 9-row bands of 6-row frames, Flux's 3-row bands
        cases[f"unaligned/wan/{mode}"] = functools.partial(
            compare, "wan", mode, world, kw=inputs("wan", world, rows=6, frames=3 if world == 2 else 6)
        )
        # a 9x8 grid: 4.5 rows per rank at P=2, 2.25 at P=4
        cases[f"midrow/flux/{mode}"] = functools.partial(compare, "flux", mode, world, kw=inputs("flux", world, rows=9))
        cases[f"midrow/wan/{mode}"] = functools.partial(
            compare, "wan", mode, world, kw=inputs("wan", world, rows=9, frames=1)
        )
        # shards shorter than a row; the same where the ids are no view of what diffusers
        # split (a slice of a longer tensor), so that Flux reads its grid from a shard alone
        cases[f"subrow/flux/{mode}"] = functools.partial(
            compare, "flux", mode, world, kw=inputs("flux", world, rows=1, cols=4 * world)
        )
        cases[f"subrow-sliced/flux/{mode}"] = functools.partial(
            compare, "flux", mode, world, kw=sliced_ids(inputs("flux", world, rows=1, cols=4 * world))
        )
        cases[f"midrow-sliced/flux/{mode}"] = functools.partial(
            compare, "flux", mode, world, kw=sliced_ids(inputs("flux", world, rows=9))
        )
        cases[f"kontext/flux/{mode}"] = functools.partial(compare, "flux", mode, world, kw=kontext(world))
        if world == 2:
            cases[f"unaligned/flux/{mode}"] = functools.partial(
                compare, "flux", mode, world, kw=inputs("flux", world, rows=6)
            )
            for family in ("flux2", "qwenimage", "ltx", "ltx2"):
                cases[f"midrow/{family}/{mode}"] = functools.partial(
                    compare, family, mode, world, kw=inputs(family, world, rows=9, frames=1)
                )
        # the bias rides in the keys (the key channel), so ring attention's exchanges carry it
        cases[f"proportional/wan/{mode}/compare"] = functools.partial(
            compare, "wan", mode, world, proportional_attention=True
        )
        cases[f"proportional/flux/{mode}/compare"] = functools.partial(
            compare, "flux", mode, world, proportional_attention=True
        )
        # MiniMax H3: 9 prefix rows before a 9x7 video, spread unevenly over the shards
        cases[f"unaligned/minimax-h3/{mode}"] = functools.partial(
            compare, "minimax-h3", mode, world, kw=inputs("minimax-h3", world, rows=9, cols=7)
        )
        cases[f"proportional/minimax-h3/{mode}/compare"] = functools.partial(
            compare, "minimax-h3", mode, world, proportional_attention=True
        )
        cases[f"proportional/ltx2/{mode}/compare"] = functools.partial(
            compare, "ltx2", mode, world, proportional_attention=True
        )
        # the pipelines' video_coords, which diffusers leaves whole: the tables made from them
        # are split, each shard's rows in its tile order
        cases[f"coords/ltx2/{mode}"] = functools.partial(compare, "ltx2", mode, world, kw=ltx2_coords(world))
    if world == 2:  # two samples: Flux's merged attention then runs once per sample, on every rank
        cases["batch2/flux/ulysses"] = functools.partial(
            compare, "flux", "ulysses", world, kw=flux_inputs(2, 8, 8, text=4)
        )
        cases["batch2/wan/ring"] = functools.partial(compare, "wan", "ring", world, kw=wan_inputs(2, 3, 16, 16))
    if world == 2:  # the Triton path, on a shard that is a grid and on a span
        cases["triton/wan/ulysses/aligned"] = functools.partial(
            on_triton, functools.partial(compare, "wan", "ulysses", world)
        )
        cases["triton/wan/ring/midrow"] = functools.partial(
            on_triton, functools.partial(compare, "wan", "ring", world, kw=inputs("wan", world, rows=9, frames=1))
        )
    uneven = ("ulysses", {"ulysses_anything": True}) if world == 2 else ("ring", {"ring_anything": True})
    cases["anything/wan/cp_first"] = functools.partial(refused, "wan", uneven[0], world, "cp_first", cp_extra=uneven[1])
    return cases


class CaseTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CaseTimeout(f"over {CASE_SECONDS} s")


def run_cases(out_dir: str, wanted: set[str]) -> None:
    """Every case of this world size (or those ``wanted``), in order, each under the time
    limit; this rank's records written to ``out_dir``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    signal.signal(signal.SIGALRM, _alarm)
    results: dict[str, Any] = {}
    for name, case in table(world).items():
        if wanted and name not in wanted:
            continue
        start = time.perf_counter()
        signal.alarm(CASE_SECONDS)
        try:
            results[name] = {"ok": True, **case()}
        except Exception as e:  # recorded for the test to report; the next case still runs
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        finally:
            signal.alarm(0)
        results[name]["seconds"] = round(time.perf_counter() - start, 3)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()


def _forked_rank(rank: int, world: int, out_dir: str, wanted: set[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    store = f"file://{os.path.join(out_dir, 'store')}"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    run_cases(out_dir, wanted)


def launch(world: int, out_dir: str, wanted: set[str]) -> int:
    """Run the cases on ``world`` ranks forked from this process, which imported torch,
    diffusers and toma once: ``torchrun`` starts a fresh interpreter per rank, and their
    imports were most of a spawn's time on 2 cores. At ``OMP_NUM_THREADS=1`` there is no
    thread pool for a fork to lose. Returns the exit status: 1 if a rank failed."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_forked_rank, args=(r, world, out_dir, wanted)) for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    failed = {r: proc.exitcode for r, proc in enumerate(procs) if proc.exitcode}
    if failed:
        print(f"ranks failed (rank: exit code): {failed}", file=sys.stderr)
    return 1 if failed else 0


def main() -> None:
    """``cp_worker.py --world P OUT_DIR [CASE ...]`` forks P ranks; under ``torchrun``
    (``cp_worker.py OUT_DIR [CASE ...]``) this process is one rank."""
    args = sys.argv[1:]
    if args[:1] == ["--world"]:
        sys.exit(launch(int(args[1]), args[2], set(args[3:])))
    dist.init_process_group("gloo")
    run_cases(args[0], set(args[1:]))


if __name__ == "__main__":
    main()
