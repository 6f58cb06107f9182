"""What a newcomer's command-line mistakes get: a short error with the near names, caught
before anything loads, and no option accepted that would do nothing.

All run in-process and stop at argument checking: no model is loaded.
"""

from __future__ import annotations

import pytest

from toma.tools.cli import main


def run(capsys, *argv: str) -> tuple[int, str]:
    """Exit status and stderr of ``toma argv``; argparse's errors exit by SystemExit."""
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def test_an_unknown_arch_names_the_near_ones_in_two_lines(capsys):
    code, err = run(capsys, "bench", "--arch", "sdx")
    assert code == 2
    assert "did you mean sdxl?" in err and "toma bench --help" in err
    assert len(err.strip().splitlines()) == 2  # not argparse's usage of every option


def test_an_unknown_command_names_the_near_one(capsys):
    code, err = run(capsys, "gen")
    assert code == 2 and "did you mean generate?" in err


def test_a_mistyped_option_names_the_near_ones(capsys):
    code, err = run(capsys, "generate", "--ratoi", "0.5")
    assert code == 2
    assert "unrecognized arguments: --ratoi 0.5; did you mean --ratio" in err


def test_a_missing_folder_is_not_answered_with_download_advice(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run(capsys, "generate", "--model", "./no_such_dir", "--out", "x.png")
    assert code == 2
    assert "--model './no_such_dir': no such folder" in err and "hf download" not in err


@pytest.mark.parametrize(
    "model, near", [("sdxl", "stabilityai/stable-diffusion-xl-base-1.0"), ("builtin-dti", "builtin-dit")]
)
def test_a_bare_model_name_gets_the_near_names(capsys, tmp_path, model, near):
    code, err = run(capsys, "generate", "--model", model, "--out", str(tmp_path / "x.png"))
    assert code == 2
    assert f"did you mean {near}" in err and "hf download" not in err


def test_a_missing_prompts_file_fails_before_loading_and_makes_no_folder(capsys, tmp_path):
    out = tmp_path / "eval"
    argv = ["eval", "--model", "owner/model", "--prompts", str(tmp_path / "no.txt"), "--out-dir", str(out)]
    code, err = run(capsys, *argv)
    assert code == 2 and "--prompts file" in err and "does not exist" in err
    assert not out.exists()


def test_prompts_on_the_builtin_model_are_refused(capsys, tmp_path):
    (tmp_path / "p.txt").write_text("a fox\n")
    code, err = run(capsys, "eval", "--prompts", str(tmp_path / "p.txt"), "--out-dir", str(tmp_path / "o"))
    assert code == 2 and "--prompts applies to --model pipelines" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "a fox"], "--prompt applies to --model pipelines"),
        (["--model", "owner/model", "--labels", "3"], "--labels applies to the built-in models"),
    ],
)
def test_options_the_model_would_ignore_are_refused(capsys, tmp_path, argv, message):
    code, err = run(capsys, "generate", *argv, "--out", str(tmp_path / "x.png"))
    assert code == 2 and message in err


def test_generate_says_the_machines_load_beside_its_speedup(capsys, tmp_path, monkeypatch, one_thread):
    import os

    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 8.0, 7.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert main(["generate", "--labels", "1", "--steps", "1", "--out", str(tmp_path / "x.png")]) == 0
    out = capsys.readouterr().out
    assert "speedup" in out
    assert "load average 9.00 (1 minute) on 2 CPUs, more than the CPUs" in out and "torch threads 1" in out
