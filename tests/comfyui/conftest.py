"""ComfyUI, imported once per test run, and tiny ComfyUI models with seeded weights.

The vendored ComfyUI (``../shared/vendor/ComfyUI`` beside the checkout, or ``$TOMA_COMFYUI``)
is imported as its SOURCE.md says: CPU mode, stubs for torchvision and torchaudio (which
denoisers and samplers never call), and its writable folders in a temporary directory.
Without it the tests skip with one reason, except in CI (``CI`` set), where they fail.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiny_comfy import import_comfyui, stubs_off, stubs_on

REPO = Path(__file__).resolve().parents[2]


def comfyui_dir() -> Path:
    """Where the vendored ComfyUI is: ``$TOMA_COMFYUI``, else ``<repo>/../shared/vendor/ComfyUI``."""
    return Path(os.environ.get("TOMA_COMFYUI") or REPO.parent / "shared" / "vendor" / "ComfyUI")


@pytest.fixture(scope="session")
def comfy(tmp_path_factory):
    """The ComfyUI modules the tests use, imported once: ``comfy.*``, ``nodes``, ``folder_paths``."""
    root = comfyui_dir()
    if not (root / "comfy" / "model_patcher.py").is_file():
        reason = f"the vendored ComfyUI is not at {root} (set TOMA_COMFYUI to a ComfyUI 0.33.0 checkout)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the ComfyUI tests: {reason}")
        pytest.skip(reason)
    try:
        import comfy_aimdo  # noqa: F401
        import comfy_kitchen  # noqa: F401
        import einops  # noqa: F401
        import torchsde  # noqa: F401
    except ImportError as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the ComfyUI tests: a ComfyUI dependency is missing ({e})")
        pytest.skip(f"a ComfyUI dependency is missing ({e}); see the comfyui extra in pyproject.toml")
    return import_comfyui(root, tmp_path_factory.mktemp("comfyui_base"))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread while these tests run: the tiny models' ops are too small to
    share, and on a busy machine two threads stall on each other (a tiny UNet's sampling
    took 25 s instead of 0.5 s)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def torchvision_stubs():
    """The torchvision and torchaudio stand-ins ComfyUI imports with, only while these
    tests run: later tests must find no torchvision, as without ComfyUI."""
    stubs_on()
    yield
    stubs_off()
