"""ToMA in the two hosts on the same weights: how far apart diffusers' and ComfyUI's merged
outputs are, against how far merging moves each, on generic and on paired inputs.

The tiny twins and inputs of ``tests/comfyui/test_comfyui_cross_host.py`` (Flux, the
SDXL-layout UNet, Wan 2.1, Z-Image; ratio 0.5, every block, proportional attention), one
denoiser call per host, over a few seeds. Prints one JSON record per family, input kind and
seed: the max absolute differences ``hosts_unpatched``, ``hosts_merged``, ``comfy_moved``
(ComfyUI merged vs unpatched) and ``diffusers_moved``, and ``same_destinations`` (the
fraction of ComfyUI's destinations that diffusers' first plan also selects). Z-Image runs
its paired inputs twice: with its noise refiner as it is (``"still_refiner": false``), and
with the refiner's gates at zero as the test runs them (``true``).

    python benchmarks/comfyui_cross_host.py --seeds 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "comfyui"))


def main() -> None:
    """Measure every family, input kind and seed; print one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="input seeds per family and kind")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # diffusers' model classes before ComfyUI's torchvision stand-ins
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel, WanTransformer3DModel  # noqa: F401
    from diffusers import ZImageTransformer2DModel  # noqa: F401
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers  # noqa: F401
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers  # noqa: F401
    from diffusers.models.transformers.transformer_z_image import TimestepEmbedder  # noqa: F401

    import tiny_comfy

    root = Path(os.environ.get("TOMA_COMFYUI") or REPO.parent / "shared" / "vendor" / "ComfyUI")
    comfy = tiny_comfy.import_comfyui(root, Path(tempfile.mkdtemp()))
    import toma
    from toma.adapters import state
    from toma.comfyui.patch import patch_model

    sys.path.insert(0, str(REPO / "tests" / "comfyui"))
    from test_comfyui_cross_host import COMFY_BLOCKS, DIFFUSERS_BLOCKS

    seen: list[torch.Tensor] = []
    get = state.PlanCache.get

    def recording(self, x, grid, group, tiled=False, ratio=None):
        before = len(self.forward.plans)
        plan = get(self, x, grid, group, tiled, ratio)
        if plan is not None and len(self.forward.plans) > before:
            seen.append(plan.dest_tokens.clone())
        return plan

    state.PlanCache.get = recording
    for family in tiny_comfy.TWIN_FAMILIES:
        kinds = [(False, False), (True, False)] + ([(True, True)] if family == "zimage" else [])
        for pairs, still in kinds:
            for seed in range(args.seeds):
                patcher, model = tiny_comfy.diffusers_twin(comfy, family, still_refiner=still)
                inputs = tiny_comfy.twin_inputs(family, pairs=pairs, seed=3 + seed)
                c0 = tiny_comfy.comfy_denoise(patcher, **inputs)
                d0 = tiny_comfy.diffusers_denoise(family, patcher, model, **inputs)
                seen.clear()
                patched = patch_model(patcher, 0.5, blocks=COMFY_BLOCKS[family], proportional_attention=True)
                c1 = tiny_comfy.comfy_denoise(patched, **inputs)
                comfy_dest = seen[0]
                seen.clear()
                toma.apply_toma(model, 0.5, proportional_attention=True, **DIFFUSERS_BLOCKS[family])
                d1 = tiny_comfy.diffusers_denoise(family, patcher, model, **inputs)
                diffusers_dest = seen[0]
                same = torch.isin(comfy_dest, diffusers_dest).float().mean().item()
                record = {
                    "family": family,
                    "input": "pairs" if pairs else "generic",
                    "seed": 3 + seed,
                    "hosts_unpatched": (c0 - d0).abs().max().item(),
                    "hosts_merged": (c1 - d1).abs().max().item(),
                    "comfy_moved": (c1 - c0).abs().max().item(),
                    "diffusers_moved": (d1 - d0).abs().max().item(),
                    "same_destinations": same,
                }
                if family == "zimage":
                    record["still_refiner"] = still
                print(json.dumps(record))


if __name__ == "__main__":
    main()
