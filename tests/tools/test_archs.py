"""The bench's arch families: one module each, pinned to the adapters' families."""

from __future__ import annotations

from pathlib import Path

from toma.adapters import FAMILIES
from toma.tools import archs

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
        assert callable(module.inputs), family
        # every transformer family states the config keys --depth divides; the UNets have none
        assert (family in archs.DEPTH_KEYS) == (family != "unet"), family
        if family != "unet":
            assert archs.DEPTH_KEYS[family] == module.DEPTH_KEYS
