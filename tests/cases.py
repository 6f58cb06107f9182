"""Cases and checks several test modules share: the merge-path cases of every family that
tests/test_device_placement.py and tests/test_host_sync.py run, and the tile-order check."""

from __future__ import annotations

import torch

import toma
from tests.tiny_models import (
    FAMILIES,
    cogvideox_inputs,
    flux2_inputs,
    flux_inputs,
    hunyuan_inputs,
    kontext_inputs,
    ltx_inputs,
    pixart_inputs,
    qwen_inputs,
    sd3_inputs,
    unet_inputs,
    wan_inputs,
)
from toma.adapters import flux as flux_adapter


def _qwen_edit(batch: int) -> dict:
    """A Qwen-Image-Edit call: the generated image's 8x8 tokens, then a reference's 2x4."""
    kw = qwen_inputs(batch, 8, 8)
    g = torch.Generator().manual_seed(7)
    return {**kw, "hidden_states": torch.cat([kw["hidden_states"], torch.randn(batch, 8, 16, generator=g)], dim=1),
            "img_shapes": [[(1, 8, 8), (1, 2, 4)]] * batch}


def _flux2_references(batch: int) -> dict:
    """A FLUX.2 editing call: the generated image's 8x8 tokens, then a reference's 2x4 (t = 10)."""
    kw = flux2_inputs(batch, 8, 8)
    one = torch.arange(1)
    ref_ids = torch.cartesian_prod(torch.tensor([10]), torch.arange(2), torch.arange(4), one)
    g = torch.Generator().manual_seed(7)
    return {**kw, "hidden_states": torch.cat([kw["hidden_states"], torch.randn(batch, 8, 16, generator=g)], dim=1),
            "img_ids": torch.cat([kw["img_ids"], ref_ids[None].expand(batch, -1, -1)], dim=1)}


PADDED = {"share_batch_plan": True}  # with one plan for the batch: its broadcasts and expansions
PADDED_VIDEO = {**PADDED, "tile_frames": 2}  # 2-frame tiles over 3 frames pad in time too
# case -> (row of tests/tiny_models.py's table, the call's inputs, options beyond the row's).
# "tiled": the tiles divide the grid, so tokens run in tile order; "padded": they do not,
# so tokens stay in raster order and move through gathers, and tiles keep different counts
CASES = {
    "sdxl-tiled": ("sdxl", lambda: unet_inputs(2, 16, 16, True), {}),
    "sdxl-padded": ("sdxl", lambda: unet_inputs(2, 10, 14, True), PADDED),
    "sd15-tiled": ("sd15", lambda: unet_inputs(2, 16, 16, False), {"levels": 2}),
    "sd15-padded": ("sd15", lambda: unet_inputs(2, 10, 14, False), {"levels": 2, **PADDED}),
    "flux-tiled": ("flux", lambda: flux_inputs(2, 8, 8), {}),
    "flux-padded": ("flux", lambda: flux_inputs(2, 6, 10), PADDED),
    "flux-kontext-tiled": ("flux-kontext", lambda: kontext_inputs(2, 8, 8, 4, 4), {}),
    "flux-kontext-padded": ("flux-kontext", lambda: kontext_inputs(2, 6, 10, 2, 4), PADDED),
    "sd3-tiled": ("sd3", lambda: sd3_inputs(2, 16, 16), {}),
    "sd3-padded": ("sd3", lambda: sd3_inputs(2, 12, 20), PADDED),
    "pixart-tiled": ("pixart", lambda: pixart_inputs(2, 16, 16), {}),
    "pixart-padded": ("pixart", lambda: pixart_inputs(2, 12, 20), PADDED),
    "wan-tiled": ("wan", lambda: wan_inputs(2, 2, 16, 16), {}),
    "wan-padded": ("wan", lambda: wan_inputs(2, 3, 12, 20), PADDED_VIDEO),
    "ltx-tiled": ("ltx", lambda: ltx_inputs(2, 2, 8, 8), {}),
    "ltx-padded": ("ltx", lambda: ltx_inputs(2, 3, 6, 10), PADDED_VIDEO),
    "qwenimage-tiled": ("qwenimage", lambda: qwen_inputs(2, 8, 8), {}),
    "qwenimage-padded": ("qwenimage", lambda: qwen_inputs(2, 6, 10), PADDED),
    "qwenimage-edit": ("qwenimage", lambda: _qwen_edit(2), {}),
    "flux2-tiled": ("flux2", lambda: flux2_inputs(2, 8, 8), {}),
    "flux2-padded": ("flux2", lambda: flux2_inputs(2, 6, 10), PADDED),
    "flux2-references": ("flux2", lambda: _flux2_references(2), {}),
    "hunyuanvideo-tiled": ("hunyuanvideo", lambda: hunyuan_inputs(2, 2, 16, 16), {}),
    "hunyuanvideo-padded": ("hunyuanvideo", lambda: hunyuan_inputs(2, 3, 12, 20), PADDED_VIDEO),
    "cogvideox-tiled": ("cogvideox", lambda: cogvideox_inputs(2, 2, 16, 16), {}),
    "cogvideox-padded": ("cogvideox", lambda: cogvideox_inputs(2, 3, 12, 20), PADDED_VIDEO),
}
CROSS = ("sdxl", "sd15", "pixart", "wan", "ltx")  # the rows with a cross-attention whose queries merge


def case(name: str) -> tuple[torch.nn.Module, dict, dict]:
    """A case's model, call and ``apply_toma`` options: ratio 0.5 on every block, the MLP
    and cross-attention too, and proportional attention where the family takes it."""
    row, inputs, extra = CASES[name]
    fam = FAMILIES[row]
    options = {"ratio": 0.5, **fam.options, "merge_mlp": True, "merge_crossattn": row in CROSS,
               "proportional_attention": fam.proportional, **extra}
    return fam.make(), inputs(), options


def read_ids_on_host(model: torch.nn.Module, host: dict, device: dict) -> None:
    """Flux and FLUX.2 read their token grid from the image ids on the host, once per
    denoising run (tests/test_host_sync.py): the patched ``model``'s reader reads the
    ``host`` call's ids, as a run's first forward does, and then takes the ``device``
    call's ids (fake or meta, with no values to read) for the same ids, already read.
    Other families read nothing."""
    reader = getattr(model._diffusers_hook.get_hook("toma"), "grid", None)
    if isinstance(reader, flux_adapter.IdsGrid):
        grid = reader(model, host)
        assert not isinstance(grid, str), grid
        ids = device["img_ids"]
        reader._known = (ids, ids._version, reader._known[2])


def check_tile_order_matches_raster(model, kw, monkeypatch, forward, conversions) -> None:
    """A patched model's output with tokens kept in tile order between merges equals its
    output with every site merging from raster order (``forward(model, **kw)`` runs it;
    ``conversions`` is the ``tile_orders`` fixture's record)."""
    tiled = forward(model, **kw)
    converted = len(conversions)
    monkeypatch.setattr(toma.adapters.state.PlanCache, "tile_order_layout", lambda self, grid, device=None: None)
    raster = forward(model, **kw)
    assert converted >= 1 and len(conversions) == converted  # the raster run converted nothing
    torch.testing.assert_close(tiled, raster, rtol=1e-4, atol=1e-5)


def engine_family(name: str) -> tuple:
    """(model maker, one batch-2 call's inputs, the options that merge every block) of a
    family on the engine, from tests/tiny_models.py's table."""
    fam = FAMILIES[name]
    return fam.make, fam.inputs(2), fam.options
