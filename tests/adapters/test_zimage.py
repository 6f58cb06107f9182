"""Z-Image's own cases: the calls whose unified sequence is irregular (image tokens padded
before the caption, captions of different padded lengths, images of different sizes) run
bitwise unmerged, with one warning that says why; the refiners never merge."""

from __future__ import annotations

import warnings

import pytest
import torch

import toma
from tests.tiny_models import FAMILIES, zimage_inputs

FAM = FAMILIES["zimage"]


def irregular(kind: str) -> dict:
    if kind == "padded image":  # 5x7 = 35 tokens, padded to 64 between the image and the caption
        return zimage_inputs(2, 10, 14)
    if kind == "captions":  # 5 and 40 caption tokens: padded to 32 and 64, then masked
        return zimage_inputs(2, 16, 16, longer=35)
    kw = zimage_inputs(2, 16, 16)
    return {**kw, "x": [kw["x"][0], torch.randn(16, 1, 16, 32)]}


@pytest.mark.parametrize(
    "kind, words",
    [("padded image", "multiple of 32"), ("captions", "padded lengths"), ("sizes", "different sizes")],
)
def test_irregular_sequences_run_unmerged_with_one_warning(kind, words):
    model, kw = FAM.make(), irregular(kind)
    ref = [t.clone() for t in model(**kw).sample] if kind == "sizes" else FAM.output(model, kw)
    patch = toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            outs = [model(**kw).sample for _ in range(2)]
    said = [str(w.message) for w in caught if "ToMA" in str(w.message)]
    assert len(said) == 1 and words in said[0], said
    assert not patch.cache._plans  # nothing merged
    for out in outs:
        if kind == "sizes":
            assert all(torch.equal(a, b) for a, b in zip(out, ref))
        else:
            assert torch.equal(torch.stack(out), ref)


def test_only_the_main_layers_merge():
    model = FAM.make()
    patch = toma.apply_toma(model, ratio=0.5, merge_mlp=True, blocks={"layers": range(2)})
    names = {t.name for t in patch.patched}
    assert names and all(name.startswith("layers.") for name in names)
    with pytest.raises(ValueError):  # the refiners are no stack of the family's
        toma.apply_toma(model, ratio=0.5, blocks={"noise_refiner": range(1)})
