"""ToMA under torch.compile: no graph breaks in the merge path, no recompiles per step.

Dynamo's behaviour (graph capture, guards, recompiles) does not depend on the backend, so
these tests compile with ``backend="eager"`` to stay fast on a CPU; ``toma bench
--compile`` times the real (inductor) compiler.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch._dynamo.backends.debugging import ExplainWithBackend
from torch._dynamo.utils import counters

import toma
from toma.core.plan import build_plan, finite_or_zero
from toma.core.tiling import layout_index, make_layout, tile_order
from toma.tools.archs import ARCHS, build_model, call_denoiser, make_inputs, set_timestep

TOMA_DIR = Path(toma.__file__).parent
# Reading the timestep and the image grid into Python (to count steps and size plans)
# happens once per denoiser call in its step hook, outside the merge path.
STEP_HOOK_FUNCTIONS = {"timestep_value", "image_grid", "begin_forward"}


# compiling is slow on a CPU: of the newer families, FLUX.2 (dual then single stream, ids
# read in the step hook) and CogVideoX (a video family with its own processor) are compiled,
# and Flux with a reference image (Kontext: the conditioning tokens' reorderings)
COMPILED = ["tiny-unet", "tiny-flux", "tiny-flux-kontext", "tiny-sd3", "tiny-wan", "tiny-flux2", "tiny-cogvideox"]


def toma_frames(reason):
    return [f for f in reason.user_stack if Path(f.filename).is_relative_to(TOMA_DIR)]


def patched(arch_name):
    """A tiny denoiser with ToMA at ratio 0.5, and one call's inputs at 64x64 pixels."""
    arch = ARCHS[arch_name]
    model = build_model(arch)
    toma.apply_toma(model, ratio=0.5)
    return arch, model, make_inputs(arch, 64)


def compiled_steps(arch, model, inputs, count: int = 6) -> tuple[list[int], list]:
    """Run ``count`` steps eager, then compiled twice (the second run must reuse every
    graph); checks the compiled outputs against eager. Returns the graph count after each
    step of the first compiled run, and the graph breaks of the first step."""
    steps = [set_timestep(arch, inputs, s, count) for s in range(count)]
    with torch.no_grad():
        eager = [call_denoiser(arch, model, kw)[0] for kw in steps]
        torch._dynamo.reset()
        counters.clear()
        explained = ExplainWithBackend("eager")  # the eager backend, recording each graph's break
        compiled_model = torch.compile(model, backend=explained)
        graphs, outs = [], []
        for kw in steps:
            outs.append(call_denoiser(arch, compiled_model, kw)[0])
            graphs.append(counters["stats"]["unique_graphs"])
            if len(graphs) == 1:
                first_breaks = list(explained.break_reasons)
        for kw in steps:
            call_denoiser(arch, compiled_model, kw)
    torch._dynamo.reset()
    for a, b in zip(outs, eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    return graphs, first_breaks


@pytest.mark.parametrize("arch_name", COMPILED)
def test_compiled_matches_eager_with_no_break_in_the_merge_path_nor_recompiles(arch_name):
    # one compile per model for both checks (tracing a tiny model costs seconds here): the
    # graph breaks of the first step, then the guards over the later steps
    graphs, breaks = compiled_steps(*patched(arch_name))
    in_merge_path = [
        (r.reason.splitlines()[0], [(Path(f.filename).name, f.name) for f in toma_frames(r)])
        for r in breaks
        if toma_frames(r) and not {f.name for f in toma_frames(r)} & STEP_HOOK_FUNCTIONS
    ]
    assert in_merge_path == []
    # and the breaks that remain are few: the step hook's reads of Python scalars
    assert len(breaks) <= 3
    # graphs may be added while the first steps settle the guards (first call, first
    # reuse of a plan, first falling timestep), never once per step after that
    assert graphs[2] == graphs[-1], graphs
    assert counters["stats"]["unique_graphs"] == graphs[-1]


def test_step_window_compiles_once_per_side():
    # the window is a bool the merge path reads, not the step: entering and leaving it may
    # add graphs, later steps and a second run may not
    arch = ARCHS["tiny-unet"]
    model = build_model(arch)
    toma.apply_toma(model, ratio=0.5, start_step=2, stop_step=4)
    graphs, _ = compiled_steps(arch, model, make_inputs(arch, 64))
    assert graphs[4] == graphs[-1] == counters["stats"]["unique_graphs"], graphs


SPECIAL = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1.5, -2.25, 1e-40, -1e-40, 3e38, -3e38]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finite_or_zero_is_nan_to_num_eager_and_compiled(dtype):
    # the compiled branch (where + isfinite) must give nan_to_num's bits, -0.0 and subnormals included
    x = torch.tensor(SPECIAL, dtype=torch.float32).to(dtype).repeat(3)
    expected = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    torch._dynamo.reset()
    compiled = torch.compile(finite_or_zero, backend="eager", fullgraph=True)(x)
    torch._dynamo.reset()
    for out in (finite_or_zero(x), compiled):
        assert out.dtype == dtype
        assert torch.equal(
            out.view(torch.int16 if dtype != torch.float32 else torch.int32),
            expected.view(torch.int16 if dtype != torch.float32 else torch.int32),
        )


def _cpp_compiler() -> bool:
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


@pytest.mark.skipif(not _cpp_compiler(), reason="inductor's CPU backend needs a C++ compiler")
def test_inductor_plan_has_no_scalar_nan_loop():
    """Inductor's CPU code for ``nan_to_num`` tests NaN element by element (``std::isnan`` on a
    stored vector), which made SD 1.5's compiled plan twice as slow as with the vectorised
    ``isfinite`` form the plan uses under compile. Compiled with inductor, the plan must
    match the eager one and contain no such test."""
    from torch._inductor.utils import run_and_get_code

    layout = make_layout(8, 8, (1, 4, 4), 0.5)
    index = layout_index(layout)
    config = toma.ToMAConfig(ratio=0.5)
    x = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(0))
    tiles = tile_order(x, layout).unflatten(1, (layout.num_tiles, layout.tile_area))

    def plan_tensors(t):
        plan = build_plan(
            t, layout, t.dtype, selection=config.selection, temperature=config.temperature, generator=None, index=index
        )
        return plan.dest, plan.merge_w, plan.unmerge_w, plan.mass

    torch._dynamo.reset()
    with torch.no_grad():
        compiled, code = run_and_get_code(torch.compile(plan_tensors, fullgraph=True), tiles)
        eager = plan_tensors(tiles)
    torch._dynamo.reset()
    assert not any("isnan" in c for c in code), "a scalar NaN test in the compiled plan"
    # random tokens: no near-tie among the greedy's candidates, so the destinations agree
    assert torch.equal(compiled[0], eager[0])
    for c, e in zip(compiled[1:], eager[1:]):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not _cpp_compiler(), reason="inductor's CPU backend needs a C++ compiler")
def test_inductor_freezing_compiles_toma(monkeypatch):
    """``toma bench/tune --compile --freezing``: ToMA's hooks compile with inductor's freezing
    (weights folded in as constants) and give the eager ToMA output. On the tiny SD3: an
    inductor build of the tiny UNet took 115 s with a cold cache, this one 60 s."""
    from toma.tools.bench import harness as bench_harness

    arch = ARCHS["tiny-sd3"]
    model = build_model(arch)
    harness = bench_harness.MethodPatcher(model, arch, {"tile_size": 4}, {}, None)
    variant = bench_harness.Variant("toma", 0.5)
    inputs = make_inputs(arch, 64)
    options = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: options.append(kw.get("options")) or real_compile(m, **kw))
    torch._dynamo.reset()
    with torch.inference_mode():
        plain = call_denoiser(arch, model, inputs)[0]
        harness.apply(variant)
        eager = call_denoiser(arch, model, inputs)[0]
        harness.remove()
        calls = bench_harness.compile_variants(
            harness, [variant], [1], {1: [inputs]}, 0, torch.device("cpu"), lambda s: None, freezing=True
        )
        (call,) = calls.values()
        compiled = call(inputs)[0]
    torch._dynamo.reset()
    assert options == [{"freezing": True}]
    # inductor reassociates float32 sums (~1e-6 relative per op through the net); merging
    # itself moves this output by far more than the tolerance (9e-3 here, 90 times it)
    assert (plain - eager).abs().max() > 1e-3
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
