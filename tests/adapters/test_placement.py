"""Placement options are taken by the families they apply to and refused by the others.

``levels``/``mlp_levels`` (UNets), ``blocks`` (transformers), ``flux_*_blocks`` (Flux.1) and
``tile_frames`` (video) each say where merging happens in one kind of model; anywhere
else they would do nothing, so ``apply_toma`` refuses them, in one message format,
before anything is patched. Each accepted case checks that the option changes what is
merged, so that an option taken and ignored fails too.
"""

from __future__ import annotations

import pytest

import toma
from tests.tiny_models import make_flux, make_sd3, make_sd15_unet, make_wan
from toma.adapters import PLACEMENT_OPTIONS

MAKERS = {"unet": make_sd15_unet, "flux": make_flux, "sd3": make_sd3, "wan": make_wan}

# option -> a value that changes what is merged on the families taking it
VALUES = {
    "levels": {"levels": 2},
    "mlp_levels": {"merge_mlp": True, "levels": 2, "mlp_levels": (2,)},
    "blocks": None,  # per family, below
    "flux_double_blocks": {"flux_double_blocks": (0,)},
    "flux_single_blocks": {"flux_single_blocks": (0,)},
    "tile_frames": {"tile_frames": 2},
}
BLOCKS = {
    "flux": {"transformer_blocks": [1]},
    "sd3": {"transformer_blocks": [0, 3]},
    "wan": {"blocks": [0]},
    "unet": {"transformer_blocks": [0]},
}
TAKES = {
    "unet": {"levels", "mlp_levels"},
    "flux": {"blocks", "flux_double_blocks", "flux_single_blocks"},
    "sd3": {"blocks"},
    "wan": {"blocks", "tile_frames"},
}
# the base settings each case is compared against (the option left at its default)
BASE = {"mlp_levels": {"merge_mlp": True, "levels": 2}}


def settings(option: str, family: str) -> dict:
    return {"blocks": BLOCKS[family]} if option == "blocks" else dict(VALUES[option])


def merged_and_tiles(model, **options) -> tuple[list[str], tuple]:
    patch = toma.apply_toma(model, ratio=0.5, **options)
    out = sorted(p.name for p in patch.patched), patch.cache.tile
    toma.remove_toma(model)
    return out


def test_every_placement_option_is_covered():
    assert set(VALUES) == set(PLACEMENT_OPTIONS)
    assert set().union(*TAKES.values()) == set(PLACEMENT_OPTIONS)


@pytest.mark.parametrize("family", list(MAKERS))
@pytest.mark.parametrize("option", list(VALUES))
def test_a_placement_option_works_where_it_applies_and_is_refused_elsewhere(family, option):
    model = MAKERS[family]()
    chosen = settings(option, family)
    if option in TAKES[family]:
        base = {k: v for k, v in BASE.get(option, {}).items()}
        assert merged_and_tiles(model, **chosen) != merged_and_tiles(model, **base), f"{option} did nothing on {family}"
        return
    owners = PLACEMENT_OPTIONS[option][1]
    with pytest.raises(ValueError, match=rf"^{option} applies to {owners} only; {family} places merging with "):
        toma.apply_toma(model, ratio=0.5, **chosen)
    assert toma.get_toma(model) is None and not hasattr(model, "_diffusers_hook")


def test_the_unset_values_are_accepted_everywhere():
    # tile_frames=1 is what image families and UNets do anyway; levels=1 is the default
    for family, make in MAKERS.items():
        model = make()
        toma.apply_toma(model, ratio=0.5, tile_frames=1, levels=1)
        assert toma.remove_toma(model)
