"""ComfyUI's own SDXL UNet at full width and reduced depth on the CPU: unpatched, ToMA (the
ComfyUI node's patch) and the ideal (the same patch with a merge that costs nothing).

The ideal is ``toma bench``'s (``toma/tools/baselines.py``): the node's own hooks at the same
levels, keeping the same number K of tokens per grid, but its plans keep every ``N/K``-th
token and repeat the outputs back, with no selection, no merge matmuls and no attention bias.
Any merging at these places is at best as fast; efficiency is ToMA's share of its saving.

SDXL's width (320 channels, multipliers 1, 2, 4, 64-channel heads, text 2048, ADM 2816) with
``--depth`` transformer blocks per block at the 1/4 level (SDXL has 10) and 2 at 1/2, as
SDXL; the node's default merges both levels (1/2 and 1/4 of the latent). One denoiser call
(``BaseModel.apply_model`` with the clone's patches and wrappers) per measurement, methods
interleaved round by round, CPU time of this process at one thread (steadier than wall time
on a shared machine). Random seeded weights, fp32, batch 1. The vendored ComfyUI is imported
as the tests do (``tests/comfyui/tiny_comfy.py``; ``$TOMA_COMFYUI`` or ``../shared/vendor/ComfyUI``).

    python benchmarks/comfyui_sdxl_cpu.py --resolution 1024 --depth 2 --rounds 3
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
    parser.add_argument("--resolution", type=int, default=1024, help="image side in pixels (latent /8)")
    parser.add_argument("--depth", type=int, default=2, help="transformer blocks per block at 1/4 (SDXL has 10)")
    parser.add_argument("--text", type=int, default=77, help="text tokens")
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

    d = args.depth
    unet_config = {
        "model_channels": 320,
        "use_linear_in_transformer": True,
        "transformer_depth": [0, 0, 2, 2, d, d],
        "transformer_depth_output": [0, 0, 0, 2, 2, 2, d, d, d],
        "transformer_depth_middle": d,
        "context_dim": 2048,
        "adm_in_channels": 2816,
        "num_classes": "sequential",  # the ADM vector, as ComfyUI's detection sets it for SDXL
        "use_temporal_attention": False,
        "in_channels": 4,
        "out_channels": 4,
        "num_res_blocks": [2, 2, 2],
        "channel_mult": [1, 2, 4],
        "num_head_channels": 64,
        "num_heads": -1,
        "use_spatial_transformer": True,
        "legacy": False,
        "image_size": 32,
    }
    config = comfy.supported_models.SDXL(unet_config)
    model = comfy.model_base.SDXL(config, device=torch.device("cpu"))
    model.eval()
    tiny_comfy.seed_weights(model.diffusion_model, 0)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
    patched = patch_model(patcher, args.ratio)  # the node's defaults: levels 1 and 2
    ideal = patch_model(patcher, args.ratio, proportional_attention=False)
    run = ideal.toma_run
    run.cache = IdealPlanCache(run.config, reference=run.family.reference)

    side = args.resolution // 8
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, side, side, generator=g)
    context = torch.randn(1, args.text, 2048, generator=g)
    adm = torch.randn(1, 2816, generator=g)
    sigma = torch.tensor([2.0])

    def call(p) -> None:
        options = {**p.model_options.get("transformer_options", {}), "wrappers": p.wrappers, "sigmas": sigma}
        with torch.inference_mode():
            model.apply_model(x, sigma, c_crossattn=context, y=adm, transformer_options=options)

    methods = {"none": patcher, "toma": patched, "ideal": ideal}
    times = comfyui_timing.interleaved({name: lambda p=p: call(p) for name, p in methods.items()}, args.rounds)
    for name in ("toma", "ideal"):
        assert methods[name].toma_run.merged_calls == args.rounds + 1, f"{name} did not merge"
    grids = [(math.ceil(side / ds),) * 2 for ds in patched.toma_run.levels]
    report = {
        "host": "comfyui",
        "arch": "sdxl unet (full width)",
        "depth_at_quarter": d,
        "resolution": args.resolution,
        "merged_levels": [f"1/{ds}" for ds in patched.toma_run.levels],
        "tokens": {f"{g[0]}x{g[1]}": [g[0] * g[1], patched.toma_run.cache.layout(*g).num_merged] for g in grids},
        "text_tokens": args.text,
        "ratio": args.ratio,
        "threads": 1,
        "load": os.getloadavg(),
        **comfyui_timing.figures(times),
    }
    comfyui_timing.emit(report, args.out)


if __name__ == "__main__":
    main()
