"""ComfyUI's own Z-Image (NextDiT) at reduced width and depth on the CPU: unpatched, ToMA (the
ComfyUI node's patch) and the ideal (the same patch with a merge that costs nothing).

The ideal is ``toma bench``'s (``toma/tools/baselines.py``), as in
``benchmarks/comfyui_wan_cpu.py``: the node's own layer object patches run the same main
layers on the same number K of image tokens, but its plans keep every ``N/K``-th token and
repeat the outputs back, with no selection, no merge matmuls and no attention bias. Any
merging at these layers is at best as fast; efficiency is ToMA's share of its saving. The
refiners (noise and caption) run on every token in all three, as toma never merges them.

Z-Image's layout (heads of 128 channels, rotary axes 32/48/48, Z-Image's modulation and
padding to 32 tokens, FFN ``dim * 8 / 3``, 16 latent channels, caption features 2560) at
width ``--dim`` (Z-Image-Turbo: 3840) with ``--layers`` main layers (it has 30) and
``--refiners`` layers in each refiner (it has 2), every main layer merged (``layers:all``;
the default skips the first 5). One denoiser call (``BaseModel.apply_model`` with the
clone's patches and wrappers) per measurement, methods interleaved round by round, each
method's patcher loaded untimed before its call (its layer object patches are put in place
by loading, once per sampling run), CPU time of this process at one thread. Random seeded
weights, fp32, batch 1. The vendored ComfyUI is imported as the tests do
(``tests/comfyui/tiny_comfy.py``; ``$TOMA_COMFYUI`` or ``../shared/vendor/ComfyUI``).

    python benchmarks/comfyui_zimage_cpu.py --resolution 1024 --dim 1536 --layers 2 --refiners 1 --rounds 3
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch

import comfyui_timing  # this folder's: the script's own folder leads sys.path

HEAD_DIM = 128  # Z-Image's: 3840 / 30 heads, the rotary axes' 32 + 48 + 48


def main() -> None:
    """Parse the options, build the model, time the three methods and print a JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=1024, help="image side in pixels (latent /8, tokens /16)")
    parser.add_argument("--dim", type=int, default=1536, help="width, a multiple of 128 (Z-Image-Turbo: 3840)")
    parser.add_argument("--layers", type=int, default=2, help="main layers (Z-Image-Turbo has 30)")
    parser.add_argument("--refiners", type=int, default=1, help="layers per refiner (Z-Image-Turbo has 2)")
    parser.add_argument("--text", type=int, default=128, help="caption tokens (padded to a multiple of 32)")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the report here too")
    args = parser.parse_args()
    if args.dim % HEAD_DIM:
        parser.error(f"--dim must be a multiple of {HEAD_DIM} (Z-Image's head width); got {args.dim}")

    torch.set_num_threads(1)
    # imports diffusers: before ComfyUI's torchvision stand-ins
    from toma.tools.baselines import IdealPlanCache

    tiny_comfy = comfyui_timing.import_comfyui()
    import comfy.model_base
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models

    from toma.comfyui.patch import patch_model

    unet_config = {
        "image_model": "lumina2",
        "patch_size": 2,
        "in_channels": 16,
        "dim": args.dim,
        "cap_feat_dim": 2560,
        "n_layers": args.layers,
        "n_refiner_layers": args.refiners,
        "n_heads": args.dim // HEAD_DIM,
        "n_kv_heads": args.dim // HEAD_DIM,
        "qk_norm": True,
        "axes_dims": [32, 48, 48],
        "axes_lens": [1536, 512, 512],
        "rope_theta": 256.0,
        "ffn_dim_multiplier": 8.0 / 3.0,
        "z_image_modulation": True,
        "time_scale": 1000.0,
        "pad_tokens_multiple": 32,
    }
    config = comfy.supported_models.ZImage(unet_config)
    model = comfy.model_base.Lumina2(config, device=torch.device("cpu"))
    model.eval()
    tiny_comfy.seed_weights(model.diffusion_model, 0)
    with torch.no_grad():  # parameters outside any layer, which ComfyUI also leaves as torch.empty
        for pad in (model.diffusion_model.x_pad_token, model.diffusion_model.cap_pad_token):
            pad.normal_(0, 0.02, generator=torch.Generator().manual_seed(2))
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
    patched = patch_model(patcher, args.ratio, blocks="layers:all")
    ideal = patch_model(patcher, args.ratio, blocks="layers:all", proportional_attention=False)
    run = ideal.toma_run
    run.cache = IdealPlanCache(run.config, reference=run.family.reference)

    side = args.resolution // 8
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, side, side, generator=g)
    context = torch.randn(1, args.text, 2560, generator=g)
    sigma = torch.tensor([0.7])

    def call(p) -> None:
        options = {**p.model_options.get("transformer_options", {}), "wrappers": p.wrappers, "sigmas": sigma}
        with torch.inference_mode():
            model.apply_model(x, sigma, c_crossattn=context, num_tokens=args.text, transformer_options=options)

    methods = {"none": patcher, "toma": patched, "ideal": ideal}
    times = comfyui_timing.interleaved(
        {name: lambda p=p: call(p) for name, p in methods.items()},
        args.rounds,
        before=lambda name: comfy.model_management.load_models_gpu([methods[name]]),
    )
    for name in ("toma", "ideal"):
        assert methods[name].toma_run.merged_calls == args.rounds + 1, f"{name} did not merge"
    grid = patched.toma_run.grid
    report = {
        "host": "comfyui",
        "arch": f"z-image layout, dim {args.dim} (Z-Image-Turbo: 3840)",
        "layers": args.layers,
        "refiner_layers": args.refiners,
        "resolution": args.resolution,
        "token_grid": list(grid),
        "image_tokens": math.prod(grid),
        "kept_tokens": patched.toma_run.tokens[1],
        "text_tokens": args.text,
        "ratio": args.ratio,
        "threads": 1,
        "load": os.getloadavg(),
        **comfyui_timing.figures_of_times(times),
    }
    comfyui_timing.emit(report, args.out)


if __name__ == "__main__":
    main()
