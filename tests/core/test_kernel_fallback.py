"""An optional kernel never breaks a generation: errors and launches that do not fit fall
back to the torch path, said once; launches go to their tensors' own device.

The kernels run in Triton's interpreter here. ``auto`` mode picks them on GPUs only, so
these tests add the CPU to :data:`toma.kernels.AUTO_DEVICE_TYPES`; kernels fail on
purpose through :data:`toma.kernels.triton_ops.KERNEL_FNS` (looked up at each launch).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
import torch

pytest.importorskip("triton")

import toma  # noqa: E402
from toma import kernels  # noqa: E402
from toma.kernels import HEALTH, KERNELS_ENV, triton_ops  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TRITON_INTERPRET was set to something else before triton loaded", allow_module_level=True)


class Broken:
    """A kernel whose every launch raises, as a compile error or a driver error would."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise RuntimeError("injected failure")

        return launch


class Counting:
    """A kernel that counts its launches."""

    def __init__(self, kernel):
        self.kernel, self.fn, self.launches = kernel, kernel.fn, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.fixture
def auto_on_cpu(monkeypatch):
    """``TOMA_KERNELS=auto`` running the kernels on CPU tensors (through the interpreter),
    with a clean slate of kernel failures before and after."""
    monkeypatch.setenv(KERNELS_ENV, "auto")
    monkeypatch.setattr(kernels, "AUTO_DEVICE_TYPES", ("cpu",))
    HEALTH.reset()
    launches = []
    kernels.LAUNCH_OBSERVERS.append(lambda name, *_: launches.append(name))
    yield launches
    kernels.LAUNCH_OBSERVERS.pop()
    HEALTH.reset()


def sdxl_output(model, kw):
    """ToMA's output at ratio 0.5 (the tiny SDXL's one attention level), in the current TOMA_KERNELS mode."""
    toma.apply_toma(model, ratio=0.5)
    try:
        with torch.no_grad():
            return model(**kw).sample
    finally:
        toma.remove_toma(model)


def toma_warnings(record) -> list[str]:
    return [
        str(w.message) for w in record if "toma: the Triton" in str(w.message) or "triton could not" in str(w.message)
    ]


def test_every_kernel_failing_gives_the_torch_path_bitwise_with_one_warning_each(monkeypatch, auto_on_cpu):
    from tests.tiny_models import make_sdxl_unet, unet_inputs

    model, kw = make_sdxl_unet(), unet_inputs(2, 16, 16, sdxl=True)
    monkeypatch.setenv(KERNELS_ENV, "torch")
    reference = sdxl_output(model, kw)
    monkeypatch.setenv(KERNELS_ENV, "auto")
    for name in kernels.KERNEL_NAMES:
        monkeypatch.setitem(triton_ops.KERNEL_FNS, name, Broken())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = sdxl_output(model, kw)
        again = sdxl_output(model, kw)
    # the first use of the device tried each kernel once, and every merge ran on torch
    assert torch.equal(out, reference) and torch.equal(again, reference)
    said = toma_warnings(record)
    assert len(said) == 3, said
    for name, message in zip(kernels.KERNEL_NAMES, said):
        assert f"Triton {name} kernel failed (RuntimeError: injected failure)" in message
        assert "TOMA_KERNELS=torch" in message
    assert kernels.describe_path(torch.device("cpu"))[0] == "torch"


def test_one_kernel_failing_leaves_the_others_running(monkeypatch, auto_on_cpu):
    from tests.tiny_models import make_sdxl_unet, unet_inputs

    model, kw = make_sdxl_unet(), unet_inputs(2, 16, 16, sdxl=True)
    monkeypatch.setenv(KERNELS_ENV, "torch")
    reference = sdxl_output(model, kw)
    monkeypatch.setenv(KERNELS_ENV, "auto")
    monkeypatch.setitem(triton_ops.KERNEL_FNS, "unmerge", Broken())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = sdxl_output(model, kw)
    said = toma_warnings(record)
    assert len(said) == 1 and "Triton unmerge kernel failed" in said[0], said
    # plans and merges still ran as kernels; the unmerge was tried once (the probe), then not again
    assert auto_on_cpu.count("plan") >= 2 and auto_on_cpu.count("merge") >= 2
    assert auto_on_cpu.count("unmerge") == 1
    # the same plans; the merges differ from the torch path's by float32 summation order
    # (see test_kernels.py: under 1e-6 through these blocks, against ~1e-2 for merging)
    assert torch.allclose(out, reference, atol=1e-5, rtol=0)
    assert kernels.describe_path(torch.device("cpu"))[0] == "triton (partly)"


def test_a_kernel_failing_mid_run_falls_back_in_that_call(monkeypatch, auto_on_cpu):
    # past the probe: a failure at a shape of its own (a compile error for one block
    # shape, out of resources) is caught at that launch, which then runs on torch
    from toma.core.plan import build_fused_plan
    from toma.core.tiling import kernel_index, layout_index, make_layout

    assert kernels.use_triton(torch.device("cpu"))  # probed: all three work
    layout = make_layout(8, 8, (4, 4), 0.5)
    x = torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(0))
    plan = build_fused_plan(x, False, layout, x.dtype, layout_index(layout), kernel_index(layout), temperature=0.001)
    expected = plan.merge(x)
    monkeypatch.setitem(triton_ops.KERNEL_FNS, "merge", Broken())
    with pytest.warns(RuntimeWarning, match="Triton merge kernel failed"):
        merged = plan.merge(x)

    assert torch.equal(merged, dataclasses.replace(plan, kernels=None).merge(x))
    assert torch.allclose(merged, expected, atol=1e-5, rtol=0)
    assert not kernels.kernel_usable("merge") and kernels.kernel_usable("plan")


def test_explicit_triton_mode_raises_the_kernel_error(monkeypatch):
    from toma.core.tiling import kernel_index, make_layout

    monkeypatch.setenv(KERNELS_ENV, "triton")
    HEALTH.reset()
    monkeypatch.setitem(triton_ops.KERNEL_FNS, "plan", Broken())
    layout = make_layout(4, 4, (4, 4), 0.5)
    x = torch.randn(1, 16, 8)
    with pytest.raises(RuntimeError, match="injected failure"):
        triton_ops.plan_tiles(x, kernel_index(layout).src_raster, layout.slots, 0.1, x.dtype)
    assert kernels.kernel_usable("plan")
    HEALTH.reset()


def test_a_failing_triton_import_means_the_torch_path_with_one_warning(monkeypatch, auto_on_cpu):
    import importlib

    real = importlib.import_module

    def failing(name, *args, **kwargs):
        if name == "toma.kernels.triton_ops":
            raise ImportError("libcuda.so.1: cannot open shared object file")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", failing)
    with pytest.warns(RuntimeWarning, match="triton could not be imported .*libcuda") as record:
        assert not kernels.use_triton(torch.device("cpu"))
        assert not kernels.use_triton(torch.device("cpu"))
    assert len(toma_warnings(record)) == 1


def fake_gpu_limits(monkeypatch, needed: dict[str, int], limit: int) -> list[str]:
    """The fit check on a pretend device with ``limit`` bytes of shared memory, where
    kernel ``name`` compiles to ``needed[name]`` bytes; returns the compiles it asked for."""
    compiled = []

    def shared_needed(kernel, grid, args, meta):
        name = next(n for n, k in triton_ops.KERNEL_FNS.items() if k is kernel)
        compiled.append(name)
        return needed.get(name, 1024)

    monkeypatch.setattr(triton_ops, "_shared_limit", lambda device: limit)
    monkeypatch.setattr(triton_ops, "_shared_needed", shared_needed)
    return compiled


def test_a_launch_that_does_not_fit_takes_the_torch_path_decided_before_launching(monkeypatch, auto_on_cpu):
    from toma.config import ToMAConfig
    from toma.adapters.state import PlanCache

    # numbers as an sm_86 (99 KB a block) would give a plan kernel of large tiles; the
    # probe's 16-token tiles fit
    compiled = fake_gpu_limits(monkeypatch, {"plan": 131072}, 101376)
    real = triton_ops._shared_needed
    monkeypatch.setattr(
        triton_ops,
        "_shared_needed",
        lambda kernel, grid, args, meta: real(kernel, grid, args, meta) if meta["N"] == 64 else 1024,
    )
    assert kernels.use_triton(torch.device("cpu"))
    counted = Counting(triton_ops.KERNEL_FNS["plan"])
    monkeypatch.setitem(triton_ops.KERNEL_FNS, "plan", counted)
    x = torch.randn(1, 64, 8, generator=torch.Generator().manual_seed(1))
    config = ToMAConfig(temperature=0.1, tile_size=8)
    with pytest.warns(
        RuntimeWarning, match="plan kernel for N=64, KB=32 in torch.float32 needs 131072 bytes"
    ) as record:
        cache = PlanCache(config)
        for step in range(3):
            cache.begin_forward((8, 8), None)
            plan = cache.get(x, (8, 8), group="g")
            plan.merge(x)
    assert len(toma_warnings(record)) == 1
    # one compile decided it for every later launch of that shape; no plan launch ran
    assert compiled.count("plan") == 1 and counted.launches == 0
    assert plan.kernels is not None and kernels.kernel_usable("plan")  # off for that shape only
    assert "merge" in auto_on_cpu
    # torch's plan: the torch greedy, applied by the merge kernel
    monkeypatch.setenv(KERNELS_ENV, "torch")
    ref = PlanCache(config)
    ref.begin_forward((8, 8), None)
    assert torch.equal(plan.dest, ref.get(x, (8, 8), group="g").dest)


def test_a_launch_that_does_not_fit_is_an_error_when_triton_is_forced(monkeypatch):
    from toma.core.tiling import kernel_index, make_layout

    monkeypatch.setenv(KERNELS_ENV, "triton")
    HEALTH.reset()
    fake_gpu_limits(monkeypatch, {"plan": 70000}, 65536)
    layout = make_layout(4, 4, (4, 4), 0.5)
    x = torch.randn(1, 16, 8)
    with pytest.raises(RuntimeError, match="needs 70000 bytes of shared memory, more than this device's 65536"):
        triton_ops.plan_tiles(x, kernel_index(layout).src_raster, layout.slots, 0.1, x.dtype)
    HEALTH.reset()


def test_kernels_launch_on_their_tensors_device(monkeypatch):
    # Triton launches on the current device; tensors on cuda:1 need cuda:1 made current
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    guard = triton_ops._device_guard(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert not isinstance(triton_ops._device_guard(torch.device("cuda", 0)), torch.cuda.device)
    assert not isinstance(triton_ops._device_guard(torch.device("cpu")), torch.cuda.device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert not isinstance(triton_ops._device_guard(torch.device("cuda", 1)), torch.cuda.device)


def test_every_launch_goes_through_the_device_guard(monkeypatch):
    from toma.core.plan import build_fused_plan
    from toma.core.tiling import kernel_index, layout_index, make_layout

    monkeypatch.setenv(KERNELS_ENV, "triton")
    guarded = []
    real = triton_ops._device_guard
    monkeypatch.setattr(triton_ops, "_device_guard", lambda device: guarded.append(device) or real(device))
    layout = make_layout(8, 8, (4, 4), 0.5)
    x = torch.randn(1, 64, 16)
    plan = build_fused_plan(x, False, layout, x.dtype, layout_index(layout), kernel_index(layout), temperature=0.001)
    plan.unmerge(plan.merge(x))
    assert guarded == [x.device] * 3
