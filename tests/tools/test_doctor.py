"""``toma doctor``: the CLI on the CPU, its JSON report, the kernel checks in Triton's
interpreter, and what a wrong or failing kernel does to the verdict.

The runs are in-process at tiny sizes (8x8 tokens, 16-32 channels), with one or two
attention backends, so that the whole file takes seconds. Tests that make kernels fail
reset :data:`toma.kernels.HEALTH` before and after.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from toma import kernels
from toma.kernels import HEALTH, KERNELS_ENV
from toma.tools.cli import main

TINY = [
    "--device",
    "cpu",
    "--grid",
    "8",
    "--channels",
    "16",
    "--attn-grid",
    "8",
    "--heads",
    "2",
    "--head-dim",
    "8",
    "--repeats",
    "1",
]


def doctor(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``toma doctor`` with ``argv``."""
    try:
        code = main(["doctor", *argv])
    except SystemExit as exit_:  # argparse errors
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def verdict(out: str) -> str:
    return out.strip().splitlines()[-1]


@pytest.fixture
def clean_health():
    HEALTH.reset()
    yield
    HEALTH.reset()


class OffByOne:
    """A kernel that computes, then adds 1 to its output: wrong numbers, no error."""

    def __init__(self, kernel, out_arg: int):
        self.kernel, self.out_arg = kernel, out_arg

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kernel[grid](*args, **kwargs)
            args[self.out_arg].add_(1)

        return launch


class Broken:
    """A kernel whose every launch raises, as a compile or driver error would."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise RuntimeError("injected failure")

        return launch


def test_cpu_run_passes_says_the_gpu_checks_were_skipped_and_writes_the_report(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(KERNELS_ENV, "auto")
    path = tmp_path / "doctor.json"
    code, out, _ = doctor(capsys, *TINY, "--backends", "native,_native_flash,_native_cudnn", "--json", str(path))
    assert code == 0, out
    assert verdict(out).startswith("toma doctor: OK — ") and "GPU kernel checks skipped: no GPU" in verdict(out)
    kernel_line = next(
        line for line in out.splitlines() if line.strip().startswith("skip") and "Triton kernels" in line
    )
    assert "skipped: no GPU here" in kernel_line
    # what ran, and at which size, is in the output
    assert "8x8 tokens x 16 channels, batch 2" in out and "2 heads of 8" in out
    assert "torch: TOMA_KERNELS=auto runs the kernels on GPUs only" in out

    report = json.loads(path.read_text())
    assert report["verdict"] == {"ok": True, "exit_code": 0, "line": verdict(out)}
    assert report["options"]["grid"] == [8, 8] and report["options"]["json_path"] == str(path)
    assert report["versions"]["torch"] == torch.__version__ and report["versions"]["toma"]
    assert report["kernels"]["path"] == "torch" and report["kernels"]["interpreter"] is False
    assert report["sizes"]["merge"]["grid"] == [8, 8] and report["sizes"]["merge"]["dtypes"] == ["fp16", "bf16", "fp32"]
    by_name = {r["name"]: r for r in report["results"]}
    for dtype in ("fp16", "bf16", "fp32"):
        for check in ("plan on margin tokens", "plan weights", "merge", "unmerge", "unmerge + residual"):
            assert by_name[f"{dtype} {check}"]["status"] == "pass", by_name[f"{dtype} {check}"]
    assert by_name["fp32 merge"]["data"]["raster order"]["tolerance_used"] <= 1
    assert by_name["Triton kernels"]["status"] == "skip"
    attention = by_name["merged vs unmerged attention"]
    assert attention["status"] == "pass" and attention["data"]["merged_tokens"] == 32
    assert {"unmerged_s", "merged_s", "speedup", "relative_error"} <= set(attention["data"])
    # backends: native takes the bias as the float mask, flash SDPA (no mask) as the key
    # channel (toma/adapters/attention.py's rule), cuDNN does not run on the CPU at all
    assert by_name["native"]["status"] == "pass" and by_name["native + log-mass bias"]["status"] == "pass"
    assert by_name["native + log-mass bias"]["data"]["form"] == "mask"
    flash = by_name["_native_flash + log-mass bias"]
    assert flash["status"] == "pass" and flash["data"]["form"] == "key_channel", flash
    assert by_name["_native_cudnn"]["status"] == "skip" and "does not run on cpu" in by_name["_native_cudnn"]["detail"]
    assert report["counts"]["fail"] == 0 and report["counts"]["pass"] >= 18


def test_padded_grid_and_a_ratio_without_a_margin_design(capsys, monkeypatch):
    # 6x10 tokens: edge tiles of 8 and 4 real tokens keeping fewer; ratio 1/16 keeps 15 of
    # 16, which needs a cluster of two (two equally good centres): that check says so
    monkeypatch.setenv(KERNELS_ENV, "torch")
    code, out, _ = doctor(capsys, *TINY, "--grid", "6x10", "--dtypes", "fp32", "--backends", "none")
    assert code == 0, out
    assert "fp32 merge: raster order within bounds" in out  # padded: no tile order
    code, out, _ = doctor(capsys, *TINY, "--ratio", "0.0625", "--dtypes", "fp16", "--backends", "none")
    assert code == 0, out
    line = next(line for line in out.splitlines() if "plan on margin tokens" in line)
    assert line.strip().startswith("skip") and "cluster of 2" in line
    assert "skipped: TOMA_KERNELS=torch" in out


def test_kernel_checks_run_in_the_interpreter_and_pass(capsys, monkeypatch, tmp_path, clean_health):
    assert os.environ.get("TRITON_INTERPRET") == "1"  # conftest.py, before triton loaded
    monkeypatch.setenv(KERNELS_ENV, "triton")
    path = tmp_path / "doctor.json"
    code, out, _ = doctor(capsys, *TINY, "--backends", "native", "--json", str(path))
    assert code == 0, out
    report = json.loads(path.read_text())
    assert report["kernels"]["path"] == "triton" and report["kernels"]["interpreter"] is True
    kernel_results = {r["name"]: r for r in report["results"] if r["section"] == "Triton kernels"}
    for dtype in ("fp16", "fp32"):
        for check in (
            "plan kernel",
            "plan kernel on margin tokens",
            "merge kernel",
            "unmerge kernel",
            "unmerge kernel + residual",
        ):
            assert kernel_results[f"{dtype} {check}"]["status"] == "pass", kernel_results[f"{dtype} {check}"]
    # the plan kernel's destinations equal the torch greedy's on its own similarities, and
    # the designed ones on margin tokens
    assert kernel_results["fp32 plan kernel on margin tokens"]["data"]["wrong_tiles"] == 0
    # Triton 3.9's interpreter gets bf16 dots wrong: skipped, with the reason, not failed
    bf16 = kernel_results.get("bf16 kernels") or kernel_results["bf16 merge kernel"]
    assert bf16["status"] in ("skip", "pass")
    if bf16["status"] == "skip":
        assert "interpreter" in bf16["detail"] and "bf16 kernels skipped" in verdict(out)


def test_a_kernel_returning_wrong_numbers_fails_the_verdict(capsys, monkeypatch, clean_health):
    from toma.kernels import triton_ops

    monkeypatch.setenv(KERNELS_ENV, "triton")
    monkeypatch.setitem(triton_ops.KERNEL_FNS, "merge", OffByOne(triton_ops.KERNEL_FNS["merge"], out_arg=4))
    code, out, _ = doctor(capsys, *TINY, "--dtypes", "fp32", "--backends", "none")
    assert code == 1, out
    line = verdict(out)
    assert line.startswith("toma doctor: FAILED — Triton kernels / fp32 merge kernel: raster order: max |err| 1.00e+00")
    # the torch path's own checks still passed
    assert "  ok       fp32 merge: raster order and tile order within bounds" in out


def test_a_kernel_that_raises_falls_back_and_the_path_says_so(capsys, monkeypatch, tmp_path, clean_health):
    from toma.kernels import triton_ops

    # auto mode, as on a GPU, here through the interpreter
    monkeypatch.setenv(KERNELS_ENV, "auto")
    monkeypatch.setattr(kernels, "AUTO_DEVICE_TYPES", ("cpu",))
    monkeypatch.setitem(triton_ops.KERNEL_FNS, "unmerge", Broken())
    path = tmp_path / "doctor.json"
    code, out, _ = doctor(capsys, *TINY, "--dtypes", "fp32", "--backends", "none", "--json", str(path))
    assert code == 0, out
    report = json.loads(path.read_text())
    # the first use of the device tried each kernel: describe_path names the broken one
    assert report["kernels"]["path"] == "triton (partly)"
    assert "unmerge: RuntimeError: injected failure" in report["kernels"]["why"]
    assert "kernels:  triton (partly): turned off after an error: unmerge: RuntimeError: injected failure" in out
    by_name = {r["name"]: r for r in report["results"]}
    assert by_name["fp32 unmerge kernel"]["status"] == "fallback"
    assert (
        "takes the torch path: it failed (RuntimeError: injected failure)" in by_name["fp32 unmerge kernel"]["detail"]
    )
    assert by_name["fp32 merge kernel"]["status"] == "pass" and by_name["fp32 plan kernel"]["status"] == "pass"
    assert "fallback: the Triton unmerge kernel takes the torch path" in verdict(out)


def test_explicit_triton_mode_turns_a_raising_kernel_into_a_failed_check(capsys, monkeypatch, clean_health):
    from toma.kernels import triton_ops

    monkeypatch.setenv(KERNELS_ENV, "triton")
    monkeypatch.setitem(triton_ops.KERNEL_FNS, "plan", Broken())
    code, out, _ = doctor(capsys, *TINY, "--dtypes", "fp32", "--backends", "none")
    assert code == 1
    assert "fp32 plan kernel: error: RuntimeError: injected failure" in out
    assert verdict(out).startswith("toma doctor: FAILED — Triton kernels / fp32 plan kernel: error: RuntimeError")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--grid", "0"], "argument --grid: expected N or HxW with sides of at least 1"),
        (["--grid", "8x"], "argument --grid: expected N or HxW"),
        (["--channels", "-3"], "argument --channels: must be at least 1, got -3"),
        (["--ratio", "1"], "argument --ratio: must be in [0, 1), got 1"),
        (["--dtypes", "fp16,int8"], "argument --dtypes: expected one of fp16, bf16, fp32, got 'int8'"),
        (["--kernels", "cuda"], "argument --kernels: invalid choice: 'cuda'"),
        (["--device", "cuda"], "--device cuda: torch sees no GPU"),
        (["--device", "mps"], "--device: toma's GPU path runs on CUDA or ROCm devices"),
        (["--backends", "native,warp"], "--backends: unknown attention backend(s) warp"),
        (["--json", "/no/such/folder/r.json"], "--json: the folder /no/such/folder does not exist"),
    ],
)
def test_bad_arguments_are_refused_naming_the_parameter(capsys, argv, message):
    if argv[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out, err = doctor(capsys, *argv)
    assert code == 2 and message in err, (code, err)


def test_a_bad_kernels_setting_in_the_environment_is_refused(capsys, monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "cuda")
    code, _, err = doctor(capsys, *TINY)
    assert code == 2 and "TOMA_KERNELS must be one of auto, torch, triton; got 'cuda'" in err
    assert os.environ[KERNELS_ENV] == "cuda"  # the run puts back what it changed


def test_kernels_option_sets_the_mode_for_the_run_only(capsys, monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "auto")
    code, out, _ = doctor(capsys, *TINY, "--kernels", "torch", "--dtypes", "fp32", "--backends", "none")
    assert code == 0 and "kernels:  torch: TOMA_KERNELS=torch" in out
    assert os.environ[KERNELS_ENV] == "auto"


def test_gpu_device_lines_name_the_target_row_and_the_devices_own_limit(monkeypatch):
    from types import SimpleNamespace

    from toma.tools.doctor import environment as env

    def device(props, hip=None):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: props)
        monkeypatch.setattr(torch.version, "hip", hip)
        return env.format_device(env.device_info(torch.device("cuda", 0)))

    h100 = SimpleNamespace(
        name="NVIDIA H100 80GB HBM3",
        major=9,
        minor=0,
        total_memory=80 * 2**30,
        multi_processor_count=132,
        shared_memory_per_block_optin=232448,
    )
    assert device(h100) == [
        "cuda:0 NVIDIA H100 80GB HBM3 (compute capability 9.0, 80.0 GiB, 132 SMs)",
        "target:   sm_90 (H100, H200): 227 KB shared memory per block, warp 32; the device reports 227 KB",
    ]
    mi300 = SimpleNamespace(
        name="AMD Instinct MI300X",
        major=9,
        minor=4,
        gcnArchName="gfx942:sramecc+:xnack-",
        total_memory=192 * 2**30,
        multi_processor_count=304,
    )
    lines = device(mi300, hip="6.2")
    assert "gcnArchName gfx942:sramecc+:xnack-" in lines[0]
    assert lines[1].startswith("target:   gfx942 (MI300): 64 KB shared memory per block, warp 64")
    p100 = SimpleNamespace(
        name="Tesla P100",
        major=6,
        minor=0,
        total_memory=16 * 2**30,
        multi_processor_count=56,
        shared_memory_per_block_optin=49152,
    )
    assert "not in toma's GPU target table" in device(p100)[1]
    # a table row that disagrees with the device is pointed out
    odd = SimpleNamespace(**{**vars(h100), "shared_memory_per_block_optin": 101376})
    assert "the table says 232448 bytes, the device 101376" in device(odd)[2]
