"""Old code against new, bitwise, on ComfyUI's own models: the check that a refactor of the
ComfyUI node changed nothing.

The ComfyUI counterpart of ``benchmarks/bitwise_ab.py``: imports the vendored ComfyUI once
(as the tests do), then an older toma (a git revision, checked out as a worktree, or a
folder), samples every tiny ComfyUI family of ``tests/comfyui`` through the node's patch
in a few settings, drops that toma from the process, imports the working tree's and
samples the same. Same process, same thread count: any difference is the code's.

Settings per family: ratio 0.5 with every block merged, with and without proportional
attention, and CFG batches of two (per-sample plans); the UNet both SDXL-like and SD-1.x-like.

    python benchmarks/comfyui_bitwise_ab.py --old HEAD~1
Exits 1 if anything differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import comfyui_timing  # this folder's: the script's own folder leads sys.path
from bitwise_ab import old_tree

ROOT = Path(__file__).resolve().parents[1]

ALL = "double:all single:all"


def cases(tc) -> dict:
    """name -> (make the patcher, sample it, the node's blocks input)."""
    return {
        "flux": (tc.flux_patcher, lambda c, m: tc.sample(c, m, "flux", steps=2, batch=2), ALL),
        "chroma": (tc.chroma_patcher, lambda c, m: tc.sample(c, m, "flux", steps=2), ALL),
        "sd3": (tc.sd3_patcher, lambda c, m: tc.sample(c, m, "flux", steps=2), "blocks:all"),
        "wan": (tc.wan_patcher, lambda c, m: tc.sample_video(c, m), "blocks:all"),
        "hunyuanvideo": (tc.hunyuan_patcher, lambda c, m: tc.sample_hunyuan(c, m), ALL),
        "qwenimage": (tc.qwen_patcher, lambda c, m: tc.sample_qwen(c, m), "blocks:all"),
        "unet-sdxl": (tc.unet_patcher, lambda c, m: tc.sample(c, m, "unet", h=8, w=8, steps=2, batch=2), ""),
        "unet-sd1": (
            lambda c, seed: tc.unet_patcher(c, sdxl_like=False, seed=seed),
            lambda c, m: tc.sample(c, m, "unet", h=8, w=8, steps=2),
            "",
        ),
        "zimage": (tc.zimage_patcher, lambda c, m: tc.sample(c, m, "flux", h=12, w=20, steps=2), "layers:all"),
    }


def run_side(root: Path, comfy, tc) -> dict[str, torch.Tensor]:
    for name in [m for m in sys.modules if m == "toma" or m.startswith("toma.")]:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        from toma.comfyui.patch import patch_model

        assert Path(sys.modules["toma"].__file__).resolve().is_relative_to(root.resolve())
        out = {}
        for name, (make, run, blocks) in cases(tc).items():
            for proportional in (True, False):
                model = make(comfy, seed=1)
                patched = patch_model(model, 0.5, blocks=blocks, proportional_attention=proportional)
                assert patched is not model, f"{name}: the node refused the model"
                out[f"{name} proportional={proportional}"] = run(comfy, patched)
        return out
    finally:
        sys.path.remove(str(root))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="a git revision, or a folder holding the old checkout")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tc = comfyui_timing.import_comfyui()
    import comfy  # imported by the line above, as the tests import it

    old = run_side(old_tree(args.old), comfy, tc)
    new = run_side(ROOT, comfy, tc)
    differ = 0
    for what, ref in old.items():
        same = torch.equal(ref, new[what])
        differ += not same
        gap = "" if same else f"  max |diff| {(ref.double() - new[what].double()).abs().max().item():.3g}"
        print(f"{what:34} {'bitwise equal' if same else 'DIFFERS'}{gap}")
    print(f"{'all bitwise equal' if not differ else f'{differ} differ'} ({len(old)} runs, old {args.old})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
