"""The ``toma`` command as users meet it: help texts and what the commands print."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from toma.tools.cli import build_parser

ROOT = Path(__file__).parents[2]


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_option_states_its_default_once():
    subs = subcommand_parsers()
    assert set(subs) == {"bench", "eval", "generate", "tune", "doctor"}
    for name, sub in subs.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.help or not action.option_strings:
                continue
            text = formatter._expand_help(action)
            where = f"toma {name} {action.option_strings[-1]}: {text!r}"
            assert text.count("(default") <= 1 and "(default: None)" not in text, where
            if action.default not in (None, False, argparse.SUPPRESS) and action.nargs != 0:
                assert "default" in text, where  # a value the user cannot see otherwise
        # and in the text argparse prints, wrapped lines joined
        printed = " ".join(sub.format_help().split())
        assert "(default: None)" not in printed, name


def test_bench_output_has_no_profiler_or_float32_noise(tmp_path):
    # Kineto writes its "USDT: ... profiler_start" lines to file descriptor 2 and diffusers
    # logs "should be kept in float32: []" at a dtype cast: only a child process sees both
    cmd = [
        sys.executable,
        "-m",
        "toma",
        "bench",
        "--arch",
        "tiny-unet",
        "--ratios",
        "0.5",
        "--methods",
        "none,toma",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--no-progress",
        "--threads",
        "1",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout + proc.stderr
    assert "overhead" in text and "toma" in text  # the profiled pass ran
    assert "USDT" not in text and "profiler_start" not in text and "kept in float32" not in text, text[:2000]


def test_kineto_filter_passes_other_stderr_text(capfd):
    from toma.tools.bench.harness import _kineto_lines_dropped

    with _kineto_lines_dropped():
        os.write(2, b"USDT:2026-01-01 10:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real warning\n")
    err = capfd.readouterr().err
    assert err == "a real warning\n"
