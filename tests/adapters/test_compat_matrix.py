"""The cells of the compatibility matrix (toma/compat.py, docs/compatibility.md) that no
other test backs: the MLP, cross-attention and proportional attention of every family, on the
rows of tests/tiny_models.py's table, parametrized from the matrix.

Where a cell is ``✔``, the option merges what it names (a hooked module of that part, or the
key bias in force) and the output differs from the same merge without it. Where it is ``✖``,
the option is refused with the reason the cell shows, and the model is left unpatched.
"""

from __future__ import annotations

import pytest
import torch

import toma
from tests.compat_cells import cases, cell
from tests.tiny_models import FAMILIES
from toma import compat
from toma.adapters.engine import NO_BIAS

# a UNet's transformer block: its sub-modules by the part they merge
UNET_PARTS = {"attn1": "attn", "attn2": "cross", "ff": "mlp"}
OPTIONS = {"mlp": "merge_mlp", "cross": "merge_crossattn", "proportional": "proportional_attention"}


def parts(patch) -> set[str]:
    """The parts (``attn``, ``cross``, ``mlp``) of the modules a patch merges."""
    return {t.site.part if t.site is not None else UNET_PARTS[t.name.rsplit(".", 1)[-1]] for t in patch.patched}


@pytest.mark.parametrize("name", cases(*OPTIONS))
def test_each_option_merges_or_is_refused_as_the_matrix_says(name):
    fam = FAMILIES[name]
    model, kw = fam.make(), fam.inputs(1)
    plain = {**fam.options, **dict.fromkeys(OPTIONS.values(), False)}
    toma.apply_toma(model, ratio=0.5, **plain)
    off = fam.output(model, kw)
    toma.remove_toma(model)
    for feature, option in OPTIONS.items():
        wanted = cell(fam.adapter, feature)
        if wanted.status == compat.YES:
            patch = toma.apply_toma(model, ratio=0.5, **{**plain, option: True})
            on = fam.output(model, kw)
            toma.remove_toma(model)
            if feature == "proportional":
                # each merged key stands for about two tokens at ratio 0.5: its log mass
                # (about log 2) moves the softmax
                assert patch.config.proportional_attention is True
            else:
                assert feature in parts(patch), option
            assert torch.isfinite(on).all() and not torch.equal(on, off), option
        elif wanted.status == compat.NO:
            with pytest.raises(ValueError, match=option) as error:
                toma.apply_toma(model, ratio=0.5, **{**plain, option: True})
            message = str(error.value)
            if feature == "proportional":
                head, tail = NO_BIAS.split("{where}")
                assert message.startswith(head) and tail in message
            else:
                assert wanted.reason in message
            assert toma.get_toma(model) is None and not hasattr(model, "_diffusers_hook")


def test_the_tiny_tables_traits_are_the_matrix():
    # the table's conveniences (every_part's cross-attention, the proportional setting that
    # tests/cases.py uses) say what the matrix says
    for name, fam in FAMILIES.items():
        assert fam.cross == (cell(fam.adapter, "cross").status == compat.YES), name
        assert fam.proportional == (cell(fam.adapter, "proportional").status == compat.YES), name
