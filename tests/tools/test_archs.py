"""The bench's arch families: one module each, found by the package, pinned to the adapters' families."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from toma.adapters import FAMILIES
from toma.tools import archs
from toma.tools.archs import families as families_package

# adapter families the bench has no arch for yet: a family added to the adapters either
# gets an arch module or joins this list, on purpose
WITHOUT_ARCH = {"framepack", "hunyuanimage", "joyimage", "longcat-image", "skyreels-v2", "wan-animate"}


def test_arch_families_are_the_adapters_families_each_in_its_module():
    families = {arch.family for arch in archs.ARCHS.values()}
    assert families == set(archs.FAMILY_MODULES)
    assert families - {"unet"} == set(FAMILIES) - WITHOUT_ARCH
    package = Path(archs.__file__).parent / "families"
    on_disk = {path.stem for path in package.glob("*.py")} - {"__init__"}
    assert on_disk == {module.__name__.rpartition(".")[2] for module in archs.FAMILY_MODULES.values()}
    for family, module in archs.FAMILY_MODULES.items():
        assert module.__name__ == f"toma.tools.archs.families.{family.replace('-', '_')}"
        assert module.FAMILY == family and callable(module.inputs), family
        # each arch is stated once, in its family's module, and the table is theirs in module order
        assert all(archs.ARCHS[arch.name] is arch for arch in module.ARCHS), family
        # every transformer family states the config keys --depth divides; the UNets have none
        assert (family in archs.DEPTH_KEYS) == (family != "unet"), family
        if family != "unet":
            assert archs.DEPTH_KEYS[family] == module.DEPTH_KEYS
    assert list(archs.ARCHS) == [arch.name for module in archs.FAMILY_MODULES.values() for arch in module.ARCHS]
    assert list(archs.FAMILY_MODULES) == sorted(archs.FAMILY_MODULES, key=lambda family: family.replace("-", "_"))


NEW_FAMILY = """
from toma.tools.archs.arch import Arch, Call

FAMILY = "newfam"
TINY = {"num_layers": 6, "extra_layers": [0, 1, 2, 3, 4, 5]}
DEPTH_KEYS = ("num_layers",)
TIMESTEP_KEY = "noise_level"


def inputs(c: Call):
    return {"hidden_states": c.rand(c.batch, c.channels, c.lh, c.lw), "noise_level": c.timestep, "text": c.text}


def reduce(full, reduced, depth):
    return {**reduced, "extra_layers": full["extra_layers"][: reduced["num_layers"]]}


def timestep_at(frac):
    return 0.5 * frac


def call(model, inputs):
    return model(inputs["hidden_states"], **{k: v for k, v in inputs.items() if k != "hidden_states"})


ARCHS = (Arch("tiny-newfam", FAMILY, {**TINY, "in_channels": 3}, 64, 4, 8, 0, 8, "a family added as one module"),)
"""


@pytest.fixture
def dropped_in(tmp_path, monkeypatch):
    """The families package with modules written into a second folder of it: ``write(name,
    text)`` drops one in; what they import leaves sys.modules afterwards."""
    monkeypatch.setattr(families_package, "__path__", [*families_package.__path__, str(tmp_path)])
    dropped = []

    def write(name: str, text: str) -> None:
        (tmp_path / f"{name}.py").write_text(text)
        dropped.append(f"{archs.FAMILIES_PACKAGE}.{name}")
        importlib.invalidate_caches()

    yield write
    for name in dropped:
        sys.modules.pop(name, None)


def test_a_family_module_dropped_into_the_package_is_found_and_dispatched_to(dropped_in, monkeypatch):
    # adding a family is adding its module: the package finds its archs and calls its inputs
    # and its quirks (reduce, timestep, call) with no line of toma/tools/archs/__init__.py changed
    import torch

    dropped_in("newfam", NEW_FAMILY)
    modules, found = archs.discover()
    assert [name for name in found if name != "tiny-newfam"] == list(archs.ARCHS)
    assert list(modules) == sorted(modules)  # newfam among the others, in module-name order
    assert all(found[name] is arch for name, arch in archs.ARCHS.items())
    assert modules["newfam"].__name__ == f"{archs.FAMILIES_PACKAGE}.newfam"
    monkeypatch.setattr(archs, "FAMILY_MODULES", modules)
    monkeypatch.setattr(archs, "ARCHS", found)
    monkeypatch.setattr(archs, "DEPTH_KEYS", archs.depth_keys(modules))
    arch = archs.get_arch("tiny-newfam")
    assert archs.reduced_config("newfam", arch.config, 3) == {"num_layers": 2, "extra_layers": [0, 1], "in_channels": 3}
    kw = archs.make_inputs(arch, 64, batch=2)
    assert kw["hidden_states"].shape == (2, 3, 8, 8) and kw["text"].shape == (2, 4, 8)
    stepped = archs.set_timestep(arch, kw, 1, 4)
    assert stepped["noise_level"].tolist() == [0.375, 0.375] and kw["noise_level"].tolist() == [999.0, 999.0]
    seen = archs.call_denoiser(arch, lambda sample, **rest: (sample.shape, sorted(rest)), stepped)
    assert seen == (torch.Size([2, 3, 8, 8]), ["noise_level", "text"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("FAMILY = 'flux'\nARCHS = ()\ninputs = print\n", "family 'flux' is stated by both"),
        ("FAMILY = 'newfam'\nARCHS = ()\n", "must define inputs"),
        (NEW_FAMILY.replace('"tiny-newfam", FAMILY', '"tiny-newfam", "wan"'), "must have family 'newfam'; got 'wan'"),
        (
            NEW_FAMILY.replace('"tiny-newfam"', '"tiny-flux"'),
            "arch name 'tiny-flux' of toma.tools.archs.families.newfam is taken",
        ),
    ],
    ids=["family-twice", "no-inputs", "arch-of-another-family", "arch-name-twice"],
)
def test_discovery_refuses_a_family_module_that_contradicts_the_others(dropped_in, text, message):
    dropped_in("newfam", text)
    with pytest.raises(ValueError, match=message):
        archs.discover()


def test_a_private_module_of_the_families_package_is_no_family(dropped_in):
    # shared helpers of several families may live beside them as _name modules
    dropped_in("_shared", "HELPER = 1\n")
    modules, found = archs.discover()
    assert modules == archs.FAMILY_MODULES and found == archs.ARCHS
