"""``toma bench --host comfyui``: ComfyUI's own Flux, Wan, SDXL UNet and Z-Image timed unpatched, with the
ToMA node's patch and as the ideal, through the CLI, on tiny models; and its refusals.

The CLI finds the ComfyUI the session's ``comfy`` fixture imported (``sys.modules``). What
attention saw is read by a forward pre-hook on the first merged block's attention input, not
by toma's counters.
"""

from __future__ import annotations

import json
import sys

import pytest

from toma.tools.cli import main

# arch -> (resolution, image tokens the first merged attention sees unpatched); ratio 0.5 keeps
# half of them in every tile at these grids (Flux 8x8 tokens, Wan 2 frames of 4x4, the UNet's
# 8x8 at 1/2 of its 16x16 latent, Z-Image 6x6: 36, which its layers take padded to 64 behind
# the 8 caption tokens padded to 32, so that the bench must take both pads off)
TINY = {"tiny-flux": (128, 64), "tiny-wan": (64, 32), "tiny-unet": (128, 64), "tiny-zimage": (96, 36)}


def bench(tmp_path, arch: str, *extra: str) -> int:
    return main(
        [
            "bench",
            "--host",
            "comfyui",
            "--arch",
            arch,
            "--resolution",
            str(TINY[arch][0]),
            "--ratios",
            "0.5",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--no-progress",
            "--out",
            str(tmp_path),
            "--name",
            "b",
            *extra,
        ]
    )


@pytest.mark.parametrize("arch", sorted(TINY))
def test_bench_times_comfyuis_model_unpatched_with_the_node_and_as_the_ideal(comfy, tmp_path, capsys, arch):
    extra = ("--no-profile",)
    assert bench(tmp_path, arch, "--clock", "cpu", *extra) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["host"] == "comfyui" and report["comfyui_version"] == "0.33.0" and report["clock"] == "cpu"
    rows = {r["method"]: r for r in report["results"]}
    assert list(rows) == ["none", "toma", "ideal"]
    assert all(len(r["times_s"]) == 1 and r["times_s"][0] > 0 for r in rows.values())
    n = TINY[arch][1]
    k = n // 2
    none, toma, ideal = (rows[m]["settings"] for m in ("none", "toma", "ideal"))
    # the unpatched model's attention sees every token: the node's clones left it as it was
    assert none["attention_tokens"] == n
    # the node merged in every call it was given, N -> K, and attention saw K
    assert (toma["image_tokens"], toma["kept_tokens"], toma["attention_tokens"]) == (n, k, k)
    assert toma["merged_calls"] == toma["calls"] == 1
    # the ideal ran on the same K tokens: a cut latent (Flux) or zero-cost plans (Wan, UNet, Z-Image)
    assert ideal["attention_tokens"] == k
    if arch == "tiny-flux":
        assert ideal["image_tokens"] == k and "kept_tokens" not in ideal
    else:
        assert ideal["kept_tokens"] == k
    assert f"toma@0.5: attention saw {k} of" in out and "ideal" in out and "speedup" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--arch", "sd15"], "--host comfyui has no ComfyUI model for --arch sd15: it builds flux, sdxl"),
        (["--arch", "tiny-flux", "--compile"], "--compile does not apply to --host comfyui"),
        (["--arch", "tiny-unet", "--levels", "2"], "--blocks levels:1,2"),
        (["--arch", "tiny-flux", "--model", "x", "--share-batch-plan"], "--model, --share-batch-plan do not apply"),
        (["--arch", "tiny-flux", "--methods", "none,tomesd"], "--methods with --host comfyui must be drawn from"),
        (["--arch", "tiny-flux", "--frames", "5"], "--frames applies to video archs"),
        (["--arch", "tiny-flux", "--text-tokens", "0"], "--text-tokens must be >= 1"),
        (["--arch", "tiny-flux", "--resolution", "100"], "--resolution must be a multiple of 16"),
    ],
)
def test_bench_refuses_what_comfyuis_models_cannot_take(comfy, tmp_path, capsys, argv, message):
    assert main(["bench", "--host", "comfyui", "--out", str(tmp_path), "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


def test_comfyui_options_on_the_diffusers_host_are_refused(capsys):
    assert main(["bench", "--arch", "tiny-flux", "--comfyui", "x", "--blocks", "all"]) == 2
    assert "--comfyui, --blocks apply to --host comfyui only" in capsys.readouterr().err


def test_the_nodes_refusal_of_an_input_is_the_benchs_error(comfy, tmp_path, capsys):
    assert bench(tmp_path, "tiny-unet", "--merge-mlp", "--no-profile") == 2
    err = capsys.readouterr().err
    assert "the ToMA node refused" in err and "merge_mlp: 'on' is not available on the SD/SDXL UNet" in err
    assert not (tmp_path / "b.json").exists()


def test_without_comfyui_the_error_names_the_option(monkeypatch, tmp_path, capsys):
    # nothing is imported on these paths: the session's ComfyUI is only hidden for the test
    monkeypatch.delitem(sys.modules, "comfy", raising=False)
    monkeypatch.delenv("TOMA_COMFYUI", raising=False)
    assert bench(tmp_path, "tiny-flux") == 2
    assert "--host comfyui needs ComfyUI: pass --comfyui PATH" in capsys.readouterr().err
    assert bench(tmp_path, "tiny-flux", "--comfyui", str(tmp_path)) == 2
    assert f"--comfyui: --comfyui = {tmp_path} is not a ComfyUI checkout" in capsys.readouterr().err
    monkeypatch.setenv("TOMA_COMFYUI", str(tmp_path))
    assert bench(tmp_path, "tiny-flux") == 2
    assert f"$TOMA_COMFYUI = {tmp_path} is not a ComfyUI checkout" in capsys.readouterr().err
