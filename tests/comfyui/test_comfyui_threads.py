"""ComfyUI's multi-GPU CFG split and the node: each device's share of a batch runs in a thread
of its own, through the same patched clone, marked ``multigpu_thread_device`` in its
transformer options. The node's per-call state (plans, the armed key bias) is one per
patched clone, so those calls run unmerged, with the reason, and compute exactly what the
unpatched model does, however the threads interleave.

This machine has one device, so the split itself cannot run here: the threads and the mark
are what it adds, and each thread's call runs on its own latent size, so that state taken
from another thread's call would show as a wrong shape or a wrong output."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from tiny_comfy import FLUX_CONTEXT, FLUX_VEC, flux_patcher, unet_patcher

from toma.comfyui import hooks
from toma.comfyui.patch import patch_model

ROUNDS = 4


def _denoise(patcher, x, context, pooled, device=None) -> torch.Tensor:
    """One denoiser call as sampling makes it, marked as a share of a multi-GPU split when
    ``device`` is given."""
    options = {**patcher.model_options.get("transformer_options", {}), "wrappers": patcher.wrappers}
    sigma = torch.tensor([0.8])
    options["sigmas"] = sigma
    if device is not None:
        options[hooks.TO_MULTIGPU_DEVICE] = device
    extra = {} if pooled is None else {"y": pooled}
    with torch.no_grad():
        return patcher.model.apply_model(x, sigma, c_crossattn=context, transformer_options=options, **extra)


def _calls(family: str) -> list[tuple]:
    out = []
    for size, seed in ((8, 1), (12, 2)):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(1, 4, size, size + 2, generator=g)
        if family == "flux":
            out.append((x, torch.randn(1, 6, FLUX_CONTEXT, generator=g), torch.randn(1, FLUX_VEC, generator=g)))
        else:
            out.append((x, torch.randn(1, 5, 32, generator=g), None))
    return out


@pytest.mark.parametrize("family", ["flux", "unet"])
def test_shares_of_a_multi_gpu_split_run_unmerged_from_any_thread(comfy, family, caplog):
    if family == "flux":
        model, blocks = flux_patcher(comfy), "double:all single:all"
    else:
        model, blocks = unet_patcher(comfy, sdxl_like=False), ""
    patched = patch_model(model, 0.5, blocks=blocks)
    calls = _calls(family)
    plain = [_denoise(model, *call) for call in calls]
    # unmarked, the patched clone merges: the mark is what turns it off
    assert all(not torch.equal(_denoise(patched, *call), p) for call, p in zip(calls, plain))
    failures: list[str] = []
    start = threading.Barrier(len(calls))

    def work(i: int) -> None:
        start.wait()
        for r in range(ROUNDS):
            try:
                out = _denoise(patched, *calls[i], device=torch.device("cpu"))
            except Exception as e:  # noqa: BLE001 - reported below, with the round
                failures.append(f"thread {i}, round {r}: {type(e).__name__}: {e}")
                continue
            if not torch.equal(out, plain[i]):
                failures.append(f"thread {i}, round {r}: differs by {(out - plain[i]).abs().max():.3g}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
    with caplog.at_level(logging.WARNING, logger="toma.comfyui"):
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures[:5]
    assert "multi-GPU CFG split runs this model's calls from several threads" in caplog.text


def test_the_split_is_found_by_its_mark_in_the_vendored_comfyui(comfy):
    assert hooks.first_problem(hooks.MULTIGPU_NEEDS) is None
