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
    # the engine and its MLP-chunking part, and SD3's spec; no other family's
    assert adapters == {"toma.adapters.base", "toma.adapters.engine", "toma.adapters.chunking", "toma.adapters.sd3"}
