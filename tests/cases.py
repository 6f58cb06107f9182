"""Cases and checks several test modules share: the merge-path cases of every family that
tests/adapters/test_device_placement.py and tests/adapters/test_host_sync.py run, the
tile-order check, inputs with duplicated tokens (where proportional attention is exact) and
the rounding bound of biased attention."""

from __future__ import annotations

import math

import torch

import toma
from tests.tiny_models import (
    FAMILIES,
    cogvideox_inputs,
    make_cogvideox,
    make_flux,
    make_flux2,
    make_hunyuan,
    make_ltx,
    make_qwen,
    make_wan,
    flux2_inputs,
    flux_inputs,
    hunyuan_inputs,
    joyimage_inputs,
    kontext_inputs,
    ltx_inputs,
    pixart_inputs,
    qwen_inputs,
    sd3_inputs,
    unet_inputs,
    wan_inputs,
)
from toma.adapters.grids import IdsGrid


def _qwen_edit(batch: int) -> dict:
    """A Qwen-Image-Edit call: the generated image's 8x8 tokens, then a reference's 2x4."""
    kw = qwen_inputs(batch, 8, 8)
    g = torch.Generator().manual_seed(7)
    return {
        **kw,
        "hidden_states": torch.cat([kw["hidden_states"], torch.randn(batch, 8, 16, generator=g)], dim=1),
        "img_shapes": [[(1, 8, 8), (1, 2, 4)]] * batch,
    }


def _flux2_references(batch: int) -> dict:
    """A FLUX.2 editing call: the generated image's 8x8 tokens, then a reference's 2x4 (t = 10)."""
    kw = flux2_inputs(batch, 8, 8)
    one = torch.arange(1)
    ref_ids = torch.cartesian_prod(torch.tensor([10]), torch.arange(2), torch.arange(4), one)
    g = torch.Generator().manual_seed(7)
    return {
        **kw,
        "hidden_states": torch.cat([kw["hidden_states"], torch.randn(batch, 8, 16, generator=g)], dim=1),
        "img_ids": torch.cat([kw["img_ids"], ref_ids[None].expand(batch, -1, -1)], dim=1),
    }


PADDED = {"share_batch_plan": True}  # with one plan for the batch: its broadcasts and expansions
PADDED_VIDEO = {**PADDED, "tile_frames": 2}  # 2-frame tiles over 3 frames pad in time too
# case -> (row of tests/tiny_models.py's table, the call's inputs, options beyond the row's).
# "tiled": the tiles divide the grid, so tokens run in tile order; "padded": they do not,
# so tokens stay in raster order and move through gathers, and tiles keep different counts
CASES = {
    "sdxl-tiled": ("sdxl", lambda: unet_inputs(2, 16, 16, True), {}),
    "sdxl-padded": ("sdxl", lambda: unet_inputs(2, 10, 14, True), PADDED),
    "sd15-tiled": ("sd15", lambda: unet_inputs(2, 16, 16, False), {"levels": 2}),
    "sd15-padded": ("sd15", lambda: unet_inputs(2, 10, 14, False), {"levels": 2, **PADDED}),
    "flux-tiled": ("flux", lambda: flux_inputs(2, 8, 8), {}),
    "flux-padded": ("flux", lambda: flux_inputs(2, 6, 10), PADDED),
    "flux-kontext-tiled": ("flux-kontext", lambda: kontext_inputs(2, 8, 8, 4, 4), {}),
    "flux-kontext-padded": ("flux-kontext", lambda: kontext_inputs(2, 6, 10, 2, 4), PADDED),
    "sd3-tiled": ("sd3", lambda: sd3_inputs(2, 16, 16), {}),
    "sd3-padded": ("sd3", lambda: sd3_inputs(2, 12, 20), PADDED),
    "pixart-tiled": ("pixart", lambda: pixart_inputs(2, 16, 16), {}),
    "pixart-padded": ("pixart", lambda: pixart_inputs(2, 12, 20), PADDED),
    "wan-tiled": ("wan", lambda: wan_inputs(2, 2, 16, 16), {}),
    "wan-padded": ("wan", lambda: wan_inputs(2, 3, 12, 20), PADDED_VIDEO),
    "ltx-tiled": ("ltx", lambda: ltx_inputs(2, 2, 8, 8), {}),
    "ltx-padded": ("ltx", lambda: ltx_inputs(2, 3, 6, 10), PADDED_VIDEO),
    "qwenimage-tiled": ("qwenimage", lambda: qwen_inputs(2, 8, 8), {}),
    "qwenimage-padded": ("qwenimage", lambda: qwen_inputs(2, 6, 10), PADDED),
    "qwenimage-edit": ("qwenimage", lambda: _qwen_edit(2), {}),
    "flux2-tiled": ("flux2", lambda: flux2_inputs(2, 8, 8), {}),
    "flux2-padded": ("flux2", lambda: flux2_inputs(2, 6, 10), PADDED),
    "flux2-references": ("flux2", lambda: _flux2_references(2), {}),
    "hunyuanvideo-tiled": ("hunyuanvideo", lambda: hunyuan_inputs(2, 2, 16, 16), {}),
    "hunyuanvideo-padded": ("hunyuanvideo", lambda: hunyuan_inputs(2, 3, 12, 20), PADDED_VIDEO),
    "cogvideox-tiled": ("cogvideox", lambda: cogvideox_inputs(2, 2, 16, 16), {}),
    "cogvideox-padded": ("cogvideox", lambda: cogvideox_inputs(2, 3, 12, 20), PADDED_VIDEO),
    # rotary tables a method makes, put in the blocks' order at each block (a reference item leads)
    "joyimage-edit-tiled": ("joyimage-edit", lambda: joyimage_inputs(2, 16, 16, refs=1), {}),
}
CROSS = ("sdxl", "sd15", "pixart", "wan", "ltx")  # the rows with a cross-attention whose queries merge


def case(name: str) -> tuple[torch.nn.Module, dict, dict]:
    """A case's model, call and ``apply_toma`` options: ratio 0.5 on every block, the MLP
    and cross-attention too, and proportional attention where the family takes it."""
    row, inputs, extra = CASES[name]
    fam = FAMILIES[row]
    options = {
        "ratio": 0.5,
        **fam.options,
        "merge_mlp": True,
        "merge_crossattn": row in CROSS,
        "proportional_attention": fam.proportional,
        **extra,
    }
    return fam.make(), inputs(), options


def read_ids_on_host(model: torch.nn.Module, host: dict, device: dict) -> None:
    """Flux and FLUX.2 read their token grid from the image ids on the host, once per
    denoising run (tests/adapters/test_host_sync.py): the patched ``model``'s reader reads the
    ``host`` call's ids, as a run's first forward does, and then takes the ``device``
    call's ids (fake or meta, with no values to read) for the same ids, already read.
    Other families read nothing."""
    reader = getattr(model._diffusers_hook.get_hook("toma"), "grid", None)
    if isinstance(reader, IdsGrid):
        grid = reader(model, host)
        assert not isinstance(grid, str), grid
        ids = device["img_ids"]
        reader._known = (ids, ids._version, reader._known[2])


def check_tile_order_matches_raster(model, kw, monkeypatch, forward, conversions) -> None:
    """A patched model's output with tokens kept in tile order between merges equals its
    output with every site merging from raster order (``forward(model, **kw)`` runs it;
    ``conversions`` is the ``tile_orders`` fixture's record)."""
    tiled = forward(model, **kw)
    converted = len(conversions)
    monkeypatch.setattr(toma.adapters.state.PlanCache, "tile_order_layout", lambda self, grid, device=None: None)
    raster = forward(model, **kw)
    assert converted >= 1 and len(conversions) == converted  # the raster run converted nothing
    torch.testing.assert_close(tiled, raster, rtol=1e-4, atol=1e-5)


def engine_family(name: str) -> tuple:
    """(model maker, one batch-2 call's inputs, the options that merge every block) of a
    family on the engine, from tests/tiny_models.py's table."""
    fam = FAMILIES[name]
    return fam.make, fam.inputs(2), fam.options


def duplicated_video(seed: int = 0) -> torch.Tensor:
    """Latents ``(1, 4, 2, 8, 8)`` whose ``2 x 2 x 2``-token tiles (tokens are 1x2x2 patches)
    hold one patch 5 times and three other patches once each, in shuffled places."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.empty(2, 4, 4, 16)  # (t, h, w) tokens of 4 channels x 2 x 2 pixels
    for i in range(2):
        for j in range(2):
            distinct = torch.randn(4, 16, generator=g)
            values = torch.cat([distinct[:1].expand(5, -1), distinct[1:]])[torch.randperm(8, generator=g)]
            tokens[:, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2] = values.reshape(2, 2, 2, 16)
    patches = tokens.reshape(2, 4, 4, 4, 2, 2)  # (t, h, w, c, ph, pw)
    return patches.permute(3, 0, 1, 4, 2, 5).reshape(1, 4, 2, 8, 8)


def clustered_tokens(tiles: int, channels: int = 16, repeats: int = 9, seed: int = 0) -> torch.Tensor:
    """``(1, tiles * 16, C)`` tokens on a ``4 x 4*tiles`` grid: each 4x4 tile holds one value
    ``repeats`` times and ``16 - repeats`` other distinct values once, in shuffled places."""
    gen = torch.Generator().manual_seed(seed)
    h, w = 4, 4 * tiles
    grid = torch.empty(h, w, channels)
    for t in range(tiles):
        distinct = torch.randn(17 - repeats, channels, generator=gen)
        values = torch.cat([distinct[:1].expand(repeats, -1), distinct[1:]])
        values = values[torch.randperm(16, generator=gen)]
        grid[:, 4 * t : 4 * t + 4] = values.reshape(4, 4, channels)
    return grid.reshape(1, h * w, channels)


def check_exact_on_duplicates(model: torch.nn.Module, kw: dict, run, **options) -> None:
    """On ``kw``'s clustered tokens (:func:`clustered_tokens`, no rotation), merged attention
    with the log(mass) bias gives the unmerged output to fp32 rounding, and without the bias
    it does not (the 9-fold token is under-weighted); ``run(model, kw)`` is one forward."""
    import toma

    ref = run(model, kw)
    toma.apply_toma(model, ratio=0.5, tile_size=4, proportional_attention=True, **options)
    exact = run(model, kw)
    toma.apply_toma(model, ratio=0.5, tile_size=4, proportional_attention=False, **options)
    plain = run(model, kw)
    toma.remove_toma(model)
    torch.testing.assert_close(exact, ref, rtol=1e-4, atol=1e-5)
    assert (plain - ref).abs().max() > 1e-3


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def tolerance(q, k, v, log_mass, layout, scale) -> float:
    """How far two exact forms of biased attention may differ from rounding alone.

    Each logit ``scale * q.k + b`` is formed with at most three roundings of the dtype
    (the bias, or the key channel's ``b / scale``; the dot product's result; the sum), each
    within ``u`` of the quantities involved, so a path's logits are within
    ``d = 3u (L + B)`` of the exact ones (``L``: largest ``|scale * q.k|``, ``B``: largest
    ``|b|``) and two paths' within ``2d``. Logits moved by at most ``e`` each move every
    softmax weight by a factor within ``exp(+-2e)``, so an output (a weighted mean of values)
    moves by at most ``(exp(4d) - 1) max|v|``; the weights' and outputs' own roundings add
    ``2u max|v|`` per path.
    """
    u = unit_roundoff(q.dtype)
    bhsd = (lambda t: t) if layout == "bhsd" else (lambda t: t.transpose(1, 2))
    logits = scale * (bhsd(q).double() @ bhsd(k).double().transpose(-1, -2))
    d = 3 * u * (float(logits.abs().max()) + float(log_mass.double().abs().max()))
    return (math.expm1(4 * d) + 4 * u) * float(v.double().abs().max())


# the families a step cache runs on with ToMA: (maker, inputs, the timestep scale of
# its scheduler, the blocks merged, the module whose output the cache compares)
CACHED = {
    "flux": (
        make_flux,
        lambda: flux_inputs(1, 8, 8),
        1.0,
        {"blocks": {"transformer_blocks": (0, 1), "single_transformer_blocks": (0, 1)}},
        "single_transformer_blocks.1.proj_out",
    ),
    "wan": (make_wan, lambda: wan_inputs(1, 3, 8, 8), 1000.0, {"blocks": {"blocks": range(3)}}, "blocks.2.ffn"),
    "flux2": (
        lambda: make_flux2(),
        lambda: flux2_inputs(1, 8, 8),
        1.0,
        {"blocks": {"transformer_blocks": (0, 1), "single_transformer_blocks": (0, 1)}},
        "transformer_blocks.1.ff",
    ),
    "ltx": (
        make_ltx,
        lambda: ltx_inputs(1, 2, 4, 4),
        1000.0,
        {"blocks": {"transformer_blocks": range(3)}},
        "transformer_blocks.2.ff",
    ),
    "qwenimage": (
        make_qwen,
        lambda: qwen_inputs(1, 8, 8),
        1.0,
        {"blocks": {"transformer_blocks": range(3)}},
        "transformer_blocks.2.img_mlp",
    ),
    "hunyuanvideo": (
        make_hunyuan,
        lambda: hunyuan_inputs(1, 2, 8, 8),
        1000.0,
        {"blocks": {"transformer_blocks": range(2), "single_transformer_blocks": range(2)}},
        "single_transformer_blocks.1.proj_out",
    ),
    "cogvideox": (
        make_cogvideox,
        lambda: cogvideox_inputs(1, 2, 8, 8),
        1000.0,
        {"blocks": {"transformer_blocks": range(3)}},
        "transformer_blocks.2.ff",
    ),
}


def cache_dit_settings(kind: str, steps: int, threshold: float = 0.5, separate_cfg: bool | None = None) -> dict:
    """``cache_dit.enable_cache``'s settings for a ``steps``-step run: its first block
    computing and no last ones, the rest cached (``"dbcache"``; ``"taylorseer"``: with its
    TaylorSeer calibrator predicting them) or pruned one by one (``"dbprune"``) below a
    residual change of ``threshold`` (random weights change little between steps), after 2
    warm-up steps. ``separate_cfg``: whether calls alternate conditional and unconditional
    (None: the adapter's default for the class)."""
    import cache_dit

    common = dict(
        Fn_compute_blocks=1,
        Bn_compute_blocks=0,
        residual_diff_threshold=threshold,
        max_warmup_steps=2,
        num_inference_steps=steps,
        enable_separate_cfg=separate_cfg,
    )
    if kind == "dbprune":
        return {"cache_config": cache_dit.DBPruneConfig(**common)}
    out = {"cache_config": cache_dit.DBCacheConfig(**common)}
    if kind == "taylorseer":
        out["calibrator_config"] = cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=1)
    return out


def force(monkeypatch, form: str) -> None:
    """Make the rule pick ``form`` on the CPU's default backend (``native``); flex eager."""
    from torch.nn.attention.flex_attention import flex_attention

    from toma.adapters import attention as A

    monkeypatch.setitem(A.RULES, "native", {"*": (form, "forced by the test")})
    monkeypatch.setattr(A, "_compiled_flex", flex_attention)  # the same maths, no 20 s compile


def sdpa_keys(monkeypatch) -> list[int]:
    """The key count of every attention call from here on (diffusers' native backend)."""
    real, seen = torch.nn.functional.scaled_dot_product_attention, []

    def recording(query, key, value, *args, **kwargs):
        seen.append(key.shape[-2])
        return real(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return seen


def tiled_and_raster(model, kw: dict, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The patched model's output with tokens in tile order between merges (checked), and
    with them kept in raster order."""
    from toma.adapters.state import PlanCache

    real, used = PlanCache.tile_order_layout, []
    monkeypatch.setattr(
        PlanCache, "tile_order_layout", lambda self, *a, **k: used.append(real(self, *a, **k)) or used[-1]
    )
    with torch.no_grad():
        tiled = model(**kw).sample
    assert used and all(layout is not None for layout in used)
    monkeypatch.setattr(PlanCache, "tile_order_layout", lambda self, *a, **k: None)
    with torch.no_grad():
        raster = model(**kw).sample
    return tiled, raster


def fused_calls(model) -> list:
    """Fuses ``model``'s projections; one entry per call of a fused projection, from then on."""
    model.fuse_qkv_projections()
    calls = []
    for n, m in model.named_modules():
        if n.endswith((".to_qkv", ".to_kv", ".to_added_qkv")):
            m.register_forward_hook(lambda m, a, o: calls.append(1))
    return calls
