"""Masks over a joint [text; image] sequence that hold one value over the image: fitted by slicing.

The helper (toma.core.masks) against a brute-force reference over every layout diffusers'
dispatch takes; the key bias of proportional attention with each fitted layout; and tiny
Flux.1, FLUX.2 and Bria FIBO models, where a text padding mask now merges and a structured one runs
unmerged. The conformance suite's text-mask test runs the same on every family that takes
such a mask (Chroma included).
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

import toma
from tests.cases import sdpa_keys
from tests.tiny_models import FAMILIES, chroma_pipeline_mask
from toma.adapters import attention as A
from toma.core import masks as M

B, TEXT, IMAGE = 2, 3, 4
S = TEXT + IMAGE
# layout name -> shape over S keys
LAYOUTS = {
    "(B, S)": (B, S),
    "(B, 1, S)": (B, 1, S),
    "(B, S, S)": (B, S, S),
    "(B, 1, 1, S)": (B, 1, 1, S),
    "(B, 1, S, S)": (B, 1, S, S),
    "(B, 2, S, S)": (B, 2, S, S),
}


def full(mask: torch.Tensor) -> torch.Tensor:
    """The mask as (B, H, S, S), one value per sample, head, query and key, as diffusers'
    dispatch reads its layouts ((B, S) and (B, Sq, S) for every head)."""
    s = mask.shape[-1]
    m = mask[:, None, None, :] if mask.ndim == 2 else mask[:, None] if mask.ndim == 3 else mask
    return m.expand(m.shape[0], m.shape[1], s, s)


def uniform_reference(mask: torch.Tensor, n: int) -> bool:
    """Brute force: every image key (and, with a row per query, every image query) can be
    swapped for any other without changing a value."""
    f, s = full(mask), mask.shape[-1]
    rows = mask.ndim > 2 and mask.shape[-2] == s
    for b, h, q in itertools.product(range(f.shape[0]), range(f.shape[1]), range(s)):
        for i, j in itertools.combinations(range(s - n, s), 2):
            if f[b, h, q, i] != f[b, h, q, j]:
                return False
            if rows and f[b, h, i, q] != f[b, h, j, q]:
                return False
    return True


def merged_reference(mask: torch.Tensor, n: int, kept: int, seed: int) -> torch.Tensor:
    """Brute force: the (B, H, S', S') mask of the merged sequence, each merged image token
    standing for a random original one on each axis (any one, where the mask is uniform)."""
    g = torch.Generator().manual_seed(seed)
    f, s = full(mask), mask.shape[-1]
    text = s - n
    picks = lambda: [*range(text), *(text + torch.randint(n, (kept,), generator=g)).tolist()]  # noqa: E731
    q, k = picks(), picks()
    return f[:, :, q][:, :, :, k]


def random_mask(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A mask with random values over the text, one value over the image keys per row and
    (with a row per query) one row over the image queries."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        m = torch.rand(shape, generator=g) > 0.3
    else:  # additive: kept, hidden, a soft bias
        m = torch.tensor([0.0, float("-inf"), -1e4, 0.5])[torch.randint(4, shape, generator=g)]
    m[..., TEXT:] = m[..., TEXT : TEXT + 1].clone()
    if len(shape) > 2 and shape[-2] == S:
        m[..., TEXT:, :] = m[..., TEXT : TEXT + 1, :].clone()
    return m


def other(value: torch.Tensor) -> torch.Tensor:
    return ~value if value.dtype == torch.bool else torch.where(value == 0, -1.0, 0.0)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_uniform_masks_fit_as_the_brute_force_reference(layout, dtype):
    shape = LAYOUTS[layout]
    for seed in range(4):
        mask = random_mask(shape, dtype, seed)
        assert uniform_reference(mask, IMAGE) and M.image_uniform(mask, IMAGE)
        assert M.layout_problem(mask, S) is None
        for kept in (1, 2, IMAGE):
            fitted = M.fit_joint_mask(mask, IMAGE, kept)
            merged = S - IMAGE + kept
            # the layout stays: a key mask broadcast over queries stays one, rows are sliced
            expected = [*shape[:-1], merged]
            if len(shape) > 2 and shape[-2] == S:
                expected[-2] = merged
            assert fitted.shape == tuple(expected)
            assert fitted.dtype == dtype
            for pick in range(3):  # any image tokens the merged ones stand for
                assert torch.equal(full(fitted), merged_reference(mask, IMAGE, kept, seed=10 * seed + pick))


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_image_first_masks_fit_as_their_mirror_image(layout, dtype):
    # [image; text] is [text; image] read backwards: the image-first slice of a mirrored
    # mask is the mirrored text-first fit, which the test above checks by brute force
    shape = LAYOUTS[layout]
    rows = len(shape) > 2 and shape[-2] == S

    def mirror(m: torch.Tensor) -> torch.Tensor:
        return m.flip(-1, -2) if rows else m.flip(-1)

    for seed in range(4):
        mask = random_mask(shape, dtype, seed)
        for kept in (0, 1, 2, IMAGE):
            fitted = M.slice_image_first_mask(mirror(mask), IMAGE, kept)
            assert torch.equal(fitted, mirror(M.fit_joint_mask(mask, IMAGE, kept)))
    with pytest.raises(ValueError, match="kept must be in"):
        M.slice_image_first_mask(mask, IMAGE, IMAGE + 1)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_structured_masks_have_no_merged_form(layout, dtype):
    shape = LAYOUTS[layout]
    g = torch.Generator().manual_seed(3)
    for seed in range(4):
        mask = random_mask(shape, dtype, seed)
        # one image key that differs from the others, in a random row
        keys = mask.clone()
        index = tuple(int(torch.randint(d, (1,), generator=g)) for d in shape[:-1])
        key = TEXT + int(torch.randint(IMAGE, (1,), generator=g))
        keys[(*index, key)] = other(keys[(*index, key)])
        cases = [keys]
        if len(shape) > 2 and shape[-2] == S:  # one image query row that differs at a text key
            query_rows = mask.clone()
            lead = tuple(int(torch.randint(d, (1,), generator=g)) for d in shape[:-2])
            row = TEXT + int(torch.randint(IMAGE, (1,), generator=g))
            query_rows[(*lead, row, 0)] = other(query_rows[(*lead, row, 0)])
            cases.append(query_rows)
        for case in cases:
            assert not uniform_reference(case, IMAGE)
            assert not M.image_uniform(case, IMAGE)
            assert M.fit_joint_mask(case, IMAGE, 2) is None


def test_unknown_layouts_are_named_and_not_fitted():
    assert "5 dimensions" in M.layout_problem(torch.ones(1, 1, 1, 1, S, dtype=torch.bool), S)
    assert "over 6 keys" in M.layout_problem(torch.ones(B, 6, dtype=torch.bool), S)
    assert "3 query rows" in M.layout_problem(torch.ones(B, 1, 3, S, dtype=torch.bool), S)
    assert M.fit_joint_mask(torch.ones(B, 1, 3, S, dtype=torch.bool), IMAGE, 2) is None
    with pytest.raises(ValueError, match="kept"):
        M.slice_joint_mask(torch.ones(B, S), IMAGE, IMAGE + 1)


# ------------------------------------------------------------------ the key bias
def additive(mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, 0.0, float("-inf")) if mask.dtype == torch.bool else mask


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("layout", ["(B, S)", "(B, 1, S)", "(B, 1, 1, S)", "(B, 1, S, S)"])
def test_the_key_bias_takes_every_fitted_layout_exactly(layout, dtype):
    mask = random_mask(LAYOUTS[layout], dtype, seed=5)
    fitted = M.fit_joint_mask(mask, IMAGE, 2)
    log_mass = torch.randn(1, TEXT + 2).clamp(max=0) - torch.rand(1, TEXT + 2)
    bias = A.KeyBias(log_mass).with_model_mask(fitted)
    # brute force: the float mask SDPA adds to the (B, H, Sq, Sk) logits
    expected = log_mass[:, None, None, :] + additive(full(fitted))
    got = bias.mask(torch.float32)
    assert torch.equal(got.expand_as(expected), expected)
    assert bias.per_query == (layout == "(B, 1, S, S)")
    one = bias.batch_slice(1, B)
    assert torch.equal(one.mask(torch.float32).expand_as(expected[1:]), expected[1:])


def test_a_per_query_mask_on_a_bias_per_key_runs_without_the_bias_and_says_so(monkeypatch):
    # the key channel (flash) carries a bias per key only: a mask whose rows differ by
    # query cannot ride it, so the call runs with the model's mask alone, said once
    rows = random_mask(LAYOUTS["(B, 1, S, S)"], torch.bool, seed=2)
    bias = A.KeyBias(torch.zeros(1, S)).with_model_mask(rows)
    monkeypatch.setattr(A, "rule", lambda *a: (A.KEY_CHANNEL, "test"))
    monkeypatch.setattr(A, "_warned", set())
    seen = []
    real = lambda q, k, v, attn_mask=None, **kw: seen.append(attn_mask) or q  # noqa: E731
    q = torch.randn(B, S, 2, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        A.attend(real, bias, q, q, q, backend="flash")
        A.attend(real, bias, q, q, q, backend="flash")
        A.attend(real, bias.automatic(), q, q, q, backend="flash")  # not asked for: silently
    assert all(m is rows for m in seen) and len(seen) == 3
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "row per query" in messages[0]


# ------------------------------------------------------------------ tiny Flux.1 and FLUX.2
PADDED = 2  # the last two text tokens are padding


def bare_inputs(fam) -> dict:
    """The row's call without a mask of its own (Bria FIBO's row carries the pipeline's)."""
    return {k: v for k, v in fam.inputs(B).items() if k != "joint_attention_kwargs"}


def joint(fam, kw: dict, mask: torch.Tensor) -> dict:
    return {**kw, "joint_attention_kwargs": {"attention_mask": mask}}


def padding_mask(layout: str, text: int, keys: int) -> torch.Tensor:
    keep = torch.ones(B, keys, dtype=torch.bool)
    keep[:, text - PADDED : text] = False
    if layout == "bool (B, 1, 1, S)":
        return keep[:, None, None, :]
    if layout == "additive (B, S)":
        return torch.where(keep, 0.0, float("-inf"))
    return keep[:, None, None, :].expand(B, 1, keys, keys)  # "bool (B, 1, S, S)", every row alike


@pytest.mark.parametrize("proportional", [None, False])
@pytest.mark.parametrize("layout", ["bool (B, 1, 1, S)", "additive (B, S)", "bool (B, 1, S, S)"])
@pytest.mark.parametrize("name", ["flux", "flux2", "bria-fibo"])
def test_a_text_padding_mask_merges_as_if_the_padding_were_not_there(name, layout, proportional, monkeypatch):
    fam = FAMILIES[name]
    model, kw = fam.make(), bare_inputs(fam)
    text, tokens = kw["encoder_hidden_states"].shape[1], kw["hidden_states"].shape[1]
    mask = padding_mask(layout, text, text + tokens)
    patch = toma.apply_toma(model, ratio=0.5, proportional_attention=proportional, **fam.every_part())
    keys = sdpa_keys(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        masked = fam.output(model, joint(fam, kw, mask))
    assert [str(w.message) for w in caught if "ToMA" in str(w.message)] == []
    kept = patch.cache.layout(*fam.grid, ratio=0.5).num_merged
    assert kept < math.prod(fam.grid) and set(keys) == {text + kept}  # every attention saw K image keys
    cut = {
        **kw,
        "encoder_hidden_states": kw["encoder_hidden_states"][:, :-PADDED],
        "txt_ids": kw["txt_ids"][..., :-PADDED, :],
    }
    if "text_encoder_layers" in kw:  # Bria FIBO's per-block text
        cut["text_encoder_layers"] = [t[:, :-PADDED] for t in kw["text_encoder_layers"]]
    # hidden keys add exp(-inf) = 0 to each softmax; the sums still run over two more keys
    # in the masked kernel, so they differ by float32 ulps (measured under 5e-7)
    torch.testing.assert_close(masked, fam.output(model, cut), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["flux", "flux2", "bria-fibo"])
def test_a_mask_of_ones_merges_as_no_mask(name):
    # under proportional attention (on by default on CPU) a key mask of ones folds into the
    # bias as torch.where(True, log_mass, -inf): the same float mask as without one, so the
    # same kernel on the same numbers, bitwise
    fam = FAMILIES[name]
    model, kw = fam.make(), bare_inputs(fam)
    keys = kw["encoder_hidden_states"].shape[1] + kw["hidden_states"].shape[1]
    toma.apply_toma(model, ratio=0.5, **fam.every_part())
    unmasked = fam.output(model, kw)
    ones = fam.output(model, joint(fam, kw, torch.ones(B, 1, 1, keys, dtype=torch.bool)))
    assert torch.equal(ones, unmasked)


@pytest.mark.parametrize("structure", ["causal rows", "one image key hidden"])
@pytest.mark.parametrize("name", ["flux", "flux2", "bria-fibo"])
def test_a_structured_mask_runs_unmerged_bitwise_with_one_warning(name, structure):
    fam = FAMILIES[name]
    model, kw = fam.make(), bare_inputs(fam)
    text, tokens = kw["encoder_hidden_states"].shape[1], kw["hidden_states"].shape[1]
    keys = text + tokens
    if structure == "causal rows":
        mask = torch.ones(keys, keys, dtype=torch.bool).tril().expand(B, 1, keys, keys)
    else:
        mask = torch.ones(B, 1, 1, keys, dtype=torch.bool)
        mask[..., text + 3] = False
    reference = fam.output(model, joint(fam, kw, mask))
    toma.apply_toma(model, ratio=0.5, **fam.every_part())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fam.output(model, joint(fam, kw, mask))
        fam.output(model, joint(fam, kw, mask))
    messages = [str(w.message) for w in caught if "ToMA" in str(w.message)]
    assert len(messages) == 1 and "structured" in messages[0] and "attention_mask" in messages[0]
    assert torch.equal(out, reference)


# ------------------------------------------------------------------ Chroma's pipeline mask
def test_chromas_pipeline_mask_merges_and_shifts_a_sample_without_padding_by_a_constant(monkeypatch):
    # the pipeline passes a float (B, S) mask, 1 but over the text padding after its first
    # token; each block adds the outer product (B, 1, S, S) to the scores. It holds one value
    # over the image on both axes, so every merged call takes its slice (proportional
    # attention adds its bias beside it). A sample with no padding gets +1 on every score,
    # which the softmax cancels: that sample is the unmasked merged call's, up to the
    # float32 rounding of the shifted scores (~1e-7 a score, under 1e-5 through the model)
    fam = FAMILIES["chroma"]
    model, kw = fam.make(), fam.inputs(B)
    text, tokens = kw["encoder_hidden_states"].shape[1], kw["hidden_states"].shape[1]
    patch = toma.apply_toma(model, ratio=0.5, **fam.every_part())
    unmasked = fam.output(model, kw)
    keys = sdpa_keys(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        masked = fam.output(model, {**kw, "attention_mask": chroma_pipeline_mask(B, text, tokens)})
    assert [str(w.message) for w in caught if "ToMA" in str(w.message)] == []
    kept = patch.cache.layout(*fam.grid, ratio=0.5).num_merged
    assert kept < tokens and set(keys) == {text + kept}
    torch.testing.assert_close(masked[0], unmasked[0], rtol=1e-5, atol=1e-5)
    assert (masked[1] - unmasked[1]).abs().max() > 1e-3  # the hidden padding token mattered


@pytest.mark.parametrize("masked", [False, True])
def test_chromas_key_bias_on_every_form(masked, monkeypatch):
    # without a mask every form of the key bias computes what the float mask does (fp32
    # rounding, under 1e-5 of the output's range, as in test_proportional_families); with
    # the pipeline's per-query mask the key channel, a bias per key, cannot carry it: those
    # calls run with the model's mask and no bias, said once
    from tests.cases import force

    fam = FAMILIES["chroma"]
    model, kw = fam.make(), fam.inputs(B)
    if masked:
        text, tokens = kw["encoder_hidden_states"].shape[1], kw["hidden_states"].shape[1]
        kw = {**kw, "attention_mask": chroma_pipeline_mask(B, text, tokens)}
    out = {}
    for proportional in (False, True):
        toma.apply_toma(model, ratio=0.5, proportional_attention=proportional, **fam.options)
        out[proportional] = fam.output(model, kw)
        toma.remove_toma(model)
    scale = float(out[True].abs().max())
    assert (out[False] - out[True]).abs().max() > 1e-3 * scale  # the bias reached the processors
    monkeypatch.setattr(A, "_warned", set())
    with monkeypatch.context() as m, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        force(m, A.KEY_CHANNEL)
        toma.apply_toma(model, ratio=0.5, proportional_attention=True, **fam.options)
        got = fam.output(model, kw)
    messages = [str(w.message) for w in caught if "row per query" in str(w.message)]
    assert len(messages) == (1 if masked else 0)
    torch.testing.assert_close(got, out[False] if masked else out[True], atol=1e-5 * scale, rtol=0)


def test_chromas_pipeline_merges_with_its_mask_end_to_end(tmp_path):
    # ChromaPipeline builds the float (1, text + N) mask itself and calls the transformer
    # twice a step (prompt, negative prompt): every call merges, mask and all, with no
    # warning; removal gives the unmerged images back bitwise
    from diffusers import ChromaPipeline, FlowMatchEulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel

    from tests.tiny_models import make_chroma
    from tests.tiny_pipelines import merged_round_trip, tiny_clip_tokenizer, tiny_vae

    torch.manual_seed(0)
    t5 = T5EncoderModel(T5Config(vocab_size=60, d_model=32, d_ff=32, d_kv=8, num_layers=1, num_heads=2)).eval()
    pipe = ChromaPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_vae(),
        text_encoder=t5,
        tokenizer=tiny_clip_tokenizer(tmp_path / "tok"),
        transformer=make_chroma(),
    )
    masks = []
    handle = pipe.transformer.register_forward_pre_hook(
        lambda m, a, kw: masks.append(kw["attention_mask"]), with_kwargs=True
    )
    kw = dict(height=32, width=48, num_inference_steps=2, max_sequence_length=16, output_type="np")

    def generate():
        return pipe("a red fox", negative_prompt="dim", generator=torch.Generator().manual_seed(0), **kw).images

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # 32x48 px -> 16x24 latents -> 8x12 tokens, half kept; two calls a step
        merged_round_trip(
            pipe, generate, [(1, 48)] * 4, blocks={"transformer_blocks": (0, 1), "single_transformer_blocks": (0, 1)}
        )
    handle.remove()
    assert [str(w.message) for w in caught if "ToMA" in str(w.message)] == []
    assert masks and all(m.shape == (1, 16 + 96) and not m[:, :16].all() for m in masks)  # padding hidden


def test_chromas_masked_blocks_compile_without_graph_breaks():
    # the mask's slice, on both axes in the spanning single-stream site, and the per-query
    # key bias beside it, trace as the conformance suite's unmasked blocks do (its
    # test_merged_blocks_compile_without_graph_breaks; the grid reader's one check of the
    # mask, like its read of the ids, is in the step hook, outside the merge path)
    from tests.adapters.test_conformance import first_blocks

    fam = FAMILIES["chroma"]
    model, kw = fam.make(), fam.inputs(1)
    text, tokens = kw["encoder_hidden_states"].shape[1], kw["hidden_states"].shape[1]
    kw["attention_mask"] = chroma_pipeline_mask(1, text, tokens)
    kw["attention_mask"][0, text - 1] = 0
    patch = toma.apply_toma(model, ratio=0.5, **fam.every_part())
    calls, handles = {}, []
    for owner in first_blocks(patch):
        block = model.get_submodule(owner)
        record = lambda mod, a, k, owner=owner: calls.setdefault(owner, (a, k))  # noqa: E731
        handles.append(block.register_forward_pre_hook(record, with_kwargs=True))
    fam.output(model, kw)
    for handle in handles:
        handle.remove()
    assert len(calls) == 2
    breaks = {}
    for owner, (args, kwargs) in calls.items():
        assert kwargs["attention_mask"] is not None
        patch.cache.forward.plans.clear()
        torch._dynamo.reset()
        with torch.no_grad():
            explained = torch._dynamo.explain(model.get_submodule(owner))(*args, **kwargs)
        breaks[owner] = [r.reason.splitlines()[0] for r in explained.break_reasons]
        assert patch.cache.forward.plans  # the traced call merged
    torch._dynamo.reset()
    assert breaks == {owner: [] for owner in calls}
