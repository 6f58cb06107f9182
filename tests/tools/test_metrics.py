"""The metric functions against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from toma.tools.eval.metrics import (
    ClipScorer,
    DinoFeatures,
    MissingWeightsError,
    accuracy,
    feature_stats,
    frechet_distance,
    frechet_distance_features,
    load_image_folder,
    mean_finite,
    psnr,
    ssim,
    temporal_difference_error,
)


def test_psnr_known_values():
    a = torch.zeros(2, 1, 8, 8)
    b = torch.full((2, 1, 8, 8), 0.1)  # MSE 0.01 -> 10 log10(1 / 0.01) = 20 dB
    assert psnr(a, b).tolist() == pytest.approx([20.0, 20.0])
    # 8-bit range: error of 25.5 on a 255 range is the same 20 dB
    assert psnr(a * 255, b * 255, data_range=255.0).tolist() == pytest.approx([20.0, 20.0])
    # half the pixels off by 0.2: MSE = 0.02 -> 10 log10(50) = 16.9897 dB
    c = torch.zeros(1, 1, 4, 4)
    c[..., :2, :] = 0.2
    assert psnr(torch.zeros(1, 1, 4, 4), c).item() == pytest.approx(10 * math.log10(50))
    assert psnr(a, a).isinf().all()
    assert mean_finite(torch.tensor([math.inf, 10.0, 20.0])) == 15.0


def test_ssim_constant_images_by_formula():
    # flat images: no variance, so SSIM = (2 m1 m2 + C1) / (m1^2 + m2^2 + C1) with C1 = 0.01^2
    a = torch.full((1, 1, 16, 16), 0.2, dtype=torch.float64)
    b = torch.full((1, 1, 16, 16), 0.6, dtype=torch.float64)
    expected = (2 * 0.2 * 0.6 + 1e-4) / (0.2**2 + 0.6**2 + 1e-4)
    assert ssim(a, b).item() == pytest.approx(expected, rel=1e-9)
    assert ssim(a, a).item() == pytest.approx(1.0)


def naive_ssim(x: np.ndarray, y: np.ndarray, win: int = 11, sigma: float = 1.5) -> float:
    """SSIM by explicit loops over every window position (independent of the conv code)."""
    coords = np.arange(win) - (win - 1) / 2
    g = np.exp(-(coords**2) / (2 * sigma**2))
    w = np.outer(g, g) / np.outer(g, g).sum()
    c1, c2 = 0.01**2, 0.03**2
    vals = []
    for i in range(x.shape[0] - win + 1):
        for j in range(x.shape[1] - win + 1):
            px, py = x[i : i + win, j : j + win], y[i : i + win, j : j + win]
            mx, my = (w * px).sum(), (w * py).sum()
            vx, vy = (w * (px - mx) ** 2).sum(), (w * (py - my) ** 2).sum()
            cxy = (w * (px - mx) * (py - my)).sum()
            vals.append(((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2)))
    return float(np.mean(vals))


def test_ssim_matches_explicit_window_loop():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1, 1, 14, 15, generator=g)
    y = (x + 0.1 * torch.randn(x.shape, generator=g)).clamp(0, 1)
    assert ssim(x, y).item() == pytest.approx(naive_ssim(x[0, 0].double().numpy(), y[0, 0].double().numpy()), rel=1e-9)
    # inverted structure gives negative SSIM
    assert ssim(x, 1 - x).item() < 0
    # colour images: mean over channels
    rgb_x, rgb_y = x.repeat(1, 3, 1, 1), y.repeat(1, 3, 1, 1)
    assert ssim(rgb_x, rgb_y).item() == pytest.approx(ssim(x, y).item())


def test_ssim_rejects_bad_inputs():
    with pytest.raises(ValueError, match="same shape"):
        ssim(torch.zeros(1, 1, 16, 16), torch.zeros(1, 1, 16, 15))
    with pytest.raises(ValueError, match="window_size"):
        ssim(torch.zeros(1, 1, 8, 8), torch.zeros(1, 1, 8, 8))


def test_frechet_distance_known_values():
    # 1-D: N(0, 1) vs N(1, 4): (0 - 1)^2 + 1 + 4 - 2 sqrt(1 * 4) = 2
    assert frechet_distance(torch.zeros(1), torch.eye(1), torch.ones(1), 4 * torch.eye(1)) == pytest.approx(2.0)
    # diagonal: |mu|^2 + sum (sqrt(s1) - sqrt(s2))^2 = 9 + 16 + (1 - 3)^2 + (2 - 2)^2 = 29
    d = frechet_distance(
        torch.zeros(2),
        torch.diag(torch.tensor([1.0, 4.0])),
        torch.tensor([3.0, 4.0]),
        torch.diag(torch.tensor([9.0, 4.0])),
    )
    assert d == pytest.approx(29.0)
    feats = torch.randn(200, 5, generator=torch.Generator().manual_seed(0))
    mu, sigma = feature_stats(feats)
    assert frechet_distance_features(feats, mu, sigma) == pytest.approx(0.0, abs=1e-8)


def test_accuracy():
    assert accuracy(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 0, 4])) == 0.75
    with pytest.raises(ValueError):
        accuracy(torch.tensor([1]), torch.tensor([1, 2]))


def test_missing_weights_error_is_clear():
    for scorer in (ClipScorer("toma-tests/no-such-clip"), DinoFeatures("toma-tests/no-such-dino")):
        with pytest.raises(MissingWeightsError, match="hf download toma-tests/no-such"):
            scorer.load()


def test_load_image_folder(tmp_path):
    from PIL import Image

    for i in range(3):
        Image.new("RGB", (20 + i, 20), (255, 0, 0)).save(tmp_path / f"{i}.png")
    images = load_image_folder(str(tmp_path), size=16)
    assert images.shape == (3, 3, 16, 16)
    assert images[:, 0].min() == 1.0 and images[:, 1:].max() == 0.0
    with pytest.raises(FileNotFoundError):
        load_image_folder(str(tmp_path / "missing"))


def test_temporal_difference_error_matches_a_loop_and_ignores_static_errors():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 5, 2, 4, 6, generator=g, dtype=torch.float64)
    y = torch.rand(3, 5, 2, 4, 6, generator=g, dtype=torch.float64)
    expected = []
    for b in range(3):
        total, count = 0.0, 0
        for t in range(4):
            for v in ((x[b, t + 1] - x[b, t]) - (y[b, t + 1] - y[b, t])).flatten().tolist():
                total += abs(v)
                count += 1
        expected.append(total / count)
    assert temporal_difference_error(x, y).tolist() == pytest.approx(expected, rel=1e-12)
    # an error that is the same in every frame cancels; multiples of 1/16 keep the sums exact
    steady = torch.randint(0, 17, (3, 5, 2, 4, 6), generator=g) / 16
    offset = torch.randint(-4, 5, (3, 1, 2, 4, 6), generator=g) / 16
    assert temporal_difference_error(steady + offset, steady).tolist() == [0.0, 0.0, 0.0]
    assert temporal_difference_error(y, y).dtype == torch.float64


def test_temporal_difference_error_counts_flicker_by_hand():
    ref = torch.zeros(1, 4, 1, 2, 2)  # a still clip
    flicker = ref.clone()
    flicker[:, 1::2] = 0.5  # frames 0.0, 0.5, 0.0, 0.5: every difference is +-0.5
    assert temporal_difference_error(flicker, ref).item() == 0.5
    flicker_one_pixel = ref.clone()
    flicker_one_pixel[0, 2, 0, 0, 0] = 0.4  # one pixel in one frame: differences +0.4, -0.4 among 3 x 4
    assert temporal_difference_error(flicker_one_pixel, ref).item() == pytest.approx(0.8 / 12)


def test_temporal_difference_error_rejects_bad_shapes():
    with pytest.raises(ValueError, match="same shape"):
        temporal_difference_error(torch.zeros(1, 4, 1, 2, 2), torch.zeros(1, 3, 1, 2, 2))
    with pytest.raises(ValueError, match=r"\(B, T, C, H, W\) with T >= 2"):
        temporal_difference_error(torch.zeros(1, 1, 1, 2, 2), torch.zeros(1, 1, 1, 2, 2))
    with pytest.raises(ValueError, match="T >= 2"):
        temporal_difference_error(torch.zeros(4, 1, 2, 2), torch.zeros(4, 1, 2, 2))
