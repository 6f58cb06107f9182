"""What ``import toma`` loads: the library only, and nothing heavy beyond torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def loaded_after(code: str) -> list[str]:
    """Modules loaded by a fresh interpreter after running ``code`` (after ``import torch``)."""
    script = f"import torch, sys; before = set(sys.modules); {code}; print(__import__('json').dumps(sorted(set(sys.modules) - before)))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_toma_loads_no_tool_no_diffusers_and_no_compiler():
    mods = loaded_after("import toma")
    assert not [m for m in mods if m.startswith("toma.tools")]
    # diffusers' model code took ~9 s and torch._dynamo ~2 s: both wait for apply_toma
    assert not [m for m in mods if m == "diffusers" or m.startswith(("diffusers.", "torch._dynamo"))]


def test_applying_to_one_family_imports_only_its_adapter():
    mods = loaded_after(
        "from diffusers import SD3Transformer2DModel as M; import toma; "
        "m = M(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8, "
        "num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=16); "
        "toma.apply_toma(m, ratio=0.5)"
    )
    adapters = {m for m in mods if m.startswith("toma.adapters.")}
    # the engine (its spec types, merge hooks, MLP-chunking and checkpoint-replay parts) and
    # SD3's spec; no other family's
    assert adapters == {"toma.adapters.base", "toma.adapters.engine", "toma.adapters.spec", "toma.adapters.merging",
                        "toma.adapters.chunking", "toma.adapters.replay", "toma.adapters.sd3"}


def loaded_by_cli(*argv: str) -> tuple[int, set[str]]:
    """Exit code and the modules loaded when a fresh interpreter runs the ``toma`` CLI with ``argv``."""
    script = (
        "import sys, json\n"
        "from toma.tools.cli import main\n"
        "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
        "print(json.dumps([code, sorted(sys.modules)]), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True,
                         cwd=Path(__file__).parents[1])
    code, mods = json.loads(out.stderr.strip().splitlines()[-1])
    return code, set(mods)


def test_cli_help_version_and_argument_errors_do_not_import_torch():
    # torch takes ~1.3 s to import: help, version and argparse errors must answer without it
    cases = [("--help",), ("--version",), ("bench", "--help"), ("eval", "--help"), ("generate", "--help"),
             ("doctor", "--help"), ("tune", "--help"), ("bench", "--arch", "no-such-arch"), ("eval", "--steps", "x"),
             ("doctor", "--grid", "0"), ("tune", "--ratios"), ("no-such-command",)]
    for argv in cases:
        code, mods = loaded_by_cli(*argv)
        assert code in (0, 2), (argv, code)
        heavy = sorted(m for m in mods if m.split(".")[0] in ("torch", "diffusers", "transformers", "matplotlib"))
        assert not heavy, (argv, heavy[:5])


def test_lazy_public_names_resolve():
    import toma

    assert {"apply_toma", "remove_toma", "get_toma", "ToMAConfig", "ToMAPatch"} <= set(dir(toma))
    from toma import ToMAConfig, apply_toma
    from toma.api import apply_toma as direct

    assert apply_toma is direct and ToMAConfig(ratio=0.25).ratio == 0.25
    import pytest

    with pytest.raises(AttributeError, match="no_such_name"):
        toma.no_such_name
