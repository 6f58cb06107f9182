"""The built-in image DiT (a Flux transformer on digits): shipped weights, sampling, ToMA.

Loads the weights shipped in the package; never trains. Each test samples at most a
few images with 1 or 2 Euler steps.
"""

from __future__ import annotations

import pytest
import torch

import toma
from toma.tools.builtin.dit import COND_DIM, COND_TOKENS, DIT_DIR, dit_available, load_dit, sample

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return load_dit()


def image_tokens_seen(model, fn) -> dict[str, list[int]]:
    """Image tokens reaching each block's query projection while ``fn()`` runs."""
    seen: dict[str, list[int]] = {}
    handles = []
    text = model.class_tokens.shape[1]
    for name, block in [*model.transformer.transformer_blocks.named_children()]:
        # the dual-stream query projection sees image tokens only
        handles.append(
            block.attn.to_q.register_forward_hook(
                lambda m, a, o, n=f"double.{name}": seen.setdefault(n, []).append(a[0].shape[1])
            )
        )
    for name, block in model.transformer.single_transformer_blocks.named_children():
        # the single-stream one sees [text; image]
        handles.append(
            block.attn.to_q.register_forward_hook(
                lambda m, a, o, n=f"single.{name}": seen.setdefault(n, []).append(a[0].shape[1] - text)
            )
        )
    try:
        fn()
    finally:
        for h in handles:
            h.remove()
    return seen


def test_dit_files_ship_and_are_small():
    assert dit_available(), f"built-in DiT missing under {DIT_DIR}; run scripts/train_builtin_dit.py"
    size = sum(p.stat().st_size for p in DIT_DIR.rglob("*") if p.is_file())
    assert size < 20 * 10**6


def test_dit_loads_as_a_flux_transformer(model):
    from diffusers import FluxTransformer2DModel

    assert isinstance(model.transformer, FluxTransformer2DModel)
    assert not model.transformer.training
    assert next(model.transformer.parameters()).dtype == torch.float32
    assert len(model.transformer.transformer_blocks) > 0 and len(model.transformer.single_transformer_blocks) > 0
    assert model.class_tokens.shape == (11, COND_TOKENS, COND_DIM)
    assert model.class_pooled.shape == (11, COND_DIM)
    assert model.metadata["sample_accuracy"]


def test_sample_shapes_and_1024_image_tokens(model):
    images: list[torch.Tensor] = []
    seen = image_tokens_seen(model, lambda: images.append(sample(model, [3, 7], [0, 1], steps=1, progress=False)))
    out = images[0]
    assert out.shape == (2, 1, 32, 32) and out.dtype == torch.float32
    assert 0.0 <= out.min() and out.max() <= 1.0
    assert set(seen) and all(counts == [32 * 32] for counts in seen.values())
    assert sample(model, [5], 0, steps=1, guidance_scale=1.0, progress=False).shape == (1, 1, 32, 32)


def test_sample_rejects_bad_arguments(model):
    with pytest.raises(ValueError, match="labels"):
        sample(model, [10], [0], steps=1, progress=False)
    with pytest.raises(ValueError, match="seeds"):
        sample(model, [1, 2], [0], steps=1, progress=False)
    with pytest.raises(ValueError, match="steps"):
        sample(model, [1], [0], steps=0, progress=False)


def test_apply_then_remove_is_bitwise(model):
    ref = sample(model, [2, 8], [5, 6], steps=2, progress=False)
    toma.apply_toma(model.transformer, ratio=0.5)
    try:
        sample(model, [2, 8], [5, 6], steps=2, progress=False)
    finally:
        toma.remove_toma(model.transformer)
    assert torch.equal(sample(model, [2, 8], [5, 6], steps=2, progress=False), ref)


def test_ratio_half_merges_and_stays_finite(model):
    ref = sample(model, [4, 9], [7, 8], steps=2, progress=False)
    patch = toma.apply_toma(model.transformer, ratio=0.5)
    try:
        images: list[torch.Tensor] = []
        seen = image_tokens_seen(model, lambda: images.append(sample(model, [4, 9], [7, 8], steps=2, progress=False)))
    finally:
        toma.remove_toma(model.transformer)
    merged = images[0]
    assert patch.patched
    assert torch.isfinite(merged).all()
    assert not torch.equal(merged, ref)
    # at least one block attends over half the image tokens, the first ones over all
    counts = {c for runs in seen.values() for c in runs}
    assert counts == {32 * 32, 32 * 32 // 2}
