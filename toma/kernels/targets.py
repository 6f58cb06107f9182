"""GPU targets the kernels are compiled for ahead of time, and their per-block limits.

Torch-free and triton-free, so that the compile check, the release matrix
(``benchmarks/compile_matrix.py``) and ``toma doctor`` share one table.

``shared`` is the most shared memory one block may use, in bytes, with the opt-in
carve-out (what Triton checks a compiled kernel against): the CUDA programming guide's
per-compute-capability table and the LDS size of each AMD ISA.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """One GPU target: ``backend`` is ``"cuda"`` or ``"hip"``, ``arch`` the compute capability
    (``90``) or the ISA (``"gfx942"``), ``warp`` the threads of a warp or wavefront."""

    name: str
    backend: str
    arch: int | str
    warp: int
    shared: int
    example: str


KB = 1024

TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("sm_70", "cuda", 70, 32, 96 * KB, "V100"),
        Target("sm_75", "cuda", 75, 32, 64 * KB, "T4, RTX 20xx"),
        Target("sm_80", "cuda", 80, 32, 163 * KB, "A100"),
        Target("sm_86", "cuda", 86, 32, 99 * KB, "A10, RTX 30xx"),
        Target("sm_89", "cuda", 89, 32, 99 * KB, "L4, L40, RTX 40xx"),
        Target("sm_90", "cuda", 90, 32, 227 * KB, "H100, H200"),
        Target("sm_100", "cuda", 100, 32, 227 * KB, "B200"),
        Target("sm_120", "cuda", 120, 32, 99 * KB, "RTX 50xx"),
        Target("gfx90a", "hip", "gfx90a", 64, 64 * KB, "MI210, MI250"),
        Target("gfx942", "hip", "gfx942", 64, 64 * KB, "MI300"),
        Target("gfx1100", "hip", "gfx1100", 32, 64 * KB, "RX 7900 (wave32)"),
    )
}

# the targets CI compiles every test launch for (the full list runs before a release)
CI_TARGETS = ("sm_75", "sm_80", "sm_90", "gfx942")


def target(name: str) -> Target:
    """The :class:`Target` called ``name`` (``"sm_90"``, ``"gfx942"``...)."""
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown GPU target {name!r}; known: {', '.join(TARGETS)}") from None


def target_for(capability: tuple[int, int] | None = None, arch: str | None = None) -> Target | None:
    """The table's entry for a CUDA compute capability (major, minor) or an AMD ISA name
    (``gcnArchName``, e.g. ``"gfx942:sramecc+:xnack-"``), or None if it is not listed."""
    if arch:
        return TARGETS.get(arch.split(":")[0])
    if capability:
        return TARGETS.get(f"sm_{capability[0]}{capability[1]}")
    return None
