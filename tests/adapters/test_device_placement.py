"""The merge path makes every tensor it uses on its input's device.

A tensor made without ``device=`` lands on the CPU. On the CPU that goes unseen, and so it
does on ``meta``: meta kernels accept CPU index tensors in ``index_select``, ``gather`` and
advanced indexing, which is what toma's index and rotary-row tensors are. On a GPU it is
an error, or (advanced indexing, which CUDA accepts from the host) a copy to the device at
every call, which waits for the host.

So the patched forward of every family runs here on fake tensors (shapes, dtypes and a
device, no data) on a device other than the CPU, under two checks: ``FakeTensorMode``
raises ``FakeTensorDeviceMismatchError`` where an op mixes devices as CUDA refuses to, and
:class:`ForeignTensors`, on top of it, refuses any op of a device tensor that takes a CPU
tensor of one element or more (CUDA reads 0-dim CPU tensors as scalars), advanced indexing
included; it also counts toma's copies from the host.

The fake device is ``lazy``, not ``cuda``: on a CPU-only build of torch, indexing and SDPA
of fake CUDA tensors need CUDA's device guard, which is not linked in ("PyTorch is not
linked with support for cuda devices"); ``lazy``'s is. Nothing in toma's torch path
branches on the device type but the choice of the Triton kernels, pinned to the torch path
here, so what runs is what a CUDA tensor runs with ``TOMA_KERNELS=torch`` (and what a
training step runs on CUDA).
"""

from __future__ import annotations

import pathlib
import traceback

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorDeviceMismatchError, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode

import toma
from tests.cases import CASES, case, read_ids_on_host
from toma.kernels import KERNELS_ENV

DEVICE = torch.device("lazy", 0)
TORCH, TOMA = (pathlib.Path(p).resolve().parent for p in (torch.__file__, toma.__file__))
TESTS = pathlib.Path(__file__).resolve().parents[1]  # every test module and helper
TO_COPY, COPY = torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default


class ForeignError(RuntimeError):
    """An op of a device tensor took a CPU tensor."""


def called_from_toma() -> bool:
    """Whether the innermost caller of torch on the stack, leaving out the tests', is
    toma's code: diffusers' own copies (Qwen-Image's rotary frequencies, at every call) are
    not toma's to answer for."""
    for frame in reversed(traceback.extract_stack()):
        path = pathlib.Path(frame.filename).resolve()
        if TORCH not in path.parents and TESTS not in path.parents:
            return TOMA in path.parents
    return False


class ForeignTensors(TorchDispatchMode):
    """Refuses ops that mix CPU tensors (of one element or more) into ``DEVICE`` tensors,
    and counts the copies from the host to ``DEVICE`` that toma's code makes (:attr:`uploads`):
    on a GPU each is a copy from pageable memory, which waits for the host, and which a
    captured CUDA graph could not replay (its host buffer lives for the call only). The
    ``meta`` device cannot count them: ``torch.tensor(data, device="meta")`` dispatches nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.uploads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is TO_COPY or func is COPY:
            source, target = (args[0], kwargs.get("device")) if func is TO_COPY else (args[1], args[0].device)
            if source.device.type == "cpu" and target is not None and torch.device(target).type == DEVICE.type:
                self.uploads += called_from_toma()
        else:
            devices = {t.device.type: t for t in _tensors(args, kwargs) if t.device.type != "cpu" or t.dim()}
            if "cpu" in devices and DEVICE.type in devices:
                raise ForeignError(
                    f"{func} mixes a CPU tensor of shape {tuple(devices['cpu'].shape)} into {DEVICE} tensors"
                )
        return func(*args, **kwargs)


def _tensors(args: tuple, kwargs: dict):
    """The tensors among an ATen op's arguments: arguments, and items of list arguments
    (``index`` takes its indices as a list). Cheaper than a pytree flatten, which at every
    op made the checks cost as much as the fake forward itself."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (b for b in a if isinstance(b, torch.Tensor))


# A fake forward costs several meta ones (each op runs in Python), so the fake device runs
# every family in tile order and with conditioning images, but padded grids for six of them:
# those run the same gathers of toma.core whatever the family (also tested on their own
# below), and the six cover each way a family's rotary rows follow merged tokens in raster
# order (shared tables per sample, per-batch gathers, the caller's raster tables)
ON_FAKE_DEVICE = [
    name
    for name in CASES
    if name
    not in ("sdxl-padded", "flux-padded", "sd3-padded", "pixart-padded", "qwenimage-padded", "hunyuanvideo-padded")
]

# cases whose model makes rotary tables on the host at every forward: JoyImage's cos and
# sin (get_rotary_pos_embed), which toma moves to the device once per forward
HOST_TABLES = {"joyimage-edit-tiled": 2}


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    # the Triton kernels cannot run on fake tensors; their launches are checked elsewhere
    monkeypatch.setenv(KERNELS_ENV, "torch")


def fake_mode() -> FakeTensorMode:
    """A fake mode in which toma's host-side index building runs: boolean selections of
    CPU tensors (``nonzero``) get a size of their own (an unbacked symbol) instead of an
    error. Reads of device data stay refused (:class:`ForeignTensors`)."""
    return FakeTensorMode(shape_env=ShapeEnv())


def fake(mode: FakeTensorMode, value, device: torch.device | None = DEVICE):
    """``value`` with its tensors as fake tensors on ``device`` (None: their own), made
    outside the mode (their conversion to meta must not be dispatched to it)."""
    if isinstance(value, torch.Tensor):
        return FakeTensor(mode, value.detach().to("meta"), value.device if device is None else device)
    if isinstance(value, dict):
        return {k: fake(mode, v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(fake(mode, v, device) for v in value)
    return value


def fake_model(mode: FakeTensorMode, model: torch.nn.Module) -> None:
    """``model`` as ``model.to(DEVICE)`` leaves it, on fake tensors, in place: parameters and
    buffers on ``DEVICE``, plain tensor attributes where they are (Qwen-Image's rotary
    frequencies stay on the CPU, and diffusers copies them to the device itself)."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(fake(mode, p), requires_grad=False)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = fake(mode, b)
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
                setattr(module, name, fake(mode, value, None))


def sequence_lengths(patch) -> tuple[list[dict[str, tuple[int, int]]], list]:
    """Per call and merged module: the length of the sequence it was called with, and the
    longest that any of its linear layers saw (each call appends a new dict)."""
    calls: list[dict[str, tuple[int, int]]] = []

    def called(name: str, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs["hidden_states"]
        calls[-1][name] = (x.shape[-2], 0)

    def seen(name: str, x: torch.Tensor) -> None:
        if x.ndim >= 2:  # a (B, C) input (a time embedding) counts B tokens, fewer than any image
            entered, longest = calls[-1][name]
            calls[-1][name] = (entered, max(longest, x.shape[-2]))

    handles = []
    for target in patch.patched:
        # a torch pre-hook runs before the diffusers hooks that merge: it sees the call's tokens
        handles.append(
            target.module.register_forward_pre_hook(
                lambda mod, a, kw, name=target.name: called(name, a, kw), with_kwargs=True
            )
        )
        handles += [
            m.register_forward_hook(lambda mod, a, o, name=target.name: seen(name, a[0]))
            for m in target.module.modules()
            if isinstance(m, torch.nn.Linear)
        ]
    return calls, handles


def fake_forwards(model, kw, patch_options, calls: int = 2):
    """Patch ``model``, make it and ``kw`` fake on ``DEVICE`` and run ``calls`` forwards
    under the checks. Returns the plans of the last call, the outputs, the copies to the
    device that toma's code made in each call and the :func:`sequence_lengths` of each."""
    mode = fake_mode()
    patch = toma.apply_toma(model, **patch_options)
    fake_model(mode, model)
    faked = fake(mode, kw)
    read_ids_on_host(model, kw, faked)
    lengths, handles = sequence_lengths(patch)
    outs, uploads = [], []
    try:
        with torch.no_grad(), mode:
            for _ in range(calls):
                lengths.append({})
                with ForeignTensors() as check:
                    outs.append(model(**faked, return_dict=False)[0])
                uploads.append(check.uploads)
    finally:
        for h in handles:
            h.remove()
    return [p for _, p in patch.cache._plans.values()], outs, uploads, lengths


@pytest.mark.parametrize("name", ON_FAKE_DEVICE)
def test_patched_forward_makes_no_tensor_off_the_input_device(name):
    model, kw, options = case(name)
    plans, outs, uploads, lengths = fake_forwards(model, kw, options)
    # the shapes against unpatched: test_host_sync.py
    assert all(out.device == DEVICE and out.shape == outs[0].shape for out in outs)
    # it merged: plans on the device, and no linear layer of a merged module saw as many
    # tokens as the module was called with (text and reference tokens pass whole, but they
    # are fewer than the image's merged away)
    assert plans and all(p.dest.device == DEVICE and p.num_merged < p.layout.num_tokens for p in plans)
    for call in lengths:
        assert call and all(0 < longest < entered for entered, longest in call.values()), call
    # the first call builds the index tensors toma keeps (a padded grid's on the host, then
    # copied to the device); the second copies nothing but the rotary tables a model makes
    # on the host at every forward (it copies them to the device at every attention call)
    assert uploads[1] == HOST_TABLES.get(name, 0), uploads


# ------------------------------------------------------------------ the checks catch
@pytest.mark.parametrize("op", ["index_select", "gather", "advanced indexing", "matmul", "where"])
def test_the_checks_refuse_a_cpu_tensor_in_a_device_op(op):
    mode = fake_mode()
    x = fake(mode, torch.randn(4, 3))
    run = {  # each op with its second tensor made on ``device`` (None: no device=, the CPU)
        "index_select": lambda device: x.index_select(0, torch.tensor([0, 2], device=device)),
        "gather": lambda device: x.gather(0, torch.zeros(2, 3, dtype=torch.long, device=device)),
        "advanced indexing": lambda device: x[
            torch.tensor([0, 2], device=device)
        ],  # CUDA takes a host index, copying it
        "matmul": lambda device: x @ torch.ones(3, 2, device=device),
        "where": lambda device: torch.where(torch.ones(4, 3, dtype=torch.bool, device=device), x, 0.0),
    }[op]
    with mode:
        with pytest.raises(ForeignError, match="mixes a CPU tensor"), ForeignTensors():
            run(None)
        with ForeignTensors():  # the same op on the device passes, and so does a 0-dim CPU tensor (a scalar)
            assert run(DEVICE).device == DEVICE and (x * torch.tensor(2.0)).device == DEVICE


def test_the_fake_mode_alone_refuses_what_cuda_refuses():
    # the layer below ForeignTensors: FakeTensorMode's own device check
    mode = fake_mode()
    x = fake(mode, torch.randn(4, 3))
    with mode, pytest.raises(FakeTensorDeviceMismatchError):
        x.index_select(0, torch.tensor([0, 2]))


def _on_host(real, device_at: int):
    """``real`` made on the CPU whatever device its positional argument ``device_at`` asks
    for: a tensor made without ``device=``."""

    def on_host(*args):
        return real(*args[:device_at], "cpu", *args[device_at + 1 :])

    return on_host


@pytest.mark.parametrize("where", ["rotary rows", "layout index", "destinations"])
def test_a_host_index_in_the_merge_path_is_caught(monkeypatch, where):
    # toma with one index tensor deliberately made on the host: the check must fail there
    from toma.adapters import engine
    from toma.adapters import state as state_module
    from toma.core import plan as plan_module

    if where == "rotary rows":  # Flux's rotary tables in tile order: index_select
        monkeypatch.setattr(engine, "rotary_rows", _on_host(engine.rotary_rows, 2))
        name = "flux-tiled"
    elif where == "layout index":  # a padded grid's gathers into tiles: index_select
        monkeypatch.setattr(state_module, "layout_index", _on_host(state_module.layout_index, 1))
        name = "sd15-padded"
    else:  # each sample's rotary rows: advanced indexing, which CUDA would take (with a copy)
        real = plan_module.Plan._slot_dest
        monkeypatch.setattr(plan_module.Plan, "_slot_dest", lambda self: real(self).cpu())
        name = "flux-tiled"
    with pytest.raises(ForeignError, match="mixes a CPU tensor"):
        fake_forwards(*case(name))


def test_a_copy_to_the_device_at_every_call_is_counted(monkeypatch):
    from toma.core import plan as plan_module

    real = plan_module.Plan._slot_dest
    # the destinations' index made on the host and copied, at every plan: toma's copy (a
    # test's lambda is skipped, and the plan's memo in toma calls it)
    monkeypatch.setattr(plan_module.Plan, "_slot_dest", lambda self: real(self).cpu().to(self.dest.device))
    _, _, uploads, _ = fake_forwards(*case("flux-tiled"))
    assert uploads[1] > 0, uploads


# ------------------------------------------------------------------ toma.core on its own
@pytest.mark.parametrize("selection", ["facility", "grid", "random"])
@pytest.mark.parametrize("temperature", [1e-3, 0.0])  # soft, and hard (one_hot)
@pytest.mark.parametrize("share", [False, True])
def test_plans_merges_and_unmerges_stay_on_the_device(monkeypatch, selection, temperature, share):
    from toma.config import ToMAConfig
    from toma.adapters.state import PlanCache

    # a fake device has no random generator: random destinations then come from the global
    # one, drawn with device= (the path a generator-less caller takes)
    monkeypatch.setattr(PlanCache, "_random", lambda self, device: None)
    cache = PlanCache(ToMAConfig(ratio=0.5, selection=selection, temperature=temperature, share_batch_plan=share))
    mode = fake_mode()
    grids = {
        (1, 6, 10): fake(mode, torch.randn(2, 60, 8)),  # padded: tiles keeping 8, 4 and 2
        (1, 8, 8): fake(mode, torch.randn(2, 64, 8)),
    }  # the tiles divide it: tile order
    with torch.no_grad(), mode:
        for grid, x in grids.items():
            with ForeignTensors():
                cache.begin_forward(grid, None)
                tiled = cache.tile_order_layout(grid, x.device) is not None
                plan = cache.get(x, grid, "group", tiled=tiled)
                merged = plan.merge(x, tiled=tiled)
                outs = [
                    plan.unmerge(merged, tiled=tiled),
                    plan.unmerge(merged, tiled=tiled, residual=x),
                    plan.dest_tokens,
                    plan.dest_slots,
                    plan.log_mass,
                ]
            assert merged.shape == (2, plan.num_merged, 8) and plan.num_merged < 60
            assert all(t.device == DEVICE for t in (merged, plan.dest, plan.merge_w, plan.unmerge_w, plan.mass, *outs))
        assert tiled  # the second grid ran in tile order, the first did not


@pytest.mark.parametrize("selection", ["facility", "random", "grid"])
def test_a_later_plan_copies_nothing_to_the_device(monkeypatch, selection):
    from toma.config import ToMAConfig
    from toma.adapters.state import PlanCache

    monkeypatch.setattr(PlanCache, "_random", lambda self, device: None)  # as above
    cache = PlanCache(ToMAConfig(ratio=0.5, selection=selection))
    mode = fake_mode()
    x = fake(mode, torch.randn(2, 60, 8))  # padded: the layout's index tensors come from the host
    uploads = []
    with torch.no_grad(), mode:
        for _ in range(2):
            with ForeignTensors() as check:
                cache.begin_forward((1, 6, 10), None)  # a new step: plans are built again
                cache.get(x, (1, 6, 10), "group").merge(x)
            uploads.append(check.uploads)
    assert uploads[0] > 0 and uploads[1] == 0, uploads
