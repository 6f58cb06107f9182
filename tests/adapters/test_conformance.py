"""What every family must do, written once and run on every row of tests/tiny_models.py.

A new family is its spec, one row of that table, and the tests particular to it. Each test
here states a property of merging that holds whatever the family's layout: exact undo,
per-sample plans, copies that run their own weights, checkpointed gradients, the token
counts attention sees, whole text, rotary rows that follow the merged tokens, text masks,
attention backends and graph capture. A row without the feature a test needs (rotary
tables, a text mask) is skipped with the reason. What no family shares stays in the
family's own test module.
"""

from __future__ import annotations

import copy
import inspect
import math
import re
import warnings

import pytest
import torch

import toma
from tests.cases import cache_dit_settings, fused_calls, sdpa_keys
from tests.compat_cells import cell, rows, skip_or_fail
from tests.tiny_models import FAMILIES
from toma import compat
from toma.adapters.base import Hook, register_innermost, remove_hook
from toma.adapters.layouts import IMAGE_FIRST, TEXT_FIRST
from toma.adapters.merging import plan_group

NAMES = list(FAMILIES)


def batch_slice(kw: dict, b: int, batch: int) -> dict:
    """Sample ``b`` of a batch's inputs: tensors and lists with a batch dimension are cut."""
    out = {}
    for k, v in kw.items():
        if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == batch:
            v = v[b : b + 1]
        elif isinstance(v, list) and v and all(isinstance(t, torch.Tensor) and t.shape[0] == batch for t in v):
            v = [t[b : b + 1] for t in v]  # a tensor per block (Bria FIBO's text-encoder layers)
        elif isinstance(v, list) and len(v) == batch:
            v = v[b : b + 1]
        elif isinstance(v, dict):
            v = batch_slice(v, b, batch)
        elif hasattr(v, "layer_caches"):  # Qwen-Image 2.1's prefix cache: each layer's keys and values
            one = copy.deepcopy(v)
            for layer in one.layer_caches:
                layer.store(layer.k[b : b + 1], layer.v[b : b + 1])
            v = one
        out[k] = v
    return out


@pytest.mark.parametrize("name", rows("attention"))
def test_ratio_zero_and_remove_are_bitwise_identical(name):
    fam = FAMILIES[name]
    model, kw = fam.make(), fam.inputs(2)
    ref = fam.output(model, kw)
    toma.apply_toma(model, ratio=0.0, **fam.every_part())
    assert torch.equal(fam.output(model, kw), ref)
    patch = toma.apply_toma(model, ratio=0.5, **fam.every_part())
    assert patch.adapter == fam.adapter
    out = fam.output(model, kw)
    assert out.shape == ref.shape and torch.isfinite(out).all() and not torch.equal(out, ref)
    assert toma.remove_toma(model) and not hasattr(model, "_diffusers_hook")
    assert torch.equal(fam.output(model, kw), ref)


@pytest.mark.parametrize("name", NAMES)
def test_odd_and_non_square_grids_and_frame_counts_merge(name):
    # 5x7 tokens in 4x4 tiles: edge tiles padded on both sides (UNets: 4x12 and 10x14);
    # video with 1 or 3 frames
    fam = FAMILIES[name]
    model, kw = fam.make(), fam.odd(2)
    ref = fam.output(model, kw)
    patch = toma.apply_toma(model, ratio=0.5, **fam.options)
    out = fam.output(model, kw)
    assert out.shape == ref.shape and torch.isfinite(out).all() and not torch.equal(out, ref)
    plans = [p for _, p in patch.cache._plans.values()]
    assert plans and all(p.layout.num_tokens == fam.odd_tokens for p in plans)
    # each tile keeps half its real tokens, rounded half up, so K is at least N/2
    assert all(fam.odd_tokens / 2 <= p.num_merged < fam.odd_tokens for p in plans)
    toma.remove_toma(model)
    assert torch.equal(fam.output(model, kw), ref)


@pytest.mark.parametrize("name", NAMES)
def test_a_step_window_runs_the_other_steps_bitwise_unmerged(name):
    fam = FAMILIES[name]
    model, kw = fam.make(), fam.inputs(2)
    t = kw[fam.timestep]
    # two calls a step, as with CFG; the timestep falls (Z-Image's t, 1 - sigma, rises)
    steps = [1 - (1 - t) * f if fam.rising_timestep else t * f for f in (1.0, 1.0, 0.8, 0.8, 0.6)]
    calls = [{**kw, fam.timestep: step} for step in steps]
    base = [fam.output(model, c) for c in calls]
    toma.apply_toma(model, ratio=0.5, **fam.options)
    merged = [fam.output(model, c) for c in calls]
    toma.remove_toma(model)
    toma.apply_toma(model, ratio=0.5, stop_step=1, **fam.options)  # step 0 only: the first two calls
    windowed = [fam.output(model, c) for c in calls]
    for i in range(len(calls)):
        if i < 2:
            assert torch.equal(windowed[i], merged[i]) and not torch.equal(windowed[i], base[i])
        else:
            assert torch.equal(windowed[i], base[i])


@pytest.mark.parametrize("name", NAMES)
def test_tile_order_computes_what_raster_order_does(name, monkeypatch):
    # tokens kept in tile order between merges (two copies a forward) against every site
    # merging from raster order (gathers): the same plans and merges of the same values,
    # but attention sums its keys in another order, a few float32 ulps per op (~1e-7),
    # under 1e-5 through these models; merging itself moves outputs by ~1e-2
    from toma.adapters.state import PlanCache

    fam = FAMILIES[name]
    if not fam.tile_order:
        pytest.skip(f"{name}'s forwards always run in raster order")
    model, kw = fam.make(), fam.divided_inputs(2)
    toma.apply_toma(model, ratio=0.5, **fam.every_part())
    real, used = PlanCache.tile_order_layout, []
    monkeypatch.setattr(
        PlanCache, "tile_order_layout", lambda self, *a, **k: used.append(real(self, *a, **k)) or used[-1]
    )
    tiled = fam.output(model, kw)
    assert any(layout is not None for layout in used)  # the first run did keep tile order
    monkeypatch.setattr(PlanCache, "tile_order_layout", lambda self, *a, **k: None)
    raster = fam.output(model, kw)
    torch.testing.assert_close(tiled, raster, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_batch_elements_get_their_own_plans(name):
    # each sample's output is its batch-1 output: no sample's tokens choose another's
    # destinations. Not bitwise: batch-2 and batch-1 matmuls block their sums differently,
    # a few float32 ulps per op on unit-scale activations (~1e-7), ~1e-6 after the tiny
    # models' blocks (a family that rounds to bfloat16 inside its blocks: ``batch_atol``);
    # merging itself moves outputs by ~1e-2
    fam = FAMILIES[name]
    model, kw = fam.make(), fam.inputs(2)
    patch = toma.apply_toma(model, ratio=0.5, **fam.options)
    both = fam.output(model, kw)
    plans = [p for _, p in patch.cache._plans.values()]
    assert plans and all(p.dest.shape[0] == 2 for p in plans)
    assert any(not torch.equal(p.dest[0], p.dest[1]) for p in plans)
    for b in range(2):
        alone = fam.output(model, batch_slice(kw, b, 2))
        torch.testing.assert_close(both[b : b + 1], alone, rtol=1e-4, atol=fam.batch_atol)


@pytest.mark.parametrize("name", NAMES)
def test_a_deepcopy_merges_with_its_own_weights(name):
    fam = FAMILIES[name]
    model, kw = fam.make(), fam.inputs(2)
    toma.apply_toma(model, ratio=0.5, **fam.options)
    out = fam.output(model, kw)
    twin = copy.deepcopy(model)
    assert toma.get_toma(twin) is not None and toma.get_toma(twin) is not toma.get_toma(model)
    assert torch.equal(fam.output(twin, kw), out)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.9)  # the copy's hooks must run the copy's weights
    assert not torch.allclose(fam.output(twin, kw), out, atol=1e-4)
    assert toma.remove_toma(twin) and torch.equal(fam.output(model, kw), out)
    toma.remove_toma(model)


def loss_and_grads(fam, model, kw, between: dict | None = None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = fam.sample(model, kw).square().mean()
    if between is not None:
        fam.output(model, between)  # another call before the backward, as a distillation loop's
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("name", NAMES)
def test_checkpointed_gradients_equal_plain_ones(name):
    # a checkpointed block recomputes its forward in backward with the plans and token
    # order of that forward, whatever ran in between; the same float ops run again, and
    # only autograd's accumulation order can differ (1e-6 bounds that on these models,
    # whose largest gradients are ~1e-1)
    fam = FAMILIES[name]
    if not fam.checkpointing:
        pytest.skip(f"diffusers' checkpointed forward of {name} fails, unpatched too")
    model, kw = fam.make(), fam.inputs(2)
    other = fam.inputs(1)
    toma.apply_toma(model, ratio=0.5, **fam.options)
    plain = loss_and_grads(fam, model, kw)
    model.enable_gradient_checkpointing()
    checkpointed = loss_and_grads(fam, model, kw, between=other)
    assert len(plain) == len(checkpointed) > 0
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ what attention sees
def kept_tokens(grid: tuple[int, int, int], ratio: float, tile: int = 4) -> int:
    """Tokens left after merging ``grid`` at ``ratio``, counted tile by tile: 2-D tiles of
    ``tile x tile`` tokens (cut by the grid's edges, shrunk to a smaller grid), each keeping
    ``round(p * (1 - ratio))`` of its ``p`` tokens, rounded half up, at least one."""
    t, h, w = grid
    th, tw = min(tile, h), min(tile, w)
    kept = 0
    for top in range(0, h, th):
        for left in range(0, w, tw):
            p = min(th, h - top) * min(tw, w - left)
            kept += max(1, min(p, math.floor(p * (1 - ratio) + 0.5)))
    return t * kept


def level_grid(fam, downsample: int) -> tuple[int, int, int]:
    """The family's token grid at a UNet level's downsample (strided convolutions round up)."""
    t, h, w = fam.grid
    return (t, -(-h // downsample), -(-w // downsample))


def attention_targets(patch) -> list[tuple[str, torch.nn.Module, int]]:
    """The merged attention and cross-attention modules: ``(name, module, downsample)``;
    a spanning site's is the module in between that computes attention."""
    found = []
    for target in patch.patched:
        site = target.site
        part = (
            site.part if site is not None else {"attn1": "attn", "attn2": "cross"}.get(target.name.rsplit(".", 1)[-1])
        )
        if part in ("attn", "cross"):
            module = target.module.get_submodule(site.span.call) if site is not None and site.span else target.module
            found.append((target.name, module, target.downsample))
    return found


def record_projections(targets, keep: bool = False):
    """Per linear layer of each module in ``targets``: the token count (and, with ``keep``, a
    copy) of its input at each call, keyed ``module name:layer name``. Linear layers run
    inside the merge hooks, so they see the tokens attention computes on."""
    seen: dict[str, list] = {}
    handles = []
    for name, module, _ in targets:
        for sub, layer in module.named_modules():
            if isinstance(layer, torch.nn.Linear):
                key = f"{name}:{sub}"

                def hook(mod, args, key=key):
                    x = args[0]
                    seen.setdefault(key, []).append(x.detach().clone() if keep else x.shape[-2])

                handles.append(layer.register_forward_pre_hook(hook))
    return seen, handles


def projections(fam, model, kw, options: dict | None, keep: bool = False):
    """:func:`record_projections` of one call of ``model`` patched with ``options`` (None:
    unpatched, hooks on the modules that ``options=fam.every_part()`` would merge)."""
    patch = toma.apply_toma(model, **{"ratio": 0.5, **(options or fam.every_part())})
    targets = attention_targets(patch)
    if options is None:
        toma.remove_toma(model)
    seen, handles = record_projections(targets, keep)
    try:
        fam.output(model, kw)
    finally:
        for handle in handles:
            handle.remove()
    return patch, targets, seen


def auto_side(patch, grid: tuple[int, int, int]) -> int:
    """``tile_size="auto"``'s side on ``grid``, from the family's reference frame: 2 where
    the frame has under half its tokens, else 4 (UNets, which have none: 4)."""
    spec = getattr(patch._adapter, "spec", None)
    reference = None if spec is None else spec.reference
    if reference is None:
        return 4
    return 2 if 2 * grid[1] * grid[2] < reference[0] * reference[1] else 4


@pytest.mark.parametrize("tile", [4, "auto"])
@pytest.mark.parametrize("name", NAMES)
def test_attention_sees_the_token_counts_the_ratio_implies(name, tile):
    # every projection of a merged attention that takes the image tokens takes K of them
    # in place of N (K counted from the grid, the tiles and the ratio), whatever text
    # or conditioning tokens join them; a projection of text alone takes all of it
    fam = FAMILIES[name]
    model, kw = fam.make(), fam.inputs(1)  # batch 1: one call per module, also where samples would run one each
    _, targets, before = projections(fam, model, kw, None)
    ratio = 0.45  # shares that round: a 16-token tile keeps 9 (8.8), an 8-token edge tile 4 (4.4)
    patch, _, after = projections(fam, model, kw, {**fam.every_part(), "ratio": ratio, "tile_size": tile})
    downsample = {name: ds for name, _, ds in targets}
    assert before and before.keys() == after.keys()
    merged = 0
    for key, counts in before.items():
        grid = level_grid(fam, downsample[key.split(":")[0]])
        side = auto_side(patch, grid) if tile == "auto" else tile
        n, k = math.prod(grid), kept_tokens(grid, ratio, side)
        assert k == patch.cache.layout(*grid, ratio=ratio).num_merged  # the engine's layout counts alike
        expected = [c - n + k if c >= n else c for c in counts]  # text alone is fewer tokens than any grid here
        assert after[key] == expected, key
        merged += sum(c >= n for c in counts)
    assert merged >= len(targets)  # every merged module projects image tokens


def with_other_image(kw: dict) -> dict:
    """The call with other image latents (and reference images'), the same text."""
    if isinstance(kw.get("x"), list):  # Z-Image: a list of per-sample latents
        g = torch.Generator().manual_seed(11)
        return {**kw, "x": [torch.randn(t.shape, generator=g) for t in kw["x"]]}
    key = "sample" if "sample" in kw else "hidden_states"
    return {**kw, key: torch.randn(kw[key].shape, generator=torch.Generator().manual_seed(11))}


@pytest.mark.parametrize("name", NAMES)
def test_text_is_never_merged(name):
    # in the first merged block, nothing merged has reached the text yet: the rows its
    # attentions' projections take that do not depend on the image (the text's) are
    # bitwise the unmerged model's, all of them and in their place at the start or end of
    # the sequence; later blocks' text counts are the test above's
    fam = FAMILIES[name]
    if not fam.text_in_blocks:
        pytest.skip(f"{name}'s merged passes take the text as cached keys and values only")
    model, kw = fam.make(), fam.inputs(1)
    _, targets, plain = projections(fam, model, kw, None, keep=True)
    _, _, other = projections(fam, model, with_other_image(kw), None, keep=True)
    _, _, merged = projections(fam, model, kw, fam.every_part(), keep=True)
    # the first merged block that takes text (FLUX.3's image blocks before its single-stream
    # ones see the image alone; its text runs through blocks of its own, never merged)
    for block in dict.fromkeys(target[0].rsplit(".", 1)[0] for target in targets):
        checked = 0
        for key in (k for k in plain if k.split(":")[0].rsplit(".", 1)[0] == block):
            a, b, m = plain[key][0][0], other[key][0][0], merged[key][0][0]  # first call, sample 0: (S, C)
            text = (a == b).all(-1)
            count = int(text.sum())
            if count == 0:  # image tokens, or text after attending to them
                continue
            lead = bool(text[:count].all())
            assert lead or text[-count:].all(), f"{key}: the text rows are not one block at an end of the sequence"
            rows = slice(0, count) if lead else slice(m.shape[0] - count, m.shape[0])
            assert torch.equal(m[rows], a[:count] if lead else a[-count:]), key
            checked += 1
        if checked:
            break
    assert checked  # every family has text in a merged block (joint or cross-attention)


# ------------------------------------------------------------------ rotary tables
class CallSpy(Hook):
    """Records the arguments of each call of the module it is registered on."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def pre_forward(self, module, *args, **kwargs):
        self.calls.append((args, kwargs))
        return args, kwargs


def tables_of(rotary, args: tuple, kwargs: dict) -> tuple:
    """The rotary tables a call got, as a tuple."""
    tables = args[rotary.index] if rotary.index is not None and len(args) > rotary.index else kwargs[rotary.name]
    return (tables,) if isinstance(tables, torch.Tensor) else tuple(tables)


def leaves(item) -> list:
    """The tensors (and Nones) of a rotary item, nested tuples flattened in order."""
    return [t for part in item for t in leaves(part)] if isinstance(item, (tuple, list)) else [item]


def rotary_calls(fam, model, kw, patch) -> dict[str, list]:
    """The calls of every merged site that takes rotary tables, recorded inside toma's hooks
    (what the family's processor receives) when ``model`` is patched, else as the model makes them."""
    calls: dict[str, list] = {}
    spied = []
    for target in patch.patched:
        site = target.site
        if site is not None and site.rotary is not None:
            module = target.module.get_submodule(site.span.call) if site.span else target.module
            register_innermost(module, CallSpy(calls.setdefault(target.name, [])), "spy")
            spied.append(module)
    fam.output(model, kw)
    for module in spied:
        remove_hook(module, "spy")
    return calls


@pytest.mark.parametrize("layout", ["tiled", "padded"])
@pytest.mark.parametrize("name", NAMES)
def test_rotary_rows_are_the_destinations(name, layout):
    # a merged token takes the position of its destination: the image rows of the tables a
    # merged attention receives are the unmerged tables' rows at the plan's destination
    # tokens (raster index), in the order of the merged tokens; the text's and conditioning
    # tokens' rows pass whole, before them. Batch 2, each sample with its own plan; tokens
    # in tile order (the tables reordered with them) or, on a grid the tiles pad, in raster order
    fam = FAMILIES[name]
    model, kw = fam.make(), (fam.divided_inputs if layout == "tiled" else fam.odd)(2)
    patch = toma.apply_toma(model, ratio=0.5, **fam.options)
    sites = {t.name: t.site for t in patch.patched if t.site is not None and t.site.rotary is not None}
    if not sites:  # positions from convolutions (UNets) or added to the tokens before the blocks (SD3, PixArt)
        pytest.skip(f"no merged site of {name} takes rotary tables")
    toma.remove_toma(model)
    full = rotary_calls(fam, model, kw, toma.apply_toma(model, ratio=0.0, **fam.options))  # ratio 0: the model's own
    toma.remove_toma(model)
    patch = toma.apply_toma(model, ratio=0.5, **fam.options)
    merged = rotary_calls(fam, model, kw, patch)
    grid = patch.cache.base_grid
    assert patch.cache.layout(*grid).padded == (layout == "padded")
    n = math.prod(grid)
    tokens = kw.get("hidden_states")
    extra = (
        tokens.shape[1] - n if tokens is not None and tokens.ndim == 3 else 0
    )  # conditioning tokens after the image's
    if (
        tokens is not None and tokens.ndim == 6
    ):  # (B, items, C, T, H, W): JoyImage's reference items, after the generated one
        extra = (tokens.shape[1] - 1) * n
    for target, site in sites.items():
        rotary = site.rotary
        [plan] = [p for key, (_, p) in patch.cache._plans.items() if key[0] == plan_group(site, grid)]
        dest = plan.dest_tokens
        assert dest.shape[0] == 2 and not torch.equal(dest[0], dest[1])
        [(args, kwargs)] = full[target]  # one unmerged call
        whole = tables_of(rotary, args, kwargs)
        wanted = range(len(whole)) if rotary.items is None else rotary.items
        # the shared tables' processors run once per sample; the others' once per batch
        calls = merged[target]
        assert len(calls) == (2 if rotary.shared else 1), target
        for b in range(2):
            got = tables_of(rotary, *calls[b if rotary.shared else 0])
            # an item may nest its tables (JoyImage's ((cos, sin), text)): compare tensor by tensor
            pairs = [(i, f, g) for i, (fi, gi) in enumerate(zip(whole, got)) for f, g in zip(leaves(fi), leaves(gi))]
            assert len(pairs) == sum(len(leaves(item)) for item in whole)
            for i, f, g in pairs:
                if f is None or g is None:
                    assert f is None and g is None
                elif i not in wanted:
                    assert torch.equal(g, f)  # e.g. Qwen-Image's text table
                elif site.layout == IMAGE_FIRST:  # (B, N + T, ...) -> (B, K + T, ...): the image's rows first
                    assert torch.equal(g[b], torch.cat([f[b, :n][dest[b]], f[b, n:]])), (target, i)
                elif (
                    site.layout == TEXT_FIRST and not rotary.shared
                ):  # (B, T + N, ...) -> (B, T + K, ...): the text first
                    lead = f.shape[1] - n
                    fb = f[0 if f.shape[0] == 1 else b]
                    assert torch.equal(g[b], torch.cat([fb[:lead], fb[lead:][dest[b]]])), (target, i)
                elif rotary.shared:  # (lead + N + extra, ...) -> (lead + extra + K, ...)
                    lead = f.shape[0] - n - extra
                    image = f[lead : lead + n]
                    assert torch.equal(g, torch.cat([f[:lead], f[lead + n :], image[dest[b]]])), (target, i)
                else:  # (1 or B, N, ...) -> (B, K, ...)
                    assert f.shape[1] == n
                    assert torch.equal(g[b], f[0 if f.shape[0] == 1 else b][dest[b]]), (target, i)


# ------------------------------------------------------------------ text masks
MASK_KEYWORDS = ("encoder_attention_mask", "encoder_hidden_states_mask")


def toma_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "ToMA" in str(w.message)]


@pytest.mark.parametrize("name", NAMES)
def test_text_masks(name, monkeypatch):
    fam = FAMILIES[name]
    model, kw = fam.make(), fam.inputs(2)
    params = inspect.signature(type(model).forward).parameters
    assert fam.text_mask is None or fam.text_mask in params  # the table says what the forward takes
    if not fam.text_in_blocks:  # its text mask hides cached keys: tests/adapters/test_qwenimage21.py
        pytest.skip(f"{name}'s merged passes take the text as cached keys and values only")
    if fam.text_mask is None:
        assert not set(MASK_KEYWORDS) & set(params)
        if fam.joint_mask is None:
            pytest.skip(f"{name}'s forward takes no text mask")
        joint_masks_merge(fam, model, kw, monkeypatch)
        return
    key, text = fam.text_mask, kw["encoder_hidden_states"].shape[1]
    # in the dtype of the row's own mask: Krea 2 reads a float mask as an additive bias
    dtype = kw[key].dtype if isinstance(kw.get(key), torch.Tensor) else torch.float32
    ones = {**kw, key: torch.ones(2, text, dtype=dtype)}
    padded = {**kw, key: torch.ones(2, text, dtype=dtype)}
    padded[key][1, -2:] = 0  # the second sample's last two text tokens are padding
    reference = fam.output(model, ones)
    toma.apply_toma(model, ratio=0.5, **fam.every_part())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged = fam.output(model, ones)
        if params[key].default is None:  # a mask of ones hides nothing: as without one
            # a mask adds 0 to every score, but SDPA takes another CPU kernel with a mask
            # than without, whose sums differ by float32 ulps (~1e-7 a op, under 1e-5
            # through these blocks); merging moves the outputs by more than 1e-3
            unmasked = fam.output(model, {k: v for k, v in kw.items() if k != key})
            torch.testing.assert_close(merged, unmasked, rtol=1e-5, atol=1e-5)
        out = fam.output(model, padded)
        # padded tokens are hidden from every attention, merged or not: exp of a score
        # biased by -1e4 or -inf underflows to exactly 0, so their values change nothing
        changed = {**padded, "encoder_hidden_states": kw["encoder_hidden_states"].clone()}
        changed["encoder_hidden_states"][1, -2:] = 100.0
        torch.testing.assert_close(fam.output(model, changed), out, rtol=0, atol=1e-6)
    assert toma_warnings(caught) == []  # it merged, mask and all: no fallback
    assert (merged - reference).abs().max() > 1e-3
    unhidden = {**changed, key: ones[key]}
    assert not torch.allclose(fam.output(model, unhidden)[1], merged[1], atol=1e-3)  # they matter unmasked


def without_last_text(kw: dict, count: int) -> dict:
    """The call without its last ``count`` text tokens (and their ids, and their rows of
    per-block text such as Bria FIBO's text-encoder layers)."""
    ids, cut = kw["txt_ids"], {}
    if "text_encoder_layers" in kw:
        cut["text_encoder_layers"] = [t[:, :-count] for t in kw["text_encoder_layers"]]
    return {
        **kw,
        **cut,
        "encoder_hidden_states": kw["encoder_hidden_states"][:, :-count],
        "txt_ids": ids[..., :-count, :],
    }


def joint_masks_merge(fam, model, kw, monkeypatch) -> None:
    # a mask over the joint [text; image] sequence that hides text padding holds one value
    # over the image: every merged call takes its slice over the merged tokens, as if the
    # padded text were not there. One that differs over the image keys (a structured mask)
    # has no merged form: those calls run unmerged, bitwise, with one warning
    # the row's own mask (Chroma's attention_mask, Bria FIBO's in joint_attention_kwargs): replaced here
    kw = {k: v for k, v in kw.items() if k not in ("attention_mask", "joint_attention_kwargs")}
    text, tokens = kw["encoder_hidden_states"].shape[1], kw["hidden_states"].shape[1]
    keep = torch.ones(2, text + tokens, dtype=torch.bool)
    keep[:, text - 2 : text] = False
    structured = keep.clone()
    structured[:, text + 1] = False  # one image key hidden
    reference = fam.output(model, fam.joint_mask(kw, structured))
    patch = toma.apply_toma(model, ratio=0.5, **fam.every_part())
    keys = sdpa_keys(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        masked = fam.output(model, fam.joint_mask(kw, keep))
    assert toma_warnings(caught) == []  # it merged, mask and all
    kept = {p.num_merged for _, p in patch.cache._plans.values()}
    assert len(kept) == 1 and kept.pop() < math.prod(fam.grid)
    merged_keys = text + tokens - math.prod(fam.grid) + patch.cache.layout(*fam.grid, ratio=0.5).num_merged
    assert keys and set(keys) == {merged_keys}  # every attention ran on the merged tokens
    # hidden keys add exp(-inf) = 0 to the softmax; the sums still run over two more keys,
    # in another kernel (masked SDPA), so they differ by float32 ulps (measured 5e-7)
    torch.testing.assert_close(masked, fam.output(model, without_last_text(kw, 2)), rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fam.output(model, fam.joint_mask(kw, structured))
        fam.output(model, fam.joint_mask(kw, structured))
    assert len(toma_warnings(caught)) == 1 and "attention_mask" in toma_warnings(caught)[0]
    assert torch.equal(out, reference)


# ------------------------------------------------------------------ attention backends
def counting_backend(monkeypatch, backend: str) -> list[int]:
    """Query lengths of the calls diffusers' dispatcher makes to ``backend``'s function."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    calls: list[int] = []
    name = AttentionBackendName(backend)
    real = _AttentionBackendRegistry._backends[name]
    monkeypatch.setitem(
        _AttentionBackendRegistry._backends,
        name,
        lambda query, *a, **k: calls.append(query.shape[1]) or real(query, *a, **k),
    )
    return calls


@pytest.mark.parametrize("name", NAMES)
def test_set_attention_backend_computes_what_the_default_does(name, monkeypatch):
    # merged attention runs the family's own processor, so diffusers' dispatcher sends it to
    # the backend the user set: "native" is the default's function (bitwise), and
    # "_native_math" torch's math kernel in place of the fused CPU one, which sums in
    # another order (a few float32 ulps an op, under 1e-5 through these blocks; merging
    # moves outputs by more than 1e-4, ten times that, and by more than 1e-3 but where
    # proportional attention brings them close: Z-Image's, 5e-4). Processors that call SDPA themselves (the UNets',
    # PixArt's, CogVideoX's) keep doing so, and dispatch nothing
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    # set_attention_backend also sets the process-wide backend, which reset_attention_backend
    # leaves: start from the default and put back what was there
    monkeypatch.setattr(_AttentionBackendRegistry, "_active_backend", AttentionBackendName.NATIVE)
    fam = FAMILIES[name]
    model, kw = fam.make(), fam.inputs(2)
    math_calls = counting_backend(monkeypatch, "_native_math")
    model.set_attention_backend("_native_math")
    fam.output(model, kw)
    dispatched = len(math_calls)
    model.reset_attention_backend()
    _AttentionBackendRegistry._active_backend = AttentionBackendName.NATIVE
    reference = fam.output(model, kw)
    toma.apply_toma(model, ratio=0.5, **fam.options)
    default = fam.output(model, kw)
    assert (default - reference).abs().max() > 1e-4
    model.set_attention_backend("native")
    assert torch.equal(fam.output(model, kw), default)
    math_calls.clear()
    model.set_attention_backend("_native_math")
    torch.testing.assert_close(fam.output(model, kw), default, rtol=1e-5, atol=1e-5)
    # the unmerged model's dispatched calls all still reach the backend (once per sample
    # where a processor takes one rotary table for the batch)
    assert len(math_calls) >= dispatched > 0 or len(math_calls) == dispatched == 0


# ------------------------------------------------------------------ torch.compile
def first_blocks(patch) -> list[str]:
    """The first merged block of each stack: a UNet's transformer (its ``Transformer2DModel``),
    a transformer family's block."""
    owners: dict[str, str] = {}
    for target in patch.patched:
        if patch.adapter == "unet":
            owner = target.name.rpartition(".transformer_blocks.")[0]
            stack = "unet"  # one is enough: every level's transformers are alike
        else:
            # the block: the name up to its index in the stack (FLUX.3's stack is mode_blocks.image)
            parts = target.name.split(".")
            at = next(i for i, part in enumerate(parts) if part.isdigit())
            stack, owner = ".".join(parts[:at]), ".".join(parts[: at + 1])
        owners.setdefault(stack, owner)
    return list(owners.values())


@pytest.mark.parametrize("name", rows("compile"))
def test_merged_blocks_compile_without_graph_breaks(name):
    # Dynamo's graph capture does not depend on the backend, and tracing a whole tiny model
    # costs 5-30 s here; the merge path's hooks sit on the blocks' sub-modules, so the first
    # merged block of each stack is traced, from its recorded call, building its plan (the
    # step hook on the model reads the grid and timestep into Python on purpose, outside
    # the merge path: tests/adapters/test_compile.py). The forward before builds what lives as long
    # as the patch (tile layouts' index tensors); a plan is built at every step
    fam = FAMILIES[name]
    model, kw = fam.make(), fam.inputs(1)
    patch = toma.apply_toma(model, ratio=0.5, **fam.every_part())
    calls, handles = {}, []
    for owner in first_blocks(patch):
        handles.append(
            model.get_submodule(owner).register_forward_pre_hook(
                lambda mod, a, k, owner=owner: calls.setdefault(owner, (a, k)), with_kwargs=True
            )
        )
    fam.output(model, kw)
    for handle in handles:
        handle.remove()
    assert calls.keys() == set(first_blocks(patch))
    breaks = {}
    for owner, (args, kwargs) in calls.items():
        patch.cache.forward.plans.clear()
        torch._dynamo.reset()
        with torch.no_grad():
            explained = torch._dynamo.explain(model.get_submodule(owner))(*args, **kwargs)
        assert explained.graph_count >= 1
        breaks[owner] = break_sites(explained)
        assert patch.cache.forward.plans  # the traced call built a plan
    torch._dynamo.reset()
    own = {owner: set() for owner in calls}
    if fam.adapter in compat.OWN_GRAPH_BREAKS:  # the model breaks graphs itself (its ✔'s note): toma must add none
        toma.remove_toma(model)
        for owner, (args, kwargs) in calls.items():
            with torch.no_grad():
                own[owner] = break_sites(torch._dynamo.explain(model.get_submodule(owner))(*args, **kwargs))
            torch._dynamo.reset()
        assert all(own.values())
    assert breaks == own


def break_sites(explained) -> set[tuple[str, str]]:
    """Where a trace broke: each break's reason and the line of code it broke at. As a set:
    a break inside a hooked module's call is hit once more, one frame deeper, where Dynamo
    resumes the hook's frame after it."""
    return {
        (r.reason.splitlines()[0], f"{r.user_stack[-1].filename}:{r.user_stack[-1].lineno}" if r.user_stack else "")
        for r in explained.break_reasons
    }


def test_a_new_padded_grid_compiles_without_graph_breaks():
    # the first call on a padded grid builds the layout's index tensors inside the compiled
    # region: with boolean selections there (nonzero, a data-dependent shape) Dynamo broke
    # the graph in toma.core.tiling.layout_index, once per grid
    fam = FAMILIES["sd3"]  # 8 x 10 tokens: the 4x4 tiles pad the last column of tiles
    model, kw = fam.make(), fam.inputs(1)
    patch = toma.apply_toma(model, ratio=0.5, tile_size=4, **fam.options)
    assert patch.cache.layout(*fam.grid).padded
    calls = []
    handle = model.transformer_blocks[0].register_forward_pre_hook(
        lambda m, a, k: calls.append((a, k)), with_kwargs=True
    )
    fam.output(model, kw)
    handle.remove()
    patch.cache.forward.plans.clear()
    patch.cache._indices.clear()  # as at the first call on this grid
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model.transformer_blocks[0])(*calls[0][0], **calls[0][1])
    torch._dynamo.reset()
    assert [r.reason.splitlines()[0] for r in explained.break_reasons] == []


# the attention projections of every row's model, by the names its diffusers class gives them
PROJECTIONS = ["to_q", "to_k", "to_v", "to_query", "to_key", "to_value", "img_attn_qkv"]


@pytest.mark.parametrize("name", NAMES)
def test_a_lora_added_before_or_after_apply_gives_the_same_output(name):
    # LoRA wraps the projections inside the modules ToMA hooks around, so adding it before
    # or after apply_toma runs the same computation (bitwise), and removal leaves the LoRA
    peft = pytest.importorskip("peft")
    fam = FAMILIES[name]
    model, kw = fam.make(), fam.inputs(1)
    if not hasattr(model, "add_adapter"):
        pytest.skip(f"diffusers' {type(model).__name__} takes no adapter (no PeftAdapterMixin)")

    def add_lora(m) -> None:
        torch.manual_seed(7)  # random, non-zero up-projections: the adapter changes the output
        m.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, target_modules=PROJECTIONS, init_lora_weights=False))

    base = fam.output(model, kw)
    add_lora(model)
    lora = fam.output(model, kw)
    assert not torch.equal(lora, base)
    toma.apply_toma(model, ratio=0.5, **fam.options)
    lora_then_toma = fam.output(model, kw)
    assert torch.isfinite(lora_then_toma).all() and not torch.equal(lora_then_toma, lora)

    other = fam.make()
    toma.apply_toma(other, ratio=0.5, **fam.options)
    add_lora(other)
    assert torch.equal(fam.output(other, kw), lora_then_toma)
    toma.remove_toma(other)
    assert torch.equal(fam.output(other, kw), lora)


@pytest.mark.parametrize("name", NAMES)
def test_fused_projections_keep_merging(name):
    # fused projections compute q, k and v from one matmul of the merged tokens: the same
    # values to float32 rounding (one matmul's sums blocked another way, ~1e-7 per op,
    # under 1e-5 through the tiny models; merging moves outputs by ~1e-2)
    fam = FAMILIES[name]
    plain, kw = fam.make(), fam.inputs(1)
    if not hasattr(plain, "fuse_qkv_projections"):
        pytest.skip(f"diffusers' {type(plain).__name__} has no fuse_qkv_projections")
    try:
        calls = fused_calls(plain)
        fam.output(plain, kw)
    except Exception as error:  # noqa: BLE001 - the reason is the skip's message
        pytest.skip(f"{type(plain).__name__} fails to fuse or run fused, unpatched: {error!r}"[:300])
    if not calls:
        pytest.skip(f"{type(plain).__name__}'s processors never run the fused projections, unpatched")
    options = fam.options
    if name == "cogvideox":  # its fused processor takes no mask: test_compat's test_fused_cogvideox_drops_the_bias
        options = {**options, "proportional_attention": False}
    model = fam.make()
    toma.apply_toma(model, ratio=0.5, **options)
    merged = fam.output(model, kw)
    assert not torch.equal(merged, fam.output(fam.make(), kw))
    calls = fused_calls(model)
    torch.testing.assert_close(fam.output(model, kw), merged, rtol=1e-4, atol=1e-5)
    assert calls  # the fused projections did run, merged


def run_step(fam, kw: dict, i: int) -> dict:
    """Step ``i`` of a stand-in run from the call ``kw``: latents (``hidden_states``, or
    Z-Image's list ``x`` of one per sample) shrunk by 2% a step, the timestep moving with
    them (falling, or rising where the family's rises)."""
    f = 1 - 0.02 * i
    step = {**kw, "x": [x * f for x in kw["x"]]} if "x" in kw else {**kw, "hidden_states": kw["hidden_states"] * f}
    t = kw[fam.timestep]
    step[fam.timestep] = 1 - (1 - t) * f if fam.rising_timestep else t * f
    return step


def layer_calls(model, names) -> dict:
    """Calls of the first linear layer inside each named module: a skipped module's own
    call hooks may still fire, its layers' do not."""
    calls = {}
    for n in names:
        linear = next(m for m in model.get_submodule(n).modules() if isinstance(m, torch.nn.Linear))
        calls[n] = []
        linear.register_forward_hook(lambda m, a, o, c=calls[n]: c.append(1))
    return calls


def either_order(fam, enable, probe: str, denoise, removed) -> list[torch.Tensor]:
    """A cache (``enable(model)``) and ToMA on a fresh model of ``fam``, ToMA first, then the
    cache first: each run's outputs (``denoise(model)``). In each, the merged module
    ``probe`` must run on some steps and be skipped on others; ``removed(model)`` then checks
    the model after ``remove_toma``."""
    outputs = []
    for toma_first in (True, False):
        model = fam.make()
        if toma_first:
            toma.apply_toma(model, ratio=0.5, **fam.options)
        enable(model)
        if not toma_first:
            toma.apply_toma(model, ratio=0.5, **fam.options)
        calls = layer_calls(model, [probe])[probe]
        outputs.append(denoise(model))
        assert 0 < len(calls) < len(outputs[-1])  # the probe ran merged on some steps, skipped on others
        toma.remove_toma(model)
        removed(model)
    return outputs


def block_cache(cache: str, steps: int, merged: list[str], clock: list[float]):
    """diffusers' cache ``cache`` as it acts within a ``steps``-step run: FirstBlockCache and
    MagCache skip the blocks after the first while the residual barely changes (MagCache by
    the magnitude ratios it is given: here 1, so it skips from step 2 on), TaylorSeer
    predicts the ``merged`` modules' outputs between the steps it computes, Pyramid Attention
    Broadcast reuses the merged attention modules' outputs every other step, and FasterCache
    extrapolates them every other step."""
    from diffusers.hooks import (
        FasterCacheConfig,
        FirstBlockCacheConfig,
        MagCacheConfig,
        PyramidAttentionBroadcastConfig,
        TaylorSeerCacheConfig,
    )

    if cache == "fbcache":
        return FirstBlockCacheConfig(threshold=0.5)
    if cache == "fastercache":
        # single-batch runs (no classifier-free guidance): guidance-distilled, so it only
        # extrapolates the merged attention modules' outputs every other step below t=681 (its
        # default range; ``clock`` is the run's timestep on that scale, and the steps above it
        # fill its cache), and its tensor format, read for the guidance batch, is unused
        return FasterCacheConfig(
            spatial_attention_block_identifiers=tuple(f"^{re.escape(n)}$" for n in merged),
            spatial_attention_block_skip_range=2,
            current_timestep_callback=lambda: clock[0],
            attention_weight_callback=lambda module: 0.5,
            is_guidance_distilled=True,
            tensor_format="BCHW",
        )
    if cache == "pab":  # its identifiers are searched for in module names: each merged one, whole
        return PyramidAttentionBroadcastConfig(
            spatial_attention_block_identifiers=tuple(f"^{re.escape(n)}$" for n in merged),
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 1001),
            current_timestep_callback=lambda: clock[0],  # inside that range at every step
        )
    if cache == "magcache":
        return MagCacheConfig(threshold=1.0, num_inference_steps=steps, mag_ratios=[1.0] * steps, retention_ratio=0.2)
    # its default patterns name Flux's block layout; each family's merged modules by name
    return TaylorSeerCacheConfig(
        cache_interval=3,
        disable_cache_before_step=2,
        taylor_factors_dtype=torch.float32,
        cache_identifiers=[re.escape(n) for n in merged],
    )


# FirstBlockCache on the rows the compatibility matrix says it composes with; the other caches on every row
DIFFUSERS_CACHES = rows("fbcache", compat.YES, "fbcache") + [
    pytest.param(name, cache, id=f"{name}-{cache}")
    for cache in ("magcache", "taylorseer", "pab", "fastercache")
    for name in NAMES
]


@pytest.mark.filterwarnings("ignore:.*FasterCache")
@pytest.mark.parametrize("name,cache", DIFFUSERS_CACHES)
def test_diffusers_caches_compose_in_either_order(name, cache, request):
    # diffusers' caches skip blocks or modules on some steps; ToMA merges inside the steps
    # that do run. Enabling either first gives the same outputs (bitwise), the cache does skip
    # merged modules on some steps, and removing both gives back the unpatched model. A
    # falling timestep and slowly shrinking latents stand in for a run.
    fam = FAMILIES[name]
    kw = fam.inputs(1)
    if "sample" in kw:
        skip_or_fail(request, f"{name} is a UNet: neither diffusers nor cache-dit caches its blocks")
    steps, clock = 6, [1000.0]

    def denoise(model, steps: int = steps) -> torch.Tensor:
        outs = []
        for i in range(steps):
            clock[0] = 1000.0 if i < 2 else 500.0  # the timestep on diffusers' 0-1000 scale
            with model.cache_context("cond"):
                outs.append(fam.output(model, run_step(fam, kw, i)))
        return torch.stack(outs)

    merged = fam.make()
    names = [p.name for p in toma.apply_toma(merged, ratio=0.5, **fam.options).patched]
    config = block_cache(cache, steps, names, clock)
    plain = fam.make()
    try:
        plain.enable_cache(config)
        calls = layer_calls(plain, names)
        denoise(plain)
    except Exception as error:  # noqa: BLE001 - the reason is the skip's message
        skip_or_fail(request, f"{cache} fails on {type(plain).__name__}, unpatched: {error!r}"[:300])
    # a merged module the cache skips on some steps, unpatched (not in the first block, nor
    # in a stack the cache leaves alone, as Wan VACE's control blocks)
    probe = next((n for n in names if 0 < len(calls[n]) < steps), None)
    if probe is None:
        skip_or_fail(request, f"{cache} skips no merged module of {type(plain).__name__}, unpatched")
    toma_only = denoise(merged)

    def removed(model):
        model.disable_cache()
        assert torch.equal(denoise(model, 2), denoise(fam.make(), 2))

    outputs = either_order(
        fam, lambda m: m.enable_cache(block_cache(cache, steps, names, clock)), probe, denoise, removed
    )
    assert torch.equal(outputs[0], outputs[1])
    assert not torch.equal(outputs[0], toma_only)  # the cache acted


# each reason a ✖ cell of FirstBlockCache gives, as diffusers (0.42) says it: its error's type and text
FIRST_BLOCK_CACHE_ERRORS = {
    compat.FIRST_BLOCK_CACHE["unet"]: (AttributeError, "has no attribute 'enable_cache'"),
    compat.FIRST_BLOCK_CACHE["sd3"]: (AttributeError, "has no attribute 'enable_cache'"),
    compat.FIRST_BLOCK_CACHE["ltx2"]: (ValueError, r"Model class .*Block'> not registered"),
    compat.FIRST_BLOCK_CACHE["flux2"]: (TypeError, r"unsupported operand type\(s\) for -: 'Tensor' and 'list'"),
    # the same missing argument: a ValueError when the test runs alone, a KeyError in CI's full
    # run, where earlier tests have been through diffusers' hooks first (not traced further)
    compat.FIRST_BLOCK_CACHE["kandinsky5"]: ((ValueError, KeyError), "'hidden_states'"),
}


@pytest.mark.parametrize("name", rows("fbcache", compat.NO))
def test_first_block_cache_fails_unpatched_where_the_matrix_says(name):
    # the matrix's ✖ cells: diffusers' FirstBlockCache fails on the model before ToMA is
    # involved, with the error its reason names (when a diffusers release makes it run, this
    # fails: the cell becomes ✔)
    from diffusers.hooks import FirstBlockCacheConfig

    fam = FAMILIES[name]
    model, kw = fam.make(), fam.inputs(1)
    error, text = FIRST_BLOCK_CACHE_ERRORS[cell(fam.adapter, "fbcache").reason]
    with pytest.raises(error, match=text):
        model.enable_cache(FirstBlockCacheConfig(threshold=0.5))
        for i in range(2):
            with model.cache_context("cond"):
                fam.output(model, run_step(fam, kw, i))


# cache-dit's DBCache on the rows the compatibility matrix says it composes with; its other
# kinds on every row
CACHE_DIT = rows("cache_dit", compat.YES, "dbcache") + [
    pytest.param(name, kind, id=f"{name}-{kind}") for kind in ("taylorseer", "dbprune") for name in NAMES
]


@pytest.mark.parametrize("name,kind", CACHE_DIT)
def test_cache_dit_composes_in_either_order(name, kind, request):
    # cache-dit on the bare transformer, through its own block adapter for the class: DBCache
    # (its first block computing, the rest skipped while the residual barely changes), the
    # same with its TaylorSeer calibrator (which predicts the skipped residual), or DBPrune
    # (each block after the first skipped on its own).
    # Enabled before or after ToMA it gives the same outputs (bitwise), it skips merged
    # modules on some steps, and removing ToMA leaves the cache alone working as on a model
    # ToMA never touched; disabling it too gives back the unpatched model.
    cache_dit = pytest.importorskip("cache_dit")  # CI installs it (.ci/run)
    from toma.tools.eval.caches import quiet_cache_dit

    quiet_cache_dit()
    fam = FAMILIES[name]
    kw = fam.inputs(1)
    if "sample" in kw:
        skip_or_fail(request, f"{name} is a UNet: neither diffusers nor cache-dit caches its blocks")
    steps = 6

    def settings(threshold: float) -> dict:
        # every call a step of its own (no separate classifier-free guidance batches)
        return cache_dit_settings(kind, steps, threshold, separate_cfg=False)

    def denoise(model) -> torch.Tensor:
        return torch.stack([fam.output(model, run_step(fam, kw, i)) for i in range(steps)])

    merged = fam.make()
    names = [p.name for p in toma.apply_toma(merged, ratio=0.5, **fam.options).patched]
    plain_out = denoise(fam.make())
    # the lowest threshold at which the cache skips a merged module on some steps, unpatched:
    # the first block's residual changes by 0.5 of itself between steps on most tiny rows, by
    # up to 0.78 on FLUX.2's
    for threshold in (0.5, 1.0):
        cached = fam.make()
        calls = layer_calls(cached, names)
        try:
            cache_dit.enable_cache(cached, **settings(threshold))
            cache_only = denoise(cached)
        except Exception as error:  # noqa: BLE001 - the reason is the skip's message
            skip_or_fail(request, f"cache-dit {kind} fails on {type(cached).__name__}, unpatched: {error!r}"[:300])
        probe = next((n for n in names if 0 < len(calls[n]) < steps), None)
        if probe is not None:
            break
    assert probe is not None, "cache-dit skipped no merged module, unpatched"
    toma_only = denoise(merged)

    def removed(model):
        cache_dit.refresh_context(model, **settings(threshold))  # a new run on a bare transformer
        assert torch.equal(denoise(model), cache_only)
        cache_dit.disable_cache(model)
        assert torch.equal(denoise(model), plain_out)

    outputs = either_order(fam, lambda m: cache_dit.enable_cache(m, **settings(threshold)), probe, denoise, removed)
    assert torch.equal(outputs[0], outputs[1])
    assert not torch.equal(outputs[0], toma_only)  # the cache acted
    assert not torch.equal(outputs[0], cache_only)  # merged


# each reason a ✖ cell of cache-dit gives but the UNets', as cache-dit says it: its error's type and text
CACHE_DIT_ERRORS = {
    compat.CACHE_DIT["sd3"]: (ValueError, "is not officially supported by cache-dit"),
    compat.CACHE_DIT["wan-animate"]: (AssertionError, "not in allowed classes"),
}


@pytest.mark.parametrize("name", [p for p in rows("cache_dit", compat.NO) if FAMILIES[p.values[0]].adapter != "unet"])
def test_cache_dit_fails_unpatched_where_the_matrix_says(name):
    # the matrix's ✖ cells but the UNets' (which cache-dit's block adapters do not cover):
    # cache-dit refuses the class before ToMA is involved, as the cell's reason says
    cache_dit = pytest.importorskip("cache_dit")
    from toma.tools.eval.caches import quiet_cache_dit

    quiet_cache_dit()
    fam = FAMILIES[name]
    model, kw = fam.make(), fam.inputs(1)
    error, text = CACHE_DIT_ERRORS[cell(fam.adapter, "cache_dit").reason]
    with pytest.raises(error, match=text):
        cache_dit.enable_cache(model, **cache_dit_settings("dbcache", 2, 0.5, separate_cfg=False))
        fam.output(model, run_step(fam, kw, 0))
