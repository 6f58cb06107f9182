"""The two hosts against each other: the same tiny seeded weights in diffusers' model and in
ComfyUI's (Flux, the SD/SDXL UNet, Wan 2.1, Z-Image), the same inputs, one denoiser call each.

Unpatched, the two agree to fp32 rounding: they compute the same maths in different orders
(fused or split q/k/v projections, different attention calls), each step a few float32
epsilons relative. So the unpatched bound is 64 epsilons at the output's scale.

Merged at ratio 0.5 (every block, proportional attention on), what the hosts merge:

- The UNet: both merge the normed tokens before self-attention's q/k/v and unmerge its
  output before the residual add (``x + U attn(M norm(x))``), one plan per level: the same
  maths by design, so the outputs agree to the unpatched difference, on any input.
- Flux and Wan: ComfyUI's block replacement merges the block's *input* and runs the whole
  block (its modulated norms, attention, MLP) on K tokens, unmerging the block's change;
  diffusers' hooks merge each part's normed input (with ``merge_mlp`` and, on Wan,
  ``merge_crossattn``, so that every part merges as in ComfyUI). ``norm(M x)`` and
  ``M norm(x)`` differ when ``M`` averages distinct tokens, and the hosts select on
  different features (raw vs normed tokens), so on generic inputs the outputs differ
  (measured, docs/comfyui.md: about as far apart as each is from unmerged on Flux, 1/4-1/7
  of that on Wan). They coincide where the merge commutes with the norms: image tokens in
  equal pairs (``twin_inputs(pairs=True)``) within each 2x2 tile. Merging a pair is then a
  copy, both hosts pick the same destinations (exact ties break on the same index), and
  the merged computation still differs from the unmerged one (each pair runs at its
  destination's rotary position). That is the input these two are checked on.
- Z-Image: the hosts' sequences run in reverse order (ComfyUI ``[caption; image; pad]``,
  diffusers ``[image; pad; caption]``), which attention does not see: every token keeps its
  rotary position. ComfyUI's NextDiT has no block replacement; toma's object patch merges
  each main layer's input and runs the whole layer on K tokens, as for Flux, while diffusers
  merges the attention's and the MLP's normed inputs: on generic inputs the two differ as
  Flux's do (benchmarks/comfyui_cross_host.py). On equal pairs they coincide as above, once
  the pairs reach the main layers equal: the unmerged noise refiner's attention runs the two
  tokens of a pair at their own rotary positions and tells them apart, so the merged case
  runs with that refiner's gates at zero (``diffusers_twin(still_refiner=True)``: the
  refiner passes the image through), the main layers as they are.

In each merged case: the destinations both hosts select are exactly equal; the outputs
agree within 10x the floor (the hosts' unpatched difference, or one fp32 step where that is
0), and that tolerance is at least 100x below how far merging moves either host's output.
"""

from __future__ import annotations

import pytest
import torch

# diffusers' model classes, imported before ComfyUI's torchvision stand-ins exist
from diffusers import FluxTransformer2DModel, UNet2DConditionModel, WanTransformer3DModel  # noqa: F401
from diffusers import ZImageTransformer2DModel  # noqa: F401
from diffusers.loaders.single_file_utils import (  # noqa: F401
    convert_wan_transformer_to_diffusers,
    convert_z_image_transformer_checkpoint_to_diffusers,
)
from diffusers.models.transformers.transformer_z_image import TimestepEmbedder  # noqa: F401
from tiny_comfy import TWIN_FAMILIES, comfy_denoise, diffusers_denoise, diffusers_twin, fp32_floor, twin_inputs

import toma
from toma.adapters import state
from toma.comfyui.patch import patch_model

# every block of the tiny twins, in each host's words
COMFY_BLOCKS = {"flux": "double:all single:all", "unet": "levels:1,2", "wan": "blocks:all", "zimage": "layers:all"}
DIFFUSERS_BLOCKS = {
    "flux": {"blocks": {"transformer_blocks": range(2), "single_transformer_blocks": range(2)}, "merge_mlp": True},
    "unet": {"levels": 2},
    "wan": {"blocks": {"blocks": range(2)}, "merge_mlp": True, "merge_crossattn": True},
    "zimage": {"blocks": {"layers": range(2)}, "merge_mlp": True},
}


def _max(a: torch.Tensor) -> float:
    return float(a.abs().max())


@pytest.fixture
def plans(monkeypatch):
    """Every plan either host computes, as ``(image tokens, destinations)``, in order."""
    seen: list[tuple[int, torch.Tensor]] = []
    get = state.PlanCache.get

    def recording(self, x, grid, group, tiled=False, ratio=None):
        before = len(self.forward.plans)
        plan = get(self, x, grid, group, tiled, ratio)
        if plan is not None and len(self.forward.plans) > before:
            seen.append((x.shape[1], plan.dest_tokens.clone()))
        return plan

    monkeypatch.setattr(state.PlanCache, "get", recording)
    return seen


@pytest.mark.parametrize("family", TWIN_FAMILIES)
def test_unpatched_hosts_agree_to_fp32_rounding(comfy, family):
    patcher, model = diffusers_twin(comfy, family)
    inputs = twin_inputs(family)
    ours, theirs = comfy_denoise(patcher, **inputs), diffusers_denoise(family, patcher, model, **inputs)
    assert ours.shape == theirs.shape == inputs["x"].shape
    assert _max(ours - theirs) <= 64 * fp32_floor(ours)


@pytest.mark.parametrize("family, pairs", [("flux", True), ("unet", False), ("wan", True), ("zimage", True)])
def test_merged_hosts_select_the_same_destinations_and_agree(comfy, family, pairs, plans):
    patcher, model = diffusers_twin(comfy, family, still_refiner=family == "zimage")
    inputs = twin_inputs(family, pairs=pairs)
    comfy_plain = comfy_denoise(patcher, **inputs)
    diffusers_plain = diffusers_denoise(family, patcher, model, **inputs)
    floor = max(_max(comfy_plain - diffusers_plain), fp32_floor(comfy_plain))

    patched = patch_model(patcher, 0.5, blocks=COMFY_BLOCKS[family], proportional_attention=True)
    comfy_merged = comfy_denoise(patched, **inputs)
    comfy_plans = list(plans)
    plans.clear()
    toma.apply_toma(model, 0.5, proportional_attention=True, **DIFFUSERS_BLOCKS[family])
    diffusers_merged = diffusers_denoise(family, patcher, model, **inputs)
    diffusers_plans = list(plans)

    assert patched.toma_run.merged_calls == 1 and comfy_plans and diffusers_plans
    # the same destinations: every plan diffusers built (one per stack or part) selects the
    # tokens ComfyUI's plan for that many image tokens selects (one per call, or per UNet
    # level). As sets: within a tile of two equal pairs, which pair is picked first is an
    # exact tie that float summation order breaks, and the order of merged tokens is free
    by_tokens = {tokens: dest.sort(-1).values for tokens, dest in comfy_plans}
    assert len(by_tokens) == len(comfy_plans)
    for tokens, dest in diffusers_plans:
        assert torch.equal(dest.sort(-1).values, by_tokens[tokens]), (family, tokens)
    assert {tokens for tokens, _ in diffusers_plans} == set(by_tokens)

    tolerance = 10 * floor
    moved = min(_max(comfy_merged - comfy_plain), _max(diffusers_merged - diffusers_plain))
    assert _max(comfy_merged - diffusers_merged) <= tolerance
    assert moved >= 100 * tolerance, (moved, tolerance)
