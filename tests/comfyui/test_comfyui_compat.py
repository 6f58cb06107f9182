"""The ComfyUI column of the compatibility matrix (toma/compat.py, docs/compatibility.md): the
node merges each family marked ``✔`` there, on the vendored ComfyUI's own model classes.

The cases are the matrix's ``✔`` families (from :data:`toma.comfyui.families.FAMILIES`); a
family marked there with no tiny ComfyUI model below fails.
"""

from __future__ import annotations

import pytest
import torch
from tiny_comfy import (
    chroma_patcher,
    flux_patcher,
    hunyuan_patcher,
    ltx_patcher,
    qwen_patcher,
    sample,
    sample_hunyuan,
    sample_ltx,
    sample_qwen,
    sample_video,
    sd3_patcher,
    unet_patcher,
    wan_patcher,
    zimage_patcher,
)

from tests.compat_cells import families
from toma.comfyui.node import ToMAModel

ALL = "double:all single:all"
# family -> (tiny model, a short sampling run, the node's blocks input merging every block)
RUNS = {
    "flux": (flux_patcher, lambda comfy, m: sample(comfy, m, "flux", steps=2), ALL),
    "chroma": (chroma_patcher, lambda comfy, m: sample(comfy, m, "flux", steps=2), ALL),
    "sd3": (sd3_patcher, lambda comfy, m: sample(comfy, m, "flux", steps=2), "blocks:all"),
    "wan": (wan_patcher, lambda comfy, m: sample_video(comfy, m), "blocks:all"),
    "hunyuanvideo": (hunyuan_patcher, lambda comfy, m: sample_hunyuan(comfy, m), ALL),
    "ltx": (ltx_patcher, lambda comfy, m: sample_ltx(comfy, m), "blocks:all"),
    "qwenimage": (qwen_patcher, lambda comfy, m: sample_qwen(comfy, m), "blocks:all"),
    "unet": (unet_patcher, lambda comfy, m: sample(comfy, m, "unet", h=8, w=8, steps=2), ""),
    "zimage": (zimage_patcher, lambda comfy, m: sample(comfy, m, "flux", h=12, w=20, steps=2), "layers:all"),
}


@pytest.mark.parametrize("family", families("comfyui"))
def test_the_node_merges_each_family_the_matrix_marks(comfy, family):
    assert family in RUNS, f"the matrix says ComfyUI merges {family}: give it a tiny model here"
    make, run, blocks = RUNS[family]
    model = make(comfy, seed=1)
    reference = run(comfy, model)
    (patched,) = ToMAModel().patch(model, 0.5, blocks=blocks)
    out = run(comfy, patched)
    assert patched.toma_run.merged_calls > 0
    assert torch.isfinite(out).all() and not torch.equal(out, reference)
    assert torch.equal(run(comfy, model), reference)  # the node's input model is left as it was
