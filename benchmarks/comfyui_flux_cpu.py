"""ComfyUI's own Flux at full width and reduced depth on the CPU: unpatched, ToMA (the
ComfyUI node's patch) and the ideal (the same model on K image tokens, no selection).

One denoiser call (``BaseModel.apply_model``, with the patched clone's transformer options:
its block replacements and wrappers) per measurement, methods interleaved round by round,
CPU time of this process at one thread (steadier than wall time on a shared machine).
Random seeded weights, fp32, batch 1. The vendored ComfyUI is imported as the tests do
(``tests/comfyui/tiny_comfy.py``; ``$TOMA_COMFYUI`` or ``../shared/vendor/ComfyUI``).

    python benchmarks/comfyui_flux_cpu.py --resolution 512 --double 1 --single 2 --rounds 3
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

import comfyui_timing  # this folder's: the script's own folder leads sys.path


def main() -> None:
    """Parse the options, build the model, time the three methods and print a JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=512, help="image side in pixels (latent /8, tokens /16)")
    parser.add_argument("--double", type=int, default=1, help="double-stream blocks (Flux.1-dev has 19)")
    parser.add_argument("--single", type=int, default=2, help="single-stream blocks (Flux.1-dev has 38)")
    parser.add_argument("--text", type=int, default=64, help="text tokens")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the report here too")
    args = parser.parse_args()

    torch.set_num_threads(1)
    tiny_comfy = comfyui_timing.import_comfyui()
    import comfy.latent_formats
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models

    from toma.comfyui.patch import patch_model

    config = comfy.supported_models.Flux(
        {
            "image_model": "flux",
            "in_channels": 16,
            "out_channels": 16,
            "vec_in_dim": 768,
            "context_in_dim": 4096,
            "hidden_size": 3072,
            "mlp_ratio": 4.0,
            "num_heads": 24,
            "depth": args.double,
            "depth_single_blocks": args.single,
            "axes_dim": [16, 56, 56],
            "theta": 10000,
            "patch_size": 2,
            "qkv_bias": True,
            "guidance_embed": True,
            "txt_ids_dims": [],
        }
    )
    model = comfy.model_base.Flux(config, device=torch.device("cpu"))
    model.eval()
    tiny_comfy.seed_weights(model.diffusion_model, 0)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
    patched = patch_model(patcher, args.ratio, blocks="double:all single:all")

    side = args.resolution // 8
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, side, side, generator=g)
    x_ideal = x[..., : side // 2]  # half the columns: K = N / 2 image tokens, as ToMA keeps at 0.5
    context = torch.randn(1, args.text, 4096, generator=g)
    pooled = torch.randn(1, 768, generator=g)
    sigma = torch.tensor([0.7])

    def call(latent: torch.Tensor, options: dict) -> None:
        with torch.inference_mode():
            model.apply_model(
                latent,
                sigma,
                c_crossattn=context,
                y=pooled,
                guidance=torch.tensor([3.5]),
                transformer_options={**options, "sigmas": sigma},
            )

    plain = patcher.model_options.get("transformer_options", {})
    # the patcher's wrappers join its transformer options where sampling would put them
    toma = {**patched.model_options["transformer_options"], "wrappers": patched.wrappers}
    methods = {"none": (x, plain), "toma": (x, toma), "ideal": (x_ideal, plain)}
    times = comfyui_timing.interleaved(
        {
            name: lambda latent=latent, options=options: call(latent, options)
            for name, (latent, options) in methods.items()
        },
        args.rounds,
    )
    assert patched.toma_run.merged_calls == args.rounds + 1, "ToMA did not merge"
    n = math.ceil(side / 2) ** 2
    report = {
        "host": "comfyui",
        "arch": "flux (full width)",
        "double_blocks": args.double,
        "single_blocks": args.single,
        "resolution": args.resolution,
        "image_tokens": n,
        "kept_tokens": patched.toma_run.cache.layout(side // 2, side // 2).num_merged,
        "text_tokens": args.text,
        "ratio": args.ratio,
        "threads": 1,
        **comfyui_timing.figures(times),
    }
    comfyui_timing.emit(report, args.out)


if __name__ == "__main__":
    main()
