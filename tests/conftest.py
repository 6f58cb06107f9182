"""Shared fixtures; the tiny diffusers models themselves are in tiny_models.py."""

from __future__ import annotations

import os

# The Triton kernels (tests/core/test_kernels.py) run in Triton's interpreter here. Triton reads
# the switch as it loads, and diffusers loads it, so it must be set before that import.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import FluxTransformer2DModel, UNet2DConditionModel  # noqa: E402
from tiny_models import (  # noqa: E402,F401  (the makers, under the names the tests import)
    CROSS_DIM,
    flux_inputs,
    ltx_inputs,
    make_flux,
    make_ltx,
    make_pixart,
    make_sd3,
    make_sd15_unet,
    make_sdxl_unet,
    make_wan,
    pixart_inputs,
    sd3_inputs,
    unet_inputs,
    wan_inputs,
)

from toma.kernels import LAUNCH_OBSERVERS  # noqa: E402
from toma.kernels.aot import recorder  # noqa: E402

# Every Triton launch the tests make, by signature: tests/core/test_kernel_compile.py, which
# runs last, compiles each one for real GPU targets (the interpreter checks what a kernel
# computes, not whether it compiles).
from kernel_launches import LAUNCHES  # noqa: E402


LAUNCH_OBSERVERS.append(recorder(LAUNCHES))


def pytest_itemcollected(item):
    # the compat marks of every case collected, by file, for tests/tools/test_docs.py (which
    # reads them instead of collecting the matrix's files again in a subprocess); here, before
    # -k / -m deselect anything, a file's marks are all of its cases'
    from tests.compat_cells import COMPAT_MARKS
    from toma.tools.compat_collect import marks_of

    found = item.config.stash.setdefault(COMPAT_MARKS, {})
    found.setdefault(item.nodeid.split("::")[0], []).extend(marks_of([item]))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # the compile check reads what every other test launched
    items.sort(key=lambda item: item.get_closest_marker("after_all_launches") is not None)
    # CI runs the suite on its two cores (pytest-xdist, --dist loadgroup: .ci/run). A file's
    # tests stay on one worker, so its module fixtures (tiny models, the context-parallel
    # ranks, spawned once per world size) are built once; every test that imports ComfyUI
    # carries the group "comfyui", so ComfyUI is imported once. Before xdist's own hook,
    # which reads these marks.
    # The compile check is a group of its own: a one-test group, collected last, is the last
    # in xdist's queue (its biggest groups first, ties in collection order).
    for item in items:
        if item.get_closest_marker("after_all_launches") is not None:
            item.add_marker(pytest.mark.xdist_group("after_all_launches"))
        elif item.get_closest_marker("xdist_group") is None:
            path = item.nodeid.split("::")[0]
            group = "comfyui" if path.startswith("tests/comfyui/") else path
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    # (on xdist's controller) where the workers leave their Triton launches for the compile
    # check: see tests/kernel_launches.py
    from kernel_launches import launch_dir

    node.workerinput["toma_launch_dir"] = str(launch_dir(node.config))


def pytest_sessionfinish(session):
    # (on an xdist worker) this worker's Triton launches, for the compile check
    from kernel_launches import leave_launches

    leave_launches(session.config)


if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on two cores: the tiny models gain nothing from a second intra-op thread,
    # and two workers with two threads each stall on each other
    torch.set_num_threads(1)


@pytest.fixture
def sdxl_unet() -> UNet2DConditionModel:
    return make_sdxl_unet()


@pytest.fixture
def sd15_unet() -> UNet2DConditionModel:
    return make_sd15_unet()


@pytest.fixture
def flux() -> FluxTransformer2DModel:
    return make_flux()


@pytest.fixture
def tile_orders(monkeypatch) -> list:
    """The shapes of the tensors put in tile order while the test runs, by the token
    orders' reorder points and the engine's rotary row order (real reordering still)."""
    import toma.adapters.engine as engine
    import toma.adapters.state as state

    calls: list = []
    real = state.tile_order

    def counted(x, layout):
        calls.append(x.shape)
        return real(x, layout)

    for module in (state, engine):
        monkeypatch.setattr(module, "tile_order", counted)
    return calls


@pytest.fixture(autouse=True)
def _attention_backend_restored():
    """diffusers' ``set_attention_backend`` also sets a process-wide active backend, which
    ``reset_attention_backend`` leaves set: restored after every test, so that no test runs
    on the backend an earlier one chose."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry._active_backend = active


@pytest.fixture
def one_thread():
    """One torch thread for the test, then the previous count back.

    The tiny models gain nothing from more threads, and the CLI under test sets the count
    itself; restoring it keeps the rest of the suite unaffected.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
