"""The merge path never reads device data on the host (on a GPU, a synchronisation).

PyTorch's ``meta`` device has shapes but no data, so any read (``.item()``, ``nonzero``,
``tolist``, a data-dependent branch) fails there: running a patched forward on ``meta``
proves it launches everything without waiting for the device.

Copies from the host to the device are counted in tests/adapters/test_device_placement.py: meta
cannot see them (``torch.tensor(data, device="meta")`` copies nothing, and dispatches
nothing).
"""

from __future__ import annotations

import pytest
import torch

import toma
from tests.tiny_models import flux_inputs, make_flux, make_sd15_unet, make_sdxl_unet, unet_inputs
from tests.cases import CASES, case, read_ids_on_host


def on_meta(value):
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, dict):
        return {k: on_meta(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):  # CogVideoX's rotary tables; Qwen-Image's img_shapes hold ints
        return type(value)(on_meta(v) for v in value)
    return value


@pytest.mark.parametrize(
    "maker,sdxl,h,w",
    [(make_sdxl_unet, True, 16, 16), (make_sd15_unet, False, 10, 14)],  # 10x14: padded tiles
)
@pytest.mark.parametrize("proportional", [True, False])
def test_unet_forward_reads_no_device_data(maker, sdxl, h, w, proportional):
    unet = maker().to("meta")
    # every attention level: the tiny SDXL has one, the tiny SD 1.5 two
    levels = 1 if sdxl else 2
    toma.apply_toma(unet, ratio=0.5, levels=levels, merge_mlp=True, proportional_attention=proportional)
    kw = on_meta(unet_inputs(2, h, w, sdxl))
    with torch.no_grad():
        for t in (900, 800):
            out = unet(**{**kw, "timestep": torch.tensor(t, device="meta")}).sample
    assert out.shape == (2, 4, h, w) and out.device.type == "meta"


def test_meta_run_does_read_when_plans_outlive_a_step():
    # the control: keeping plans across steps needs the timestep on the host, and meta says so
    unet = make_sd15_unet().to("meta")
    toma.apply_toma(unet, ratio=0.5, recompute_every=2)
    with torch.no_grad(), pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        unet(**on_meta(unet_inputs(1, 16, 16, False)))


def test_flux_reads_its_image_ids_once_per_run(monkeypatch):
    from toma.adapters import grids

    reads = []
    real = grids.ids_grid
    monkeypatch.setattr(grids, "ids_grid", lambda ids: reads.append(ids) or real(ids))
    model = make_flux()
    toma.apply_toma(model, ratio=0.5, flux_double_blocks=(0, 1), flux_single_blocks=(0, 1))
    kw = flux_inputs(1, 8, 8)
    with torch.no_grad():
        for t in (0.9, 0.8, 0.7):  # a pipeline passes the same ids tensor at every step
            model(**{**kw, "timestep": torch.full((1,), t)})
        assert len(reads) == 1
        kw["img_ids"].add_(0)  # changed in place: read again
        model(**kw)
        assert len(reads) == 2
        model(**{**kw, "img_ids": kw["img_ids"].clone()})  # another tensor: read again
        assert len(reads) == 3


def test_flux_forward_after_the_ids_read_reads_no_device_data():
    model = make_flux()
    toma.apply_toma(model, ratio=0.5, flux_double_blocks=(0, 1), flux_single_blocks=(0, 1), proportional_attention=True)
    kw = flux_inputs(2, 8, 8)
    with torch.no_grad():
        model(**kw)  # reads the grid from the ids, on the CPU
        model.to("meta")
        meta = on_meta(kw)
        # the step hook recognises ids by identity: hand it the meta ids as already read
        reader = model._diffusers_hook.get_hook("toma").grid
        reader._known = (meta["img_ids"], meta["img_ids"]._version, reader._known[2])
        out = model(**meta).sample
    assert out.shape == (2, 64, 16) and out.device.type == "meta"


# every transformer family, in tile order and on padded grids (raster order, one plan for the
# batch), every block merged, the MLP and cross-attention too where the family has them, and
# proportional attention where its processor takes a mask (tests/adapters/test_device_placement.py)
DITS = [name for name, (row, *_) in CASES.items() if row not in ("sdxl", "sd15")]  # the UNets: above


@pytest.mark.parametrize("name", DITS)
def test_transformer_forward_reads_no_device_data(name):
    model, kw, options = case(name)
    model = model.to("meta")
    meta = on_meta(kw)
    with torch.no_grad():  # diffusers' own forward reads nothing either
        ref = model(**meta, return_dict=False)[0]
    patch = toma.apply_toma(model, **options)
    # Flux and FLUX.2 read their grid from the image ids on the host once per denoising run
    # (test_flux_reads_its_image_ids_once_per_run); the others read it from shapes and
    # Python values (Qwen-Image's img_shapes)
    read_ids_on_host(model, kw, meta)
    with torch.no_grad():
        for t in (0.9, 0.8):  # two steps: plans are rebuilt at each, without reading the timestep
            out = model(**{**meta, "timestep": torch.full_like(meta["timestep"], t)}, return_dict=False)[0]
    assert out.shape == ref.shape and out.device.type == "meta"
    plans = [p for _, p in patch.cache._plans.values()]
    assert plans and all(p.dest.device.type == "meta" and p.num_merged < p.layout.num_tokens for p in plans)


@pytest.mark.parametrize("name", ["flux-tiled", "flux2-tiled", "flux-kontext-tiled"])
def test_ids_families_read_the_ids_of_a_new_run(name):
    # the control for the families above that read: ids not read yet on the host are read
    # at the call, and meta has no values to give
    model, kw, options = case(name)
    toma.apply_toma(model.to("meta"), **options)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="meta"):
        model(**on_meta(kw))
