"""JoyAI-Image-Edit beyond the conformance suite (its rows: ``joyimage``, ``joyimage-edit``
in tests/tiny_models.py): rotary tables made by a method, put in the blocks' order at every
block, merged or not, and the options it refuses."""

from __future__ import annotations

import pytest
import torch

import toma
from tests.cases import tiled_and_raster
from tests.tiny_models import joyimage_inputs, make_joyimage


@pytest.mark.parametrize("rope_type", ["rope", "mrope"])  # mrope: a text table too, which passes whole
@pytest.mark.parametrize("refs", [0, 1])
def test_unmerged_blocks_in_tile_order_keep_their_positions(refs, rope_type, monkeypatch):
    # blocks 0 and 1 run unmerged on tokens in tile order (reference tokens first), block 2
    # merged: each block must get tables in that order. Against raster order (the same
    # plans, tokens gathered at each merge), attention sums its keys in another order, a
    # few float32 ulps per op, under 1e-5 through this model; tables left in the model's
    # order moved outputs by ~5e-2
    model = make_joyimage(layers=3)
    model.register_to_config(rope_type=rope_type)
    model.rope_type = rope_type
    kw = joyimage_inputs(2, 16, 16, refs=refs)
    toma.apply_toma(model, ratio=0.5, blocks={"double_blocks": (2,)})
    tiled, raster = tiled_and_raster(model, kw, monkeypatch)
    torch.testing.assert_close(tiled, raster, rtol=1e-4, atol=1e-5)


def test_default_blocks_and_tiles_at_the_pipelines_resolution():
    # the published depth (20 blocks) on meta: the first 5 stay unmerged; at 1024px
    # (64 x 64 tokens, the family's reference) tile_size="auto" keeps 4x4 tiles
    with torch.device("meta"):
        model = make_joyimage(layers=20)
    patch = toma.apply_toma(model, ratio=0.5)
    merged = sorted({int(t.name.split(".")[1]) for t in patch.patched})
    assert merged == list(range(5, 20))
    assert patch.cache.tile_for((1, 64, 64))[1:] == (4, 4)


def test_proportional_attention_reaches_the_dispatch_the_processor_gives_no_mask():
    # the processor hands dispatch attn_mask=None: the key bias goes past it, and its
    # float-mask form matches the key channel's (tests/adapters/test_proportional_families.py
    # runs every form); without it the outputs differ by the bias's effect
    from tests.cases import force
    from toma.adapters import attention as A

    model, kw = make_joyimage(), joyimage_inputs(1, 8, 8, refs=1)
    outs = []
    for proportional in (True, False):
        toma.apply_toma(model, ratio=0.5, proportional_attention=proportional)
        with torch.no_grad():
            outs.append(model(**kw, return_dict=False)[0])
        toma.remove_toma(model)
    with pytest.MonkeyPatch.context() as m:
        force(m, A.KEY_CHANNEL)
        toma.apply_toma(model, ratio=0.5, proportional_attention=True)
        with torch.no_grad():
            channel = model(**kw, return_dict=False)[0]
        toma.remove_toma(model)
    scale = float(outs[0].abs().max())
    torch.testing.assert_close(channel, outs[0], rtol=0, atol=1e-5 * scale)
    assert (outs[0] - outs[1]).abs().max() > 1e-3 * scale
