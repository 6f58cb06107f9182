"""Z-Image's own cases: an image of any size merges, its pad tokens passing whole; a batch
of images of different sizes runs bitwise unmerged, with one warning that says why; a batch
whose captions differ in padded length (classifier-free guidance) merges, its joint mask
fitted; the refiners never merge."""

from __future__ import annotations

import warnings

import pytest
import torch

import toma
from tests.cases import clustered_tokens, force
from tests.tiny_models import FAMILIES, zimage_inputs
from toma.adapters import attention as A

FAM = FAMILIES["zimage"]


def test_images_of_different_sizes_run_unmerged_with_one_warning():
    model, kw = FAM.make(), zimage_inputs(2, 16, 16)
    kw = {**kw, "x": [kw["x"][0], torch.randn(16, 1, 16, 32)]}
    with torch.no_grad():
        ref = [t.clone() for t in model(**kw).sample]
    patch = toma.apply_toma(model, ratio=0.5, **FAM.every_part())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            outs = [model(**kw).sample for _ in range(2)]
    said = [str(w.message) for w in caught if "ToMA" in str(w.message)]
    assert len(said) == 1 and "different sizes" in said[0], said
    assert not patch.cache._plans  # nothing merged
    for out in outs:
        assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_an_image_whose_tokens_the_forward_pads_merges_and_its_pad_passes_whole():
    # 4x7 = 28 image tokens, which the forward pads to 32 with its learned pad token between
    # the image and the caption (as 832x1216's 52x76 = 3,952 to 3,968). All image tokens
    # entering the main layers are one token, and the rotary tables rotate nothing: merged
    # attention with the log(mass) bias computes the unmerged one exactly, for the image, the
    # pad tokens and the caption alike, only if the pad passes whole beside the caption.
    # (Before, such calls ran unmerged with a warning.)
    model, kw = FAM.make(), zimage_inputs(1, 8, 14)
    tokens = 4 * 7

    def one_token(module, args):
        x, mask, freqs, *rest = args
        if module is model.layers[0]:
            x = torch.cat([x[:, :1].expand(-1, tokens, -1), x[:, tokens:]], dim=1)
        return (x, mask, torch.ones_like(freqs), *rest)

    for layer in model.layers:
        layer.register_forward_pre_hook(one_token)
    with torch.no_grad():
        ref = torch.stack(model(**kw).sample)
    outs = {}
    for proportional in (True, False):
        patch = toma.apply_toma(model, ratio=0.5, tile_size=4, proportional_attention=proportional, **FAM.every_part())
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing said: it merges
            with torch.no_grad():
                outs[proportional] = torch.stack(model(**kw).sample)
        [plan] = [p for _, p in patch.cache._plans.values()]
        assert plan.num_merged < tokens
        toma.remove_toma(model)
    torch.testing.assert_close(outs[True], ref, rtol=1e-4, atol=1e-5)
    assert (outs[False] - ref).abs().max() > 1e-3  # the bias is what makes it exact: merging happened


def test_only_the_main_layers_merge():
    model = FAM.make()
    patch = toma.apply_toma(model, ratio=0.5, merge_mlp=True, blocks={"layers": range(2)})
    names = {t.name for t in patch.patched}
    assert names and all(name.startswith("layers.") for name in names)
    with pytest.raises(ValueError):  # the refiners are no stack of the family's
        toma.apply_toma(model, ratio=0.5, blocks={"noise_refiner": range(1)})


@pytest.mark.parametrize("proportional", [False, True], ids=["plain", "bias"])
def test_captions_of_different_lengths_merge_as_each_sample_alone(proportional):
    # 5 and 40 caption tokens, padded to 32 and 64: the forward pads the first sample's
    # sequence at its end and masks those keys. Each merged attention takes the mask's last
    # positions; each sample's output is then its output alone (no padding, no mask), to the
    # float noise of batching (see the conformance suite's per-sample plan test)
    # (with the bias: the model's mask folds into it, and the caption's keys take log mass 0)
    model, kw = FAM.make(), zimage_inputs(2, 16, 16, longer=35)
    patch = toma.apply_toma(model, ratio=0.5, proportional_attention=proportional, **FAM.every_part())
    masks: list = []
    attn = model.layers[1].attention
    attn.register_forward_pre_hook(
        lambda mod, args, kwargs: masks.append(kwargs.get("attention_mask")) and None, with_kwargs=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing said: it merges
        both = torch.stack(model(**kw).sample)
    [plan] = [p for _, p in patch.cache._plans.values()]
    k = plan.num_merged
    assert k < 64 and masks[0] is not None and masks[0].shape == (2, 64 + 64)  # what the layer passes
    for b in range(2):
        alone = {"x": kw["x"][b : b + 1], "t": kw["t"][b : b + 1], "cap_feats": kw["cap_feats"][b : b + 1]}
        out = torch.stack(model(**alone).sample)
        torch.testing.assert_close(both[b : b + 1], out, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("form", A.FORMS)
def test_the_bias_is_exact_on_duplicate_tokens(form, monkeypatch):
    # two 4x4 tiles of one token 9 times and 7 others enter the main layers (rotary tables
    # of 1 + 0j rotate nothing): merged attention with the log(mass) bias, the caption's keys
    # after the image's, computes the unmerged one, by every form
    force(monkeypatch, form)
    model, kw = FAM.make(), zimage_inputs(1, 8, 16)  # 4x8 image tokens

    def duplicated(module, args):
        x, mask, freqs, *rest = args
        if module is model.layers[0]:
            x = torch.cat([clustered_tokens(2, channels=x.shape[-1]), x[:, 32:]], dim=1)
        return (x, mask, torch.ones_like(freqs), *rest)

    for layer in model.layers:
        layer.register_forward_pre_hook(duplicated)
    ref = torch.stack(model(**kw).sample)
    outs = {}
    for proportional in (True, False):
        toma.apply_toma(model, ratio=0.5, tile_size=4, proportional_attention=proportional, blocks={"layers": [0]})
        with torch.no_grad():
            outs[proportional] = torch.stack(model(**kw).sample)
        toma.remove_toma(model)
    torch.testing.assert_close(outs[True], ref, rtol=1e-4, atol=1e-5)
    assert (outs[False] - ref).abs().max() > 1e-3
