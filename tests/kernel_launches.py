"""Every Triton launch the tests make, by signature (filled by tests/conftest.py's observer):
tests/core/test_kernel_compile.py, which runs last, compiles each one for real GPU targets.
A module of its own, not conftest's, because tests/comfyui has a conftest too and either
may be the module named ``conftest``."""

LAUNCHES: dict[str, dict] = {}
