"""The defaults on the two trained built-ins compute what benchmarks/builtin.md measured for them:
on their small grids ``tile_size="auto"`` is 2x2 and ``proportional_attention=None`` is
on (on CPU), so the figures of 2x2 tiles with the bias are the defaults' figures."""

from __future__ import annotations

import pytest
import torch

import toma
from toma.tools.builtin.dit import dit_available, load_dit, sample
from toma.tools.builtin.video import load_video_dit, sample_video, video_available


def _two(sampler, model, **options):
    toma.apply_toma(model.transformer, ratio=0.5, **options)
    try:
        return sampler(model, labels=[3, 7], seeds=0, steps=1, progress=False)
    finally:
        toma.remove_toma(model.transformer)


@pytest.mark.parametrize(
    "available, load, sampler",
    [(dit_available, load_dit, sample), (video_available, load_video_dit, sample_video)],
    ids=["dit", "video"],
)
def test_builtin_defaults_are_2x2_tiles_with_the_bias(available, load, sampler):
    if not available():
        pytest.skip("the built-in weights are not in this checkout")
    model = load()
    defaults = _two(sampler, model)
    measured = _two(sampler, model, tile_size=2, proportional_attention=True)
    assert torch.equal(defaults, measured)  # and not the old defaults (4x4, no bias): those differ
