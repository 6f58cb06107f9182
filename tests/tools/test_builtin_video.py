"""The built-in video DiT (a Wan transformer on moving digits): data, shipped weights, ToMA.

The data generator is checked against its defining rules; the model tests load the
weights shipped in the package (never train) and sample a few clips with few Euler steps.
"""

from __future__ import annotations

import pytest
import torch

import toma
from toma.tools.builtin.video import (
    COND_DIM,
    COND_TOKENS,
    DIGIT_SIZE,
    FRAME_SIZE,
    FRAMES,
    STEM_KERNEL,
    VIDEO_DIR,
    classify_frames,
    load_video_dit,
    moving_digit_clips,
    pack,
    render_clips,
    sample_video,
    trajectories,
    unpack,
    video_available,
)

pytestmark = pytest.mark.usefixtures("one_thread")

SPAN = FRAME_SIZE - DIGIT_SIZE
# the wrong-label loss must exceed the right-label loss by this factor (see the test)
CLASS_GAP_FLOOR = 1.02


# ---- data ----------------------------------------------------------------------------


def test_trajectories_bounce_by_the_rule():
    corners = trajectories(500, torch.Generator().manual_seed(0))
    assert corners.shape == (500, FRAMES, 2) and corners.dtype == torch.long
    assert corners.min() == 0 and corners.max() == SPAN  # the walls are reached
    steps = corners[:, 1:] - corners[:, :-1]
    assert steps.abs().max() == 1
    assert (steps[:, 0] != 0).any(dim=1).all()  # every digit moves
    # the rule, one step at a time: keep the velocity unless it would leave [0, SPAN]
    for n in range(500):
        for t in range(FRAMES - 2):
            pos, vel = corners[n, t + 1], steps[n, t]
            leaves = (pos + vel < 0) | (pos + vel > SPAN)
            assert torch.equal(steps[n, t + 1], torch.where(leaves, -vel, vel)), (n, t)
    # all eight directions and every start position occur
    assert len({tuple(v) for v in steps[:, 0].tolist()}) == 8
    assert set(corners[:, 0].flatten().tolist()) == set(range(SPAN + 1))


def test_trajectories_are_seeded_and_check_span():
    a = trajectories(4, torch.Generator().manual_seed(3))
    assert torch.equal(a, trajectories(4, torch.Generator().manual_seed(3)))
    assert not torch.equal(a, trajectories(4, torch.Generator().manual_seed(4)))
    with pytest.raises(ValueError, match="span"):
        trajectories(2, torch.Generator(), span=0)


def test_render_places_an_exact_copy_of_the_digit_per_frame():
    g = torch.Generator().manual_seed(1)
    digits = torch.rand(3, 1, DIGIT_SIZE, DIGIT_SIZE, generator=g) + 0.01  # no zero pixel
    corners = trajectories(3, g)
    clips = render_clips(digits, corners)
    assert clips.shape == (3, FRAMES, 1, FRAME_SIZE, FRAME_SIZE)
    for n in range(3):
        for t in range(FRAMES):
            r, c = corners[n, t].tolist()
            expected = torch.zeros(1, FRAME_SIZE, FRAME_SIZE)
            expected[:, r : r + DIGIT_SIZE, c : c + DIGIT_SIZE] = digits[n]
            assert torch.equal(clips[n, t], expected)
    with pytest.raises(ValueError, match="corners"):
        render_clips(digits, corners + SPAN)
    same = moving_digit_clips(digits, torch.Generator().manual_seed(5))
    assert torch.equal(same, moving_digit_clips(digits, torch.Generator().manual_seed(5)))


def test_pack_gives_each_token_its_in_frame_neighbourhood():
    clips = torch.rand(2, 3, 1, 5, 6, generator=torch.Generator().manual_seed(2))
    packed = pack(clips)
    assert packed.shape == (2, STEM_KERNEL**2, 3, 5, 6)
    padded = torch.nn.functional.pad(clips, (1, 1, 1, 1))  # zero outside each frame
    for b in range(2):
        for t in range(3):
            for r in range(5):
                for c in range(6):
                    window = padded[b, t, 0, r : r + 3, c : c + 3].reshape(-1)
                    assert torch.equal(packed[b, :, t, r, c], window)
    # the centre channel is the pixel itself, and unpack inverts the layout
    assert torch.equal(unpack(packed[:, 4:5]), clips)


def test_pack_with_three_frames_adds_the_neighbouring_frames():
    clips = torch.rand(2, 4, 1, 5, 6, generator=torch.Generator().manual_seed(3))
    own = pack(clips)
    packed = pack(clips, stem_frames=3)
    assert packed.shape == (2, 3 * STEM_KERNEL**2, 4, 5, 6)
    for t in range(4):
        assert torch.equal(packed[:, 9:18, t], own[:, :, t])  # the middle block is the frame's own
        before = own[:, :, t - 1] if t > 0 else torch.zeros_like(own[:, :, 0])
        after = own[:, :, t + 1] if t < 3 else torch.zeros_like(own[:, :, 0])
        assert torch.equal(packed[:, :9, t], before) and torch.equal(packed[:, 18:, t], after)
    with pytest.raises(ValueError, match="stem_frames"):
        pack(clips, stem_frames=2)


# ---- sampler -------------------------------------------------------------------------


class ExactVelocity(torch.nn.Module):
    """A stand-in Wan transformer that returns the exact rectified-flow velocity towards a
    known clip: ``(x_t - x0) / t`` with ``x0`` the ``target`` of each row's class.

    Rows whose class tokens are all zero (the null class below) head for ``null_target``.
    It reads ``x_t`` back from the packed input (the centre pixel of the token's own frame)
    and ``t`` from Wan's ``1000 t`` timestep, so a wrong sign, time scale, packing or
    guidance combination in :func:`sample_video` stops it from landing on the clip.
    """

    def __init__(self, target: torch.Tensor, null_target: torch.Tensor, stem_frames: int = 3):
        super().__init__()
        self.config = type("Config", (), {"in_channels": stem_frames * STEM_KERNEL**2})()
        self.target, self.null_target, self.stem_frames = target, null_target, stem_frames
        self.timesteps: list[float] = []  # the timestep of each call, as Wan receives it

    def forward(self, hidden_states, timestep, encoder_hidden_states):
        self.timesteps.append(timestep[0].item())
        centre = (self.stem_frames // 2) * STEM_KERNEL**2 + STEM_KERNEL**2 // 2
        x = hidden_states[:, centre : centre + 1].transpose(1, 2)  # (B, T, 1, H, W)
        null = encoder_hidden_states.flatten(1).abs().sum(dim=1) == 0
        x0 = torch.where(null.view(-1, 1, 1, 1, 1), self.null_target, self.target)
        v = (x - x0) / (timestep / 1000.0).view(-1, 1, 1, 1, 1)
        return type("Output", (), {"sample": v.transpose(1, 2)})()


def exact_model(target: torch.Tensor, null_target: torch.Tensor, time_shift: float | None = None):
    from toma.tools.builtin.unet import NULL_CLASS, DigitClassifier
    from toma.tools.builtin.video import BuiltinVideoDiT

    tokens = torch.ones(11, COND_TOKENS, COND_DIM)
    tokens[NULL_CLASS] = 0.0
    metadata = {} if time_shift is None else {"time_shift": time_shift}
    return BuiltinVideoDiT(
        transformer=ExactVelocity(target, null_target),
        class_tokens=tokens,
        classifier=DigitClassifier(),
        metadata=metadata,
    )


def test_shift_times_by_its_formula():
    from toma.tools.builtin.video import shift_times, time_grid

    t = torch.linspace(0, 1, 101, dtype=torch.float64)
    assert torch.equal(shift_times(t, 1.0), t)
    for s in (0.5, 3.0):
        out = shift_times(t, s)
        assert out[0] == 0 and out[-1] == 1 and (out.diff() > 0).all()
        for a, b in zip(t.tolist(), out.tolist()):
            assert b == pytest.approx(s * a / (1 + (s - 1) * a), rel=1e-12)
    assert (shift_times(t[1:-1], 3.0) > t[1:-1]).all()  # towards noise
    grid = time_grid(4, 3.0)
    assert grid[0] == 1 and grid[-1] == 0 and grid[2] == pytest.approx(0.75)  # 3 * 0.5 / 2
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="shift"):
            shift_times(t, bad)


@pytest.mark.parametrize("steps, time_shift", [(1, None), (3, None), (10, None), (3, 3.0), (10, 3.0)])
def test_sampler_with_the_exact_velocity_lands_on_the_clip(steps, time_shift):
    g = torch.Generator().manual_seed(0)
    target = torch.rand(2, FRAMES, 1, FRAME_SIZE, FRAME_SIZE, generator=g) * 1.6 - 0.8  # in [-1, 1] units
    model = exact_model(target, torch.zeros_like(target), time_shift)
    clips = sample_video(model, [3, 7], [0, 1], steps=steps, guidance_scale=1.0, progress=False)
    # x_{i+1} - x0 = (x_i - x0) t_{i+1} / t_i, exactly 0 at t = 0: only float rounding is left
    torch.testing.assert_close(clips, (target + 1.0) / 2.0, rtol=0, atol=1e-5)
    # the Euler times are the model's shifted grid, on Wan's 0..1000 scale
    from toma.tools.builtin.video import time_grid

    expected = (1000.0 * time_grid(steps, 1.0 if time_shift is None else time_shift)[:-1]).tolist()
    assert model.transformer.timesteps == pytest.approx(expected, rel=1e-6)


def test_sampler_guidance_extrapolates_from_the_null_class():
    g = torch.Generator().manual_seed(1)
    target = torch.rand(1, FRAMES, 1, FRAME_SIZE, FRAME_SIZE, generator=g) * 0.6 - 0.3
    null_target = torch.rand(1, FRAMES, 1, FRAME_SIZE, FRAME_SIZE, generator=g) * 0.6 - 0.3
    model = exact_model(target, null_target)
    clips = sample_video(model, [5], [2], steps=4, guidance_scale=2.0, progress=False)
    # v_u + 2 (v_c - v_u) is the exact velocity towards 2 x0_c - x0_u (inside [-1, 1] here)
    torch.testing.assert_close(clips, (2.0 * target - null_target + 1.0) / 2.0, rtol=0, atol=1e-5)


# ---- shipped model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return load_video_dit()


def test_video_files_ship_and_are_small():
    assert video_available(), f"built-in video DiT missing under {VIDEO_DIR}; run scripts/train_builtin_video.py"
    size = sum(p.stat().st_size for p in VIDEO_DIR.rglob("*") if p.is_file())
    assert size < 20 * 10**6


def test_video_dit_loads_as_a_wan_transformer(model):
    from diffusers import WanTransformer3DModel

    assert isinstance(model.transformer, WanTransformer3DModel)
    assert not model.transformer.training
    assert next(model.transformer.parameters()).dtype == torch.float32
    assert model.class_tokens.shape == (11, COND_TOKENS, COND_DIM)
    assert model.metadata["frame_classifier_accuracy_real_clips"] > 0.85


def test_sample_shape_and_2048_video_tokens(model):
    seen: list[int] = []
    handle = model.transformer.blocks[0].attn1.to_q.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[1]))
    try:
        clips = sample_video(model, [3, 7], [0, 1], steps=1, progress=False)
    finally:
        handle.remove()
    assert clips.shape == (2, FRAMES, 1, FRAME_SIZE, FRAME_SIZE) and clips.dtype == torch.float32
    assert 0.0 <= clips.min() and clips.max() <= 1.0
    assert seen == [FRAMES * FRAME_SIZE * FRAME_SIZE] == [2048]
    assert sample_video(model, [5], 0, steps=1, guidance_scale=1.0, progress=False).shape == (1, *clips.shape[1:])


def test_sample_rejects_bad_arguments(model):
    with pytest.raises(ValueError, match="labels"):
        sample_video(model, [10], [0], steps=1, progress=False)
    with pytest.raises(ValueError, match="seeds"):
        sample_video(model, [1, 2], [0], steps=1, progress=False)
    with pytest.raises(ValueError, match="steps"):
        sample_video(model, [1], [0], steps=0, progress=False)


def real_clips(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Clips ``(count, T, 1, S, S)`` of the last ``count`` bundled digits and their labels."""
    from sklearn.datasets import load_digits

    from toma.tools.builtin.unet import IMAGE_SIZE
    from toma.tools.builtin.video import shrink_digits

    digits = load_digits()
    images = torch.tensor(digits.images[-count:], dtype=torch.float32).unsqueeze(1) / 16.0
    # the training data's path: bicubic to 32 x 32 (as the UNet's), then area down to the digit size
    images = torch.nn.functional.interpolate(images, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bicubic", align_corners=False)
    clips = moving_digit_clips(shrink_digits(images.clamp(0, 1)), torch.Generator().manual_seed(0))
    return clips, torch.tensor(digits.target[-count:])


def test_frame_classifier_reads_real_clips(model):
    clips, labels = real_clips(40)
    preds, feats = classify_frames(model.classifier, clips)
    assert preds.shape == (40, FRAMES) and feats.shape == (40, FRAMES, 64)
    # measured 0.98 on the test split's frames (the classifier before it: 0.91); chance is 0.1
    assert (preds == labels[:, None]).float().mean() > 0.9


def test_the_class_steers_the_velocity(model):
    """Real clips noised to t = 0.8 are predicted worse under wrong labels: the class tokens
    reach the video through the cross-attention and decide the digit.

    At t = 0.8 the digit's shape is still open, so its class matters. The first trained
    model (width 64, cross-attention output initialised at zero, 900 steps) ignored its
    class: on these 30 clips its two losses are 0.6% apart; the step-806 checkpoint 3.7%.
    """
    from toma.tools.builtin.unet import NUM_CLASSES
    from toma.tools.builtin.video import velocity

    clips, labels = real_clips(30)
    clean = clips * 2.0 - 1.0
    noise = torch.randn(clean.shape, generator=torch.Generator().manual_seed(0))
    t = torch.full((len(labels),), 0.8)
    noisy = (1.0 - 0.8) * clean + 0.8 * noise

    def loss(lab: torch.Tensor) -> float:
        pred = velocity(model.transformer, noisy, t, model.class_tokens[lab])
        return torch.nn.functional.mse_loss(pred, noise - clean).item()

    right, wrong = loss(labels), loss((labels + 3) % NUM_CLASSES)
    assert wrong > CLASS_GAP_FLOOR * right, (right, wrong)


def test_a_few_sampled_clips_classify_above_chance(model):
    if model.metadata.get("partial"):
        pytest.skip(
            f"the shipped checkpoint is partial ({model.metadata.get('steps_done')} steps); "
            "its samples are not judged until training has finished"
        )
    labels = [0, 1, 2, 3, 4]
    clips = sample_video(model, labels, [10_000 + i for i in range(5)], steps=4, progress=False)
    preds, _ = classify_frames(model.classifier, clips)
    # 5 clips x 8 frames; chance is 4 of 40 frames
    assert (preds == torch.tensor(labels)[:, None]).sum() >= 20


def test_apply_then_remove_is_bitwise(model):
    ref = sample_video(model, [2, 8], [5, 6], steps=2, progress=False)
    toma.apply_toma(model.transformer, ratio=0.5)
    try:
        sample_video(model, [2, 8], [5, 6], steps=2, progress=False)
    finally:
        toma.remove_toma(model.transformer)
    assert torch.equal(sample_video(model, [2, 8], [5, 6], steps=2, progress=False), ref)


def test_ratio_zero_is_bitwise(model):
    ref = sample_video(model, [1], [3], steps=2, progress=False)
    toma.apply_toma(model.transformer, ratio=0.0)
    try:
        out = sample_video(model, [1], [3], steps=2, progress=False)
    finally:
        toma.remove_toma(model.transformer)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("tile_frames", [1, 2])
def test_ratio_half_merges_the_later_blocks(model, tile_frames):
    ref = sample_video(model, [4, 9], [7, 8], steps=2, progress=False)
    seen: dict[int, set[int]] = {}
    handles = [
        block.attn1.to_q.register_forward_hook(lambda m, a, o, i=i: seen.setdefault(i, set()).add(a[0].shape[1]))
        for i, block in enumerate(model.transformer.blocks)
    ]
    patch = toma.apply_toma(model.transformer, ratio=0.5, tile_frames=tile_frames)
    try:
        merged = sample_video(model, [4, 9], [7, 8], steps=2, progress=False)
    finally:
        toma.remove_toma(model.transformer)
        for h in handles:
            h.remove()
    assert patch.patched and torch.isfinite(merged).all() and not torch.equal(merged, ref)
    n = len(model.transformer.blocks)
    # the default skips the first half of the blocks; the others attend over half the tokens
    assert seen == {i: ({2048} if i < n // 2 else {1024}) for i in range(n)}


def test_training_gives_the_class_path_its_own_learning_rate():
    """The training script's AdamW groups: every parameter once; the class tokens, text
    embedder and cross-attention (the class's only way in) at ``--cond-lr-mult`` times the rate,
    which ``optimise`` applies on top of the schedule."""
    import argparse
    import sys
    from pathlib import Path

    from diffusers import WanTransformer3DModel

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    try:
        from train_builtin import lr_at, optimise
        from train_builtin_video import param_groups
    finally:
        sys.path.pop(0)
    from toma.tools.builtin.video import transformer_config

    transformer = WanTransformer3DModel(**transformer_config(3))
    tokens = torch.nn.Parameter(torch.randn(11, COND_TOKENS, COND_DIM))
    rest, cond = param_groups(transformer, tokens, 3.0)
    names = {id(p): n for n, p in transformer.named_parameters()}
    assert len(rest["params"]) + len(cond["params"]) == len(names) + 1
    cond_names = {names.get(id(p), "tokens") for p in cond["params"]}
    assert "tokens" in cond_names and "condition_embedder.text_embedder.linear_1.weight" in cond_names
    assert all(n == "tokens" or "attn2" in n or "norm2" in n or "text_embedder" in n for n in cond_names)
    assert {f"blocks.{i}.attn2.to_k.weight" for i in range(4)} <= cond_names
    assert not any("attn1" in n or "ffn" in n for n in cond_names)

    opt = torch.optim.AdamW([rest, cond], lr=1.0)
    args = argparse.Namespace(lr=1e-3, warmup=10, steps=100)
    loss = sum(p.float().sum() for p in transformer.parameters()) + tokens.sum()
    optimise(opt, [*transformer.parameters(), tokens], loss, 50, args)
    assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(50, args))
    assert opt.param_groups[1]["lr"] == pytest.approx(3.0 * lr_at(50, args))


def _train_script():
    """The training script module (``scripts/train_builtin_video.py``), imported without running it."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    try:
        return importlib.import_module("train_builtin_video")
    finally:
        sys.path.pop(0)


def test_clip_schedule_runs_the_stages_in_order():
    """The clip-length curriculum: each step's (frames, batch) against a brute-force expansion
    of the stages, the stage boundaries, and the errors for steps outside the schedule."""
    script = _train_script()
    stages = [script.parse_stage(s) for s in ("2x32:5", "4x16:1", " 8 x 8 : 3 ")]
    assert stages == [(2, 32, 5), (4, 16, 1), (8, 8, 3)]
    expanded = [(s.frames, s.batch) for s in stages for _ in range(s.steps)]
    assert [script.clip_schedule(step, stages) for step in range(9)] == expanded
    assert script.clip_schedule(4, stages) == (2, 32) and script.clip_schedule(5, stages) == (4, 16)
    assert script.clip_schedule(6, stages) == (8, 8) and script.clip_schedule(8, stages) == (8, 8)
    with pytest.raises(ValueError, match="step must be < 9"):
        script.clip_schedule(9, stages)
    with pytest.raises(ValueError, match="step must be >= 0"):
        script.clip_schedule(-1, stages)
    with pytest.raises(ValueError, match="at least one stage"):
        script.clip_schedule(0, [])


@pytest.mark.parametrize(
    "text, match",
    [
        ("2x32", "FRAMESxBATCH:STEPS"),
        ("2x32:-1", "FRAMESxBATCH:STEPS"),
        ("0x8:10", "frames must be in"),
        ("65x1:1", "frames must be in"),
        ("2x0:10", "batch and steps"),
        ("2x8:0", "batch and steps"),
    ],
)
def test_parse_stage_rejects_bad_stages(text, match):
    with pytest.raises(ValueError, match=match):
        _train_script().parse_stage(text)


def test_default_curriculum_ends_on_clips_of_the_shipped_length():
    """The default stages finish on FRAMES-frame clips (the model's use) and spend most steps
    on shorter, cheaper clips with a batch that keeps the tokens per step at FRAMES x 8 clips."""
    script = _train_script()
    defaults = script.build_parser().parse_args([]).stages
    assert defaults == ["2x32:2400", "8x8:700"]
    stages = [script.parse_stage(s) for s in defaults]
    assert script.clip_schedule(sum(s.steps for s in stages) - 1, stages) == (FRAMES, 8)
    assert all(s.frames * s.batch == FRAMES * 8 for s in stages)
    assert " ".join(defaults) in script.__doc__  # the docstring documents the default
