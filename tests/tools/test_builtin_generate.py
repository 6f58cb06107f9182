"""The built-in model and ``toma generate``, offline, with tiny settings."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import toma
from toma.tools.builtin.unet import BUILTIN_DIR, builtin_available, load_builtin, sample
from toma.tools.cli import main


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return load_builtin()


def test_builtin_files_ship_and_are_small():
    assert builtin_available(), f"built-in model missing under {BUILTIN_DIR}; run scripts/train_builtin.py"
    size = sum(p.stat().st_size for p in BUILTIN_DIR.rglob("*") if p.is_file())
    assert size < 20 * 2**20


def test_builtin_is_a_unet_with_1024_token_attention(model):
    from diffusers import UNet2DConditionModel

    assert isinstance(model.unet, UNet2DConditionModel)
    seen = []
    block = model.unet.down_blocks[0].attentions[0].transformer_blocks[0]
    handle = block.attn1.register_forward_hook(lambda m, a, o: seen.append(a[0].shape))
    sample(model, [3], [0], steps=1, guidance_scale=1.0, progress=False)
    handle.remove()
    assert seen[0][1] == 32 * 32
    assert model.class_embeddings.shape[0] == 11
    assert model.metadata["sample_accuracy"]


def test_sample_is_seeded_per_image(model):
    both = sample(model, [1, 7], [5, 6], steps=2, progress=False)
    alone = sample(model, [7], [6], steps=2, progress=False)
    assert both.shape == (2, 1, 32, 32) and 0 <= both.min() and both.max() <= 1
    torch.testing.assert_close(both[1:], alone, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="labels"):
        sample(model, [10], [0], steps=1, progress=False)


def test_toma_and_tomesd_apply_to_builtin(model):
    import tomesd

    ref = sample(model, [2, 5], [0, 1], steps=2, progress=False)
    patch = toma.apply_toma(model.unet, ratio=0.5)
    try:
        assert len(patch.patched) > 0
        merged = sample(model, [2, 5], [0, 1], steps=2, progress=False)
    finally:
        toma.remove_toma(model.unet)
    assert not torch.equal(merged, ref)
    tomesd.apply_patch(model.unet, ratio=0.5)
    try:
        sample(model, [2], [0], steps=1, progress=False)
    finally:
        tomesd.remove_patch(model.unet)
    assert torch.equal(sample(model, [2, 5], [0, 1], steps=2, progress=False), ref)


def test_generate_cli_offline(tmp_path, capsys):
    out = tmp_path / "x.png"
    assert main(["generate", "--steps", "2", "--labels", "0,1,2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "time per image: unmerged" in text and "ToMA" in text
    assert Image.open(out).size[0] > 3 * 128


def test_generate_compare(tmp_path, capsys):
    out = tmp_path / "cmp.png"
    assert main(["generate", "--steps", "2", "--labels", "4", "--compare", "--out", str(out), "--ratio", "0.25"]) == 0
    img = Image.open(out)
    assert img.size[0] > 2 * 128  # two panels side by side
    assert "speedup" in capsys.readouterr().out


def test_generate_bad_settings(tmp_path, capsys):
    assert main(["generate", "--ratio", "1.5", "--out", str(tmp_path / "x.png")]) == 2
    assert "ratio" in capsys.readouterr().err
    assert main(["generate", "--labels", "3,12", "--out", str(tmp_path / "x.png")]) == 2
    assert "--labels" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_generate_missing_weights_is_clear(tmp_path, capsys):
    code = main(["generate", "--model", "toma-tests/no-such-pipeline", "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert code == 2
    assert "not in the local Hugging Face cache" in err and "hf download toma-tests/no-such-pipeline" in err
    assert "Traceback" not in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["generate", "--model", str(empty), "--out", str(tmp_path / "x.png")]) == 2
    assert "model_index.json" in capsys.readouterr().err


def test_generate_labels_its_progress_bars_and_images(tmp_path, capsys):
    out = tmp_path / "cmp.png"
    assert main(["generate", "--steps", "2", "--labels", "1,7", "--compare", "--ratio", "0.25", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    # each run's progress bar says which run it is
    assert "unmerged:" in err and "ToMA 0.25:" in err and "denoising:" not in err


def dark_columns(img, top, bottom):
    """Columns of ``img`` with a dark pixel between rows ``top`` and ``bottom`` (text drawn there)."""
    import numpy as np

    arr = np.asarray(img.convert("L"))[top:bottom]
    return set(np.nonzero((arr < 128).any(axis=0))[0].tolist())


def test_grid_writes_each_images_label_under_it():
    from toma.tools.common.images import LABEL_HEIGHT, make_grid

    images = torch.zeros(3, 1, 8, 8)  # black cells, so only the label strips hold text
    bare, labelled = (
        make_grid(images, ncols=3, upscale=2),
        make_grid(images, ncols=3, upscale=2, labels=["0", "1", "7"]),
    )
    assert labelled.height == bare.height + LABEL_HEIGHT and labelled.width == bare.width
    ink = dark_columns(labelled, 2 + 16, labelled.height)
    for col in range(3):  # text under every cell, inside its column
        assert ink & set(range(2 + col * 18, 2 + col * 18 + 16)), col
    strips = [labelled.crop((2 + col * 18, 18, 2 + col * 18 + 16, labelled.height)).tobytes() for col in range(3)]
    assert len(set(strips)) == 3  # three different texts
    with pytest.raises(ValueError, match="labels"):
        make_grid(images, labels=["0"])


def test_generated_grid_has_a_caption(tmp_path):
    out = tmp_path / "digits.png"
    assert main(["generate", "--steps", "1", "--labels", "3", "--out", str(out)]) == 0
    img = Image.open(out)
    assert dark_columns(img, 0, 18)  # the caption strip above the grid holds text
    assert img.height == 18 + 20 + (2 + 128 + 14 + 2)  # caption, margins, one labelled 128px cell
