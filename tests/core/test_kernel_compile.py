"""The Triton kernels compile for real GPUs, within each target's shared memory.

Triton's interpreter, which runs the kernels everywhere else in the tests, does not apply
the GPU compiler's rules (a kernel that reads a plain Python global computes the right
numbers there and compiles for no GPU). So every launch the other tests made (recorded in
conftest.py by signature) is compiled here ahead of time with Triton's own compiler, for
a T4 (sm_75), an A100 (sm_80), an H100 (sm_90) and an MI300 (gfx942), together with the
launches the default settings make at a real width (3072 channels, the three dtypes).
The compile runs in a subprocess: ``TRITON_INTERPRET`` must be unset there.
The full matrix of targets, dtypes and tile sizes is ``benchmarks/compile_matrix.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from kernel_launches import all_launches  # noqa: E402

from toma.kernels.targets import CI_TARGETS, TARGETS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def compile_launches(tmp_path: Path, records: list[dict], extra: list[str], timeout: float) -> tuple[int, str, list]:
    path, out = tmp_path / "launches.json", tmp_path / "results.json"
    path.write_text(json.dumps(records))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"  # the kernels set it themselves; this only quiets triton
    proc = subprocess.run(
        [sys.executable, "-m", "toma.kernels.aot", str(path), "--json", str(out), "--jobs", "2", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    results = json.loads(out.read_text()) if out.exists() else []
    return proc.returncode, proc.stdout + proc.stderr, results


@pytest.mark.after_all_launches
def test_every_launch_compiles_for_the_ci_targets_within_shared_memory(tmp_path, request):
    # under xdist, also the other workers' launches: they finish their last tests meanwhile
    records = all_launches(request.config, timeout=900)
    if len(records) < 10:
        # run alone: the launches of the kernel tests are missing, so the check would be thin
        pytest.skip("run with tests/core/test_kernels.py (the whole suite), whose launches this compiles")
    kernels = {r["kernel"] for r in records}
    assert kernels == {"plan", "merge", "unmerge"}, kernels
    rc, log, results = compile_launches(
        tmp_path, records, ["--targets", ",".join(CI_TARGETS), "--synthetic", "16:8", "--channels", "3072"], timeout=300
    )
    assert rc == 0, log[-4000:]
    assert {r["target"] for r in results} == set(CI_TARGETS)
    for r in results:
        # the limit is the table's, which the fit check also falls back on
        assert r["shared"] <= TARGETS[r["target"]].shared, r


def test_the_compile_check_catches_what_the_interpreter_runs(tmp_path):
    # the control: a kernel reading a plain float global (the bug the plan kernel had)
    # runs in the interpreter and fails to compile, and the check reports that as a failure
    import torch
    import triton

    from tests import kernel_controls

    x = torch.zeros(16)
    kernel_controls.plain_global_kernel[(1,)](x, BLOCK=16)
    assert torch.equal(x, torch.full((16,), 3.0))
    rec = {
        "kernel": "tests.kernel_controls:plain_global_kernel",
        "signature": {"x_ptr": "*fp32", "BLOCK": "constexpr"},
        "constexprs": {"BLOCK": 16},
        "attrs": {"x_ptr": "D"},
    }
    fixed = {**rec, "kernel": "tests.kernel_controls:constexpr_global_kernel"}
    rc, log, results = compile_launches(tmp_path, [rec, fixed], ["--targets", "sm_90"], timeout=120)
    assert rc == 1, log
    by_kernel = {r["launch"].split("[")[0]: r for r in results}
    assert "_THREE" in by_kernel["tests.kernel_controls:plain_global_kernel"]["error"]
    assert "error" not in by_kernel["tests.kernel_controls:constexpr_global_kernel"]
    assert triton.__version__  # the compile above used this triton's own compiler
