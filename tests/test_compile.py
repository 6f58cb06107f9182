"""ToMA under torch.compile: no graph breaks in the merge path, no recompiles per step.

Dynamo's behaviour (graph capture, guards, recompiles) does not depend on the backend, so
these tests compile with ``backend="eager"`` to stay fast on a CPU; ``toma bench
--compile`` times the real (inductor) compiler.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import toma
from toma.tools.archs import ARCHS, build_model, call_denoiser, make_inputs, set_timestep

TOMA_DIR = Path(toma.__file__).parent
# Reading the timestep and the image grid into Python (to count steps and size plans)
# happens once per denoiser call in its step hook, outside the merge path.
STEP_HOOK_FUNCTIONS = {"timestep_value", "image_grid", "begin_forward"}


# compiling is slow on a CPU: of the newer families, FLUX.2 (dual then single stream, ids
# read in the step hook) and CogVideoX (a video family with its own processor) are compiled
COMPILED = ["tiny-unet", "tiny-flux", "tiny-sd3", "tiny-wan", "tiny-flux2", "tiny-cogvideox"]


def toma_frames(reason):
    return [f for f in reason.user_stack if Path(f.filename).is_relative_to(TOMA_DIR)]


def patched(arch_name):
    """A tiny denoiser with ToMA at ratio 0.5, and one call's inputs at 64x64 pixels."""
    arch = ARCHS[arch_name]
    model = build_model(arch)
    toma.apply_toma(model, ratio=0.5)
    return arch, model, make_inputs(arch, 64)


@pytest.mark.parametrize("arch_name", COMPILED)
def test_no_graph_breaks_in_merge_path(arch_name):
    arch, model, inputs = patched(arch_name)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda **kw: call_denoiser(arch, model, kw))(**inputs)
    torch._dynamo.reset()
    in_merge_path = [
        (r.reason.splitlines()[0], [(Path(f.filename).name, f.name) for f in toma_frames(r)])
        for r in explained.break_reasons
        if toma_frames(r) and not {f.name for f in toma_frames(r)} & STEP_HOOK_FUNCTIONS
    ]
    assert in_merge_path == []
    # and the breaks that remain are few: the step hook's reads of Python scalars
    assert explained.graph_break_count <= 3


@pytest.mark.parametrize("arch_name", COMPILED)
def test_compiled_matches_eager_without_recompiling_every_step(arch_name):
    arch, model, inputs = patched(arch_name)
    steps = [set_timestep(arch, inputs, s, 6) for s in range(6)]
    with torch.no_grad():
        eager = [call_denoiser(arch, model, kw)[0] for kw in steps]
        torch._dynamo.reset()
        counters.clear()
        compiled_model = torch.compile(model, backend="eager")
        graphs = []
        outs = []
        for kw in steps:
            outs.append(call_denoiser(arch, compiled_model, kw)[0])
            graphs.append(counters["stats"]["unique_graphs"])
        # a second run of the same steps must reuse every graph
        for kw in steps:
            call_denoiser(arch, compiled_model, kw)
    torch._dynamo.reset()
    for a, b in zip(outs, eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # graphs may be added while the first steps settle the guards (first call, first
    # reuse of a plan, first falling timestep), never once per step after that
    assert graphs[2] == graphs[-1], graphs
    assert counters["stats"]["unique_graphs"] == graphs[-1]
