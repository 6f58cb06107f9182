"""ComfyUI's own Wan 2.1 (T2V 1.3B width) at reduced depth on the CPU: unpatched, ToMA (the
ComfyUI node's patch) and the ideal (the same patch with a merge that costs nothing).

The ideal is ``toma bench``'s (``toma/tools/baselines.py``): the node's own block
replacements, keeping the same number K of video tokens, but its plans keep every ``N/K``-th
token and repeat the outputs back, with no selection, no merge matmuls and no attention bias.
Any merging at these places is at best as fast; efficiency is ToMA's share of its saving.

Wan 2.1 T2V 1.3B's width (dim 1536, 12 heads, MLP 8960, text 4096) with ``--layers`` blocks
(it has 30), every block merged (``blocks:all``; the default skips the first 5). One
denoiser call (``BaseModel.apply_model`` with the clone's patches and wrappers) per
measurement, methods interleaved round by round, CPU time of this process at one thread.
Random seeded weights, fp32, batch 1. The vendored ComfyUI is imported as the tests do
(``tests/comfyui/tiny_comfy.py``; ``$TOMA_COMFYUI`` or ``../shared/vendor/ComfyUI``).

    python benchmarks/comfyui_wan_cpu.py --width 832 --height 480 --frames 9 --layers 2 --rounds 3
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch

import comfyui_timing  # this folder's: the script's own folder leads sys.path


def main() -> None:
    """Parse the options, build the model, time the three methods and print a JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=832, help="video width in pixels (latent /8, tokens /16)")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--frames", type=int, default=9, help="video frames (latent frames: (frames - 1) / 4 + 1)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (Wan 2.1 1.3B has 30)")
    parser.add_argument("--text", type=int, default=512, help="text tokens (ComfyUI pads umt5's to 512)")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the report here too")
    args = parser.parse_args()

    torch.set_num_threads(1)
    # imports diffusers: before ComfyUI's torchvision stand-ins
    from toma.tools.baselines import IdealPlanCache

    tiny_comfy = comfyui_timing.import_comfyui()
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models

    from toma.comfyui.patch import patch_model

    unet_config = {
        "image_model": "wan2.1",
        "model_type": "t2v",
        "patch_size": (1, 2, 2),
        "text_len": 512,
        "in_dim": 16,
        "dim": 1536,
        "ffn_dim": 8960,
        "freq_dim": 256,
        "text_dim": 4096,
        "out_dim": 16,
        "num_heads": 12,
        "num_layers": args.layers,
    }
    config = comfy.supported_models.WAN21_T2V(unet_config)
    model = comfy.model_base.WAN21(config, device=torch.device("cpu"))
    model.eval()
    tiny_comfy.seed_weights(model.diffusion_model, 0)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
    patched = patch_model(patcher, args.ratio, blocks="blocks:all")
    ideal = patch_model(patcher, args.ratio, blocks="blocks:all", proportional_attention=False)
    run = ideal.toma_run
    run.cache = IdealPlanCache(run.config, reference=run.family.reference)

    frames = (args.frames - 1) // 4 + 1
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, frames, args.height // 8, args.width // 8, generator=g)
    context = torch.randn(1, args.text, 4096, generator=g)
    sigma = torch.tensor([0.7])

    def call(p) -> None:
        options = {**p.model_options.get("transformer_options", {}), "wrappers": p.wrappers, "sigmas": sigma}
        with torch.inference_mode():
            model.apply_model(x, sigma, c_crossattn=context, transformer_options=options)

    methods = {"none": patcher, "toma": patched, "ideal": ideal}
    times = comfyui_timing.interleaved({name: lambda p=p: call(p) for name, p in methods.items()}, args.rounds)
    for name in ("toma", "ideal"):
        assert methods[name].toma_run.merged_calls == args.rounds + 1, f"{name} did not merge"
    grid = patched.toma_run.grid
    report = {
        "host": "comfyui",
        "arch": "wan2.1 t2v 1.3B (full width)",
        "layers": args.layers,
        "video": [args.frames, args.height, args.width],
        "token_grid": list(grid),
        "image_tokens": math.prod(grid),
        "kept_tokens": patched.toma_run.tokens[1],
        "text_tokens": args.text,
        "ratio": args.ratio,
        "threads": 1,
        "load": os.getloadavg(),
        **comfyui_timing.figures(times),
    }
    comfyui_timing.emit(report, args.out)


if __name__ == "__main__":
    main()
