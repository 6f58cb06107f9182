"""A whole diffusers pipeline, saved and loaded back, runs with ToMA applied."""

from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler, FluxPipeline, StableDiffusionXLPipeline
from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

import toma
from tests.tiny_models import make_flux, make_sdxl_unet
from tests.tiny_pipelines import clip_config, merged_round_trip, tiny_clip_tokenizer, tiny_sd_pipeline, tiny_vae


def test_sdxl_pipeline_round_trip(tmp_path):
    torch.manual_seed(0)
    pipe = StableDiffusionXLPipeline(
        vae=tiny_vae(),
        text_encoder=CLIPTextModel(clip_config()),
        text_encoder_2=CLIPTextModelWithProjection(clip_config(projection_dim=32)),
        tokenizer=tiny_clip_tokenizer(tmp_path / "tok"),
        tokenizer_2=tiny_clip_tokenizer(tmp_path / "tok2"),
        unet=make_sdxl_unet(),
        scheduler=EulerDiscreteScheduler(),
    )
    pipe.save_pretrained(tmp_path / "pipe")
    pipe = StableDiffusionXLPipeline.from_pretrained(tmp_path / "pipe", local_files_only=True)

    def generate():
        g = torch.Generator().manual_seed(0)
        return pipe("a red fox", height=40, width=32, num_inference_steps=3, generator=g, output_type="np").images

    ref = generate()
    patch = toma.apply_toma(pipe, ratio=0.5)
    calls = []
    handle = patch.patched[0].module.to_q.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[:2]))
    merged = generate()
    handle.remove()
    # 40x32 px -> 20x16 latent -> 10x8 tokens at downsample 2, half kept; one CFG batch of 2 per step
    assert calls == [(2, patch.cache.layout(10, 8).num_merged)] * 3
    assert patch.cache.layout(10, 8).num_merged == 40
    assert merged.shape == ref.shape and np.isfinite(merged).all()
    assert not np.array_equal(merged, ref)
    toma.remove_toma(pipe)
    assert np.array_equal(generate(), ref)


def build_flux(tmp_path):
    torch.manual_seed(0)
    t5 = T5EncoderModel(T5Config(vocab_size=60, d_model=32, d_ff=32, d_kv=8, num_layers=1, num_heads=2))
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_vae(),
        text_encoder=CLIPTextModel(clip_config(projection_dim=32, hidden_size=32)),
        tokenizer=tiny_clip_tokenizer(tmp_path / "tok"),
        text_encoder_2=t5,
        tokenizer_2=tiny_clip_tokenizer(tmp_path / "tok2"),
        transformer=make_flux(),
    )


def test_flux_pipeline_round_trip(tmp_path):
    build_flux(tmp_path).save_pretrained(tmp_path / "pipe")
    pipe = FluxPipeline.from_pretrained(tmp_path / "pipe", local_files_only=True)
    kw = dict(height=32, width=48, num_inference_steps=3, max_sequence_length=16, output_type="np")
    ref = pipe("a red fox", generator=torch.Generator().manual_seed(0), **kw).images
    toma.apply_toma(pipe, ratio=0.5, flux_double_blocks=(0, 1), flux_single_blocks=(0, 1))
    merged = pipe("a red fox", generator=torch.Generator().manual_seed(0), **kw).images
    assert merged.shape == ref.shape and np.isfinite(merged).all() and not np.array_equal(merged, ref)
    toma.remove_toma(pipe)
    assert np.array_equal(pipe("a red fox", generator=torch.Generator().manual_seed(0), **kw).images, ref)


def build_sd3(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    from tests.tiny_models import make_sd3

    torch.manual_seed(0)
    return StableDiffusion3Pipeline(
        transformer=make_sd3(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_vae(),
        # the two CLIP encoders side by side fill the T5 width (2 x 16 = 32); pooled: 2 x 8
        text_encoder=CLIPTextModelWithProjection(clip_config(projection_dim=8)),
        tokenizer=tiny_clip_tokenizer(tmp_path / "tok"),
        text_encoder_2=CLIPTextModelWithProjection(clip_config(projection_dim=8)),
        tokenizer_2=tiny_clip_tokenizer(tmp_path / "tok2"),
        text_encoder_3=T5EncoderModel(T5Config(vocab_size=60, d_model=32, d_ff=32, d_kv=8, num_layers=1, num_heads=2)),
        tokenizer_3=tiny_clip_tokenizer(tmp_path / "tok3"),
    )


def test_sd3_pipeline_round_trip(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    build_sd3(tmp_path).save_pretrained(tmp_path / "pipe")
    pipe = StableDiffusion3Pipeline.from_pretrained(tmp_path / "pipe", local_files_only=True)
    kw = dict(height=64, width=48, num_inference_steps=2, max_sequence_length=16, output_type="np")

    def generate():
        return pipe("a red fox", generator=torch.Generator().manual_seed(0), **kw).images

    # 64x48 px -> 32x24 latent (the tiny VAE halves) -> 16x12 tokens, half kept; one CFG batch of 2 per step
    merged_round_trip(pipe, generate, [(2, 96)] * 2, blocks={"transformer_blocks": range(4)})


def test_wan_pipeline_round_trip(tmp_path):
    from diffusers import AutoencoderKLWan, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    from tests.tiny_models import make_wan

    torch.manual_seed(0)
    pipe = WanPipeline(
        tokenizer=tiny_clip_tokenizer(tmp_path / "tok"),
        text_encoder=UMT5EncoderModel(
            UMT5Config(vocab_size=60, d_model=32, d_ff=32, d_kv=8, num_layers=1, num_heads=2)
        ),
        transformer=make_wan(in_channels=16),
        vae=AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    pipe.save_pretrained(tmp_path / "pipe")
    pipe = WanPipeline.from_pretrained(tmp_path / "pipe", local_files_only=True)
    kw = dict(height=64, width=48, num_frames=5, num_inference_steps=2, max_sequence_length=16, output_type="np")

    def generate():
        return pipe("a red fox", generator=torch.Generator().manual_seed(0), **kw).frames

    # 5 frames x 64x48 px -> 2 x 8x6 latent -> 2 x 4x3 tokens; 2x4x4 tiles shrink to the
    # grid (2x4x3 = 24 tokens, 12 kept); the conditional and unconditional passes run apart
    merged_round_trip(pipe, generate, [(1, 12)] * 4, blocks={"blocks": range(3)})


def test_pixart_pipeline_round_trip(tmp_path):
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline

    from tests.tiny_models import make_pixart

    torch.manual_seed(0)
    pipe = PixArtSigmaPipeline(
        tokenizer=tiny_clip_tokenizer(tmp_path / "tok"),
        text_encoder=T5EncoderModel(T5Config(vocab_size=60, d_model=32, d_ff=32, d_kv=8, num_layers=1, num_heads=2)),
        vae=tiny_vae(),
        transformer=make_pixart(),
        scheduler=DPMSolverMultistepScheduler(),
    )
    pipe.save_pretrained(tmp_path / "pipe")
    pipe = PixArtSigmaPipeline.from_pretrained(tmp_path / "pipe", local_files_only=True)
    kw = dict(
        height=32,
        width=48,
        num_inference_steps=2,
        max_sequence_length=16,
        output_type="np",
        use_resolution_binning=False,
    )

    def generate():
        return pipe("a red fox", generator=torch.Generator().manual_seed(0), **kw).images

    # 32x48 px -> 16x24 latent (the tiny VAE halves) -> 8x12 tokens, half kept; one CFG batch of 2 per step
    merged_round_trip(pipe, generate, [(2, 48)] * 2, blocks={"transformer_blocks": range(3)})


def test_img2img_after_a_stopped_run_builds_its_own_plans(tmp_path):
    # With recompute_every > 1, plans carry over between steps of one run. A run stopped
    # early followed by img2img (which starts at a lower timestep) looked like the same run
    # to the denoiser, and reused the stopped run's plans for another image.
    from diffusers import StableDiffusionImg2ImgPipeline

    def build():
        torch.manual_seed(0)
        return tiny_sd_pipeline(tmp_path / "tok", StableDiffusionImg2ImgPipeline)

    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))

    def img2img(pipe):
        return pipe(
            "a fox",
            image=image,
            strength=0.3,
            num_inference_steps=10,
            output_type="np",
            generator=torch.Generator().manual_seed(0),
        ).images

    def stop_after_two(pipe, step, timestep, kwargs):
        pipe._interrupt = step >= 1
        return kwargs

    fresh = build()
    toma.apply_toma(fresh, ratio=0.5, recompute_every=100)
    expected = img2img(fresh)

    pipe = build()
    signature = inspect.signature(pipe.scheduler.set_timesteps)
    toma.apply_toma(pipe, ratio=0.5, recompute_every=100)
    # pipelines read it to see whether custom sigmas or timesteps may be passed
    assert inspect.signature(pipe.scheduler.set_timesteps) == signature
    pipe(
        "a fox",
        image=torch.rand(1, 3, 32, 32),
        strength=1.0,
        num_inference_steps=10,
        output_type="np",
        callback_on_step_end=stop_after_two,
    )
    assert np.array_equal(img2img(pipe), expected)
    # removal restores the scheduler's own method
    toma.remove_toma(pipe)
    assert "set_timesteps" not in vars(pipe.scheduler)


def tiny_wan_folder(tmp_path):
    from diffusers import AutoencoderKLWan, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    from tests.tiny_models import make_wan

    torch.manual_seed(0)
    WanPipeline(
        tokenizer=tiny_clip_tokenizer(tmp_path / "tok"),
        text_encoder=UMT5EncoderModel(
            UMT5Config(vocab_size=60, d_model=32, d_ff=32, d_kv=8, num_layers=1, num_heads=2)
        ),
        transformer=make_wan(in_channels=16),
        vae=AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    ).save_pretrained(tmp_path / "wan")
    return tmp_path / "wan"


def test_generate_and_eval_on_a_local_video_pipeline(tmp_path, one_thread):
    # toma generate / eval load any local diffusers pipeline; a video pipeline's clips are
    # written as an animated GIF or a strip of frames, and scored frame by frame
    from PIL import Image

    from toma.tools.cli import main

    folder = tiny_wan_folder(tmp_path)
    common = [
        "--model",
        str(folder),
        "--height",
        "32",
        "--width",
        "32",
        "--frames",
        "5",
        "--steps",
        "2",
        "--threads",
        "1",
    ]
    gif = tmp_path / "clip.gif"
    assert main(["generate", *common, "--compare", "--out", str(gif)]) == 0
    with Image.open(gif) as im:
        assert im.n_frames == 5 and im.width > 2 * 32  # both clips side by side in every frame
    strip = tmp_path / "clip.png"
    assert main(["generate", *common, "--out", str(strip)]) == 0
    with Image.open(strip) as im:
        assert im.width >= 5 * 32
    out = tmp_path / "ev"
    assert main(["eval", *common, "--num-images", "1", "--methods", "toma", "--out-dir", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["results"]
    assert [r["method"] for r in rows] == ["none", "toma"]
    assert rows[0]["psnr"] is None and rows[0]["ssim"] == 1  # the reference against itself (PSNR infinite)
    assert 0 < rows[1]["psnr"] < 99


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_generate_and_eval_on_a_local_transformer_pipeline(family, tmp_path, one_thread):
    # toma generate / eval run any local image pipeline, here the MMDiT families
    from PIL import Image

    from toma.tools.cli import main

    {"flux": build_flux, "sd3": build_sd3}[family](tmp_path).save_pretrained(tmp_path / "pipe")
    common = ["--model", str(tmp_path / "pipe"), "--height", "32", "--width", "32", "--steps", "2", "--threads", "1"]
    png = tmp_path / "cmp.png"
    assert main(["generate", *common, "--compare", "--out", str(png)]) == 0
    with Image.open(png) as im:
        assert im.width > 2 * 32  # unmerged and merged side by side
    out = tmp_path / "ev"
    assert (
        main(
            [
                "eval",
                *common,
                "--num-images",
                "1",
                "--methods",
                "toma",
                "--out-dir",
                str(out),
                "--blocks",
                "transformer_blocks=0-1" if family == "flux" else "transformer_blocks=0-3",
            ]
        )
        == 0
    )
    rows = json.loads((out / "results.json").read_text())["results"]
    assert [r["method"] for r in rows] == ["none", "toma"] and 0 < rows[1]["psnr"] < 99


def build_sd(tmp_path):
    torch.manual_seed(0)
    return tiny_sd_pipeline(tmp_path / "tok")


def test_frames_is_refused_for_image_pipelines(tmp_path, capsys):
    from toma.tools.cli import main

    folder = tmp_path / "sd"
    build_sd(tmp_path).save_pretrained(folder)
    assert main(["generate", "--model", str(folder), "--frames", "5", "--out", str(tmp_path / "x.png")]) == 2
    assert "--frames applies to video pipelines" in capsys.readouterr().err


def test_flux_kontext_pipeline_merges_the_image_and_keeps_the_reference_whole(tmp_path):
    from diffusers import FluxKontextPipeline
    from PIL import Image

    pipe = FluxKontextPipeline(**build_flux(tmp_path).components)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8))

    def generate():
        torch.manual_seed(0)  # the pipeline samples the reference's latents from the global generator
        return pipe(
            image=image,
            prompt="a red fox",
            height=32,
            width=48,
            num_inference_steps=3,
            max_sequence_length=16,
            output_type="np",
            generator=torch.Generator().manual_seed(0),
            _auto_resize=False,
            max_area=32 * 48,
        ).images

    # 32x48 px -> 8x12 = 96 packed tokens, half kept, then the reference image's 96 whole
    merged_round_trip(pipe, generate, [(1, 48 + 96)] * 3, flux_double_blocks=(0, 1), flux_single_blocks=(0, 1))


def tiny_wan_vace_folder(tmp_path):
    """A tiny Wan VACE pipeline saved to a folder: Wan's tiny parts, a VACE transformer whose
    control input is what the pipeline prepares (16 + 16 control latents, 8 x 8 mask channels)."""
    from diffusers import AutoencoderKLWan, WanVACEPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    from tests.tiny_models import make_wan_vace

    torch.manual_seed(0)
    WanVACEPipeline(
        tokenizer=tiny_clip_tokenizer(tmp_path / "tok"),
        text_encoder=UMT5EncoderModel(
            UMT5Config(vocab_size=60, d_model=32, d_ff=32, d_kv=8, num_layers=1, num_heads=2)
        ),
        transformer=make_wan_vace(channels=16, vace_in_channels=16 * 2 + 8 * 8),
        vae=AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    ).save_pretrained(tmp_path / "vace")
    return tmp_path / "vace"


def generate_compare_clip(
    monkeypatch, tmp_path, folder, ratio, watch, height: int = 64, width: int = 48
) -> tuple[torch.Tensor, torch.Tensor]:
    """``toma generate --compare`` on the tiny video pipeline in ``folder`` at ``height x
    width`` px, 5 frames, 2 steps: the unmerged and the merged clip, ``(1, 5, 3, height,
    width)`` each, after ``watch(pipe)`` has hooked the loaded pipeline."""
    from PIL import Image

    import toma.tools.generate as generate
    from toma.tools.cli import main

    clips = []
    load, save_video = generate.load_pipeline, generate.save_video

    def load_and_watch(*args):
        pipe = load(*args)
        watch(pipe)
        return pipe

    def save_and_keep(args, baseline, merged, *rest, **kw):
        clips.extend([baseline, merged])
        return save_video(args, baseline, merged, *rest, **kw)

    monkeypatch.setattr(generate, "load_pipeline", load_and_watch)
    monkeypatch.setattr(generate, "save_video", save_and_keep)
    gif = tmp_path / "clip.gif"
    args = ["--model", str(folder), "--height", str(height), "--width", str(width), "--frames", "5", "--steps", "2"]
    assert main(["generate", *args, "--ratio", str(ratio), "--threads", "1", "--compare", "--out", str(gif)]) == 0
    with Image.open(gif) as im:
        assert im.n_frames == 5 and im.width > 2 * width  # both clips side by side in every frame
    baseline, merged = clips
    assert baseline.shape == merged.shape == (1, 5, 3, height, width)
    return baseline, merged


@pytest.mark.parametrize("ratio", [0.5, 0.0])
def test_generate_runs_a_wan_vace_pipeline(ratio, tmp_path, one_thread, monkeypatch):
    # toma generate on WanVACEPipeline: both the main and the control blocks see the merged
    # token count, and ratio 0 gives the unmerged clip bitwise
    from diffusers.pipelines.wan import pipeline_wan_vace

    if not hasattr(pipeline_wan_vace, "ftfy"):
        # diffusers 0.42's VACE prompt cleaning calls ftfy unguarded (WanPipeline checks it is
        # installed); the prompt here is plain ASCII, which ftfy leaves as it is
        monkeypatch.setattr(pipeline_wan_vace, "ftfy", SimpleNamespace(fix_text=str), raising=False)
    seen: dict[str, list[int]] = {"blocks": [], "vace_blocks": []}

    def watch(pipe):
        for stack in seen:
            attn = getattr(pipe.transformer, stack)[-1].attn1  # the default merges the last blocks
            attn.to_q.register_forward_hook(lambda m, a, o, stack=stack: seen[stack].append(a[0].shape[1]))

    baseline, merged = generate_compare_clip(monkeypatch, tmp_path, tiny_wan_vace_folder(tmp_path), ratio, watch)
    # 5 frames x 64x48 px -> 2 x 8x6 latent -> 24 tokens (2 x 4x3); the conditional and
    # unconditional passes run apart: a 1-step warm-up and 2 steps, unmerged then with ToMA
    kept = 24 - int(24 * ratio)
    for stack, counts in seen.items():
        assert counts == [24] * 6 + [kept] * 6, stack
    if ratio == 0:
        assert torch.equal(merged, baseline)
    else:
        assert torch.isfinite(merged).all() and not torch.equal(merged, baseline)


def tiny_hunyuan15_folder(tmp_path):
    """A tiny HunyuanVideo 1.5 pipeline saved to a folder: a Qwen2.5-VL text model and a ByT5
    encoder from config, the byte-level Qwen2 tokenizer, ByT5's (it needs no files), a 4-channel
    VAE (8x space, 4x time) and a transformer taking latents, condition latents and mask (9)."""
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Pipeline
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    from tests.adapters.test_dit_mmdit import tiny_qwen2_tokenizer
    from tests.tiny_models import TEXT_DIM, make_hunyuan15

    tokenizer = tiny_qwen2_tokenizer(tmp_path / "tok")
    torch.manual_seed(0)
    text = Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_DIM,
        intermediate_size=32,
        num_hidden_layers=3,  # the pipeline reads the third hidden state from the end
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]},
        max_position_embeddings=2048,  # the pipeline pads the templated prompt to 1108 tokens
        bos_token_id=None,
        eos_token_id=None,
    )
    HunyuanVideo15Pipeline(
        text_encoder=Qwen2_5_VLTextModel(text),
        tokenizer=tokenizer,
        transformer=make_hunyuan15(in_channels=2 * 4 + 1),
        vae=AutoencoderKLHunyuanVideo15(
            latent_channels=4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            spatial_compression_ratio=8,
            temporal_compression_ratio=4,
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        text_encoder_2=T5EncoderModel(T5Config(vocab_size=384, d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2)),
        tokenizer_2=ByT5Tokenizer(),
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    ).save_pretrained(tmp_path / "hv15")
    return tmp_path / "hv15"


@pytest.mark.parametrize("ratio", [0.5, 0.0])
def test_generate_runs_a_hunyuanvideo15_pipeline(ratio, tmp_path, one_thread, monkeypatch):
    # toma generate on HunyuanVideo15Pipeline: its merged block sees the token count the
    # ratio implies, and ratio 0 gives the unmerged clip bitwise
    seen: list[int] = []

    def watch(pipe):
        # the default merges the last block; its attention projects the video tokens in to_q
        pipe.transformer.transformer_blocks[-1].attn.to_q.register_forward_hook(
            lambda m, a, o: seen.append(a[0].shape[1])
        )

    baseline, merged = generate_compare_clip(monkeypatch, tmp_path, tiny_hunyuan15_folder(tmp_path), ratio, watch)
    # 5 frames x 64x48 px -> 2 x 8x6 latent -> 24 tokens (2 x 4x3); the guider runs the
    # conditional and unconditional passes apart: a 1-step warm-up and 2 steps, unmerged then with ToMA
    kept = 24 - int(24 * ratio)
    assert seen == [24] * 6 + [kept] * 6
    if ratio == 0:
        assert torch.equal(merged, baseline)
    else:
        assert torch.isfinite(merged).all() and not torch.equal(merged, baseline)


def test_generate_passes_a_control_video_to_wan_vace(tmp_path, one_thread, monkeypatch, capsys):
    # --video reaches WanVACEPipeline as its control video: the unmerged clip differs from the
    # one the pipeline's zero video gives, and the control blocks still merge to half
    from diffusers.pipelines.wan import pipeline_wan_vace
    from PIL import Image

    import toma.tools.generate as generate
    from toma.tools.cli import main

    if not hasattr(pipeline_wan_vace, "ftfy"):  # see test_generate_runs_a_wan_vace_pipeline
        monkeypatch.setattr(pipeline_wan_vace, "ftfy", SimpleNamespace(fix_text=str), raising=False)
    folder = tiny_wan_vace_folder(tmp_path)
    rng = np.random.default_rng(0)
    frames = [Image.fromarray(rng.integers(0, 256, (64, 48, 3), dtype=np.uint8)) for _ in range(5)]
    control = tmp_path / "control.gif"
    frames[0].save(control, save_all=True, append_images=frames[1:])
    seen: list[int] = []
    clips = []
    load = generate.load_pipeline
    save_video = generate.save_video

    def load_and_watch(*args):
        pipe = load(*args)
        pipe.transformer.vace_blocks[-1].attn1.to_q.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[1]))
        return pipe

    def save_and_keep(args, baseline, merged, *rest, **kw):
        clips.append(baseline)
        return save_video(args, baseline, merged, *rest, **kw)

    monkeypatch.setattr(generate, "load_pipeline", load_and_watch)
    monkeypatch.setattr(generate, "save_video", save_and_keep)
    common = ["generate", "--model", str(folder), "--height", "64", "--width", "48", "--steps", "2", "--threads", "1"]
    # --frames defaults to the control video's 5
    assert main([*common, "--video", str(control), "--out", str(tmp_path / "a.gif")]) == 0
    assert seen == [24] * 6 + [12] * 6
    assert main([*common, "--frames", "5", "--out", str(tmp_path / "b.gif")]) == 0
    with_video, without = clips
    assert with_video.shape == without.shape == (1, 5, 3, 64, 48) and not torch.equal(with_video, without)
    capsys.readouterr()
    assert main([*common, "--video", str(control), "--frames", "3", "--out", str(tmp_path / "c.gif")]) == 2
    assert "--frames must match --video's 5 frames; got 3" in capsys.readouterr().err
    (tmp_path / "bad.gif").write_text("not a gif")
    assert main([*common, "--video", str(tmp_path / "bad.gif"), "--out", str(tmp_path / "d.gif")]) == 2
    assert "--video must be a readable animated GIF" in capsys.readouterr().err


def test_video_is_refused_where_the_pipeline_takes_none(tmp_path, capsys):
    from PIL import Image

    from toma.tools.cli import main

    folder = tiny_wan_folder(tmp_path)
    gif = tmp_path / "v.gif"
    Image.new("RGB", (32, 32)).save(gif)
    assert main(["generate", "--model", str(folder), "--video", str(gif), "--out", str(tmp_path / "x.gif")]) == 2
    assert "--video applies to pipelines whose call takes a video; WanPipeline takes none" in capsys.readouterr().err
    assert main(["generate", "--video", str(gif), "--out", str(tmp_path / "y.png")]) == 2
    assert "--video applies to --model pipelines" in capsys.readouterr().err


def test_a_vace_pipeline_without_ftfy_is_a_clear_error(tmp_path, one_thread, monkeypatch, capsys):
    # diffusers 0.42.1's WanVACEPipeline calls ftfy unguarded: without the package toma
    # generate says what to install, instead of a NameError from the prompt cleaning
    from diffusers.pipelines.wan import pipeline_wan_vace

    from toma.tools.cli import main

    monkeypatch.delattr(pipeline_wan_vace, "ftfy", raising=False)
    folder = tiny_wan_vace_folder(tmp_path)
    args = ["--model", str(folder), "--height", "64", "--width", "48", "--frames", "5", "--steps", "1"]
    assert main(["generate", *args, "--threads", "1", "--out", str(tmp_path / "clip.gif")]) == 2
    assert "WanVACEPipeline needs the ftfy package to clean its prompts, which is not installed: pip install ftfy" in (
        capsys.readouterr().err
    )


def generate_watching(monkeypatch, tmp_path, folder, size: int, ratio: float, watched) -> tuple[list, list]:
    """``toma generate --compare`` on a pipeline folder at ``size`` px, 2 steps: the
    ``(batch, tokens)`` of every call of the module ``watched(pipe)`` names, and the
    unmerged and merged images."""
    import toma.tools.generate as generate
    from toma.tools.cli import main

    seen: list[tuple[int, int]] = []
    images = []
    load, save = generate.load_pipeline, generate.report_and_save

    def load_and_watch(*args):
        pipe = load(*args)
        watched(pipe).register_forward_hook(lambda m, a, o: seen.append(tuple(a[0].shape[:2])))
        return pipe

    def save_and_keep(args, baseline, merged, *rest, **kw):
        images.extend([baseline, merged])
        return save(args, baseline, merged, *rest, **kw)

    monkeypatch.setattr(generate, "load_pipeline", load_and_watch)
    monkeypatch.setattr(generate, "report_and_save", save_and_keep)
    args = ["--model", str(folder), "--height", str(size), "--width", str(size), "--steps", "2", "--threads", "1"]
    assert main(["generate", *args, "--ratio", str(ratio), "--compare", "--out", str(tmp_path / "cmp.png")]) == 0
    return seen, images


def two_layer_text(vocab: int, width: int, positions: int) -> dict:
    """A decoder text model's config keys: ``width`` wide, 2 layers (the pipelines of ERNIE-Image,
    Z-Image and Lumina 2 read the second hidden state from the end), 2 heads of 8 channels."""
    return dict(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=positions,
    )


def tiny_ernie_image_folder(tmp_path):
    """A tiny ERNIE-Image pipeline saved to a folder: a Mistral 3 model from config (its
    Pixtral tower unused: the pipeline encodes text only), the byte-level Qwen2 tokenizer, a
    4-channel FLUX.2 VAE (2x space: with the pipeline's 2x2 patchify, 4x) and the tiny
    transformer (16 channels: 4 patchified)."""
    from diffusers import ErnieImagePipeline
    from transformers import Mistral3Config, Mistral3Model

    from tests.adapters.test_dit_mmdit import tiny_qwen2_tokenizer
    from tests.tiny_models import make_ernie_image
    from tests.tiny_pipelines import tiny_flux2_vae

    tokenizer = tiny_qwen2_tokenizer(tmp_path / "tok")
    torch.manual_seed(0)
    text = dict(model_type="mistral", **two_layer_text(len(tokenizer), 16, 256))  # 16: its text_in_dim
    vision = dict(
        model_type="pixtral", hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
    )
    ErnieImagePipeline(
        vae=tiny_flux2_vae(),
        text_encoder=Mistral3Model(Mistral3Config(text_config=text, vision_config=vision)).eval(),
        tokenizer=tokenizer,
        transformer=make_ernie_image(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
    ).save_pretrained(tmp_path / "ernie")
    return tmp_path / "ernie"


def tiny_flux_scaled_vae(latent_channels: int):
    """An 8x ``AutoencoderKL`` of ``latent_channels`` with Flux's VAE scaling and shift, as
    Z-Image and Lumina 2 use."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(8,) * 4,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=latent_channels,
        norm_num_groups=4,
        layers_per_block=1,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    )


def tiny_zimage_folder(tmp_path):
    """A tiny Z-Image pipeline saved to a folder: a Qwen3 model from config, the byte-level
    Qwen2 tokenizer (the pipeline pads to 512 tokens, then keeps each prompt's own), an 8x
    VAE of 16 latent channels with Flux's scaling and shift, and the tiny transformer."""
    from diffusers import ZImagePipeline
    from transformers import Qwen3Config, Qwen3Model

    from tests.adapters.test_dit_mmdit import tiny_qwen2_tokenizer
    from tests.tiny_models import TEXT_DIM, make_zimage

    tokenizer = tiny_qwen2_tokenizer(tmp_path / "tok")
    torch.manual_seed(0)
    text = Qwen3Config(**two_layer_text(len(tokenizer), TEXT_DIM, 512))  # TEXT_DIM: its cap_feat_dim
    ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_flux_scaled_vae(16),
        text_encoder=Qwen3Model(text).eval(),
        tokenizer=tokenizer,
        transformer=make_zimage(),
    ).save_pretrained(tmp_path / "zimage")
    return tmp_path / "zimage"


@pytest.mark.parametrize("ratio", [0.5, 0.0])
@pytest.mark.parametrize("family", ["ernie-image", "zimage"])
def test_generate_merges_a_cfg_batch_beside_its_text(family, ratio, tmp_path, one_thread, monkeypatch):
    # toma generate on ErnieImagePipeline and ZImagePipeline, loaded back from their folders:
    # each step is one CFG batch of 2 whose texts differ in length (ERNIE-Image pads the empty
    # negative prompt to the prompt's length, masked; Z-Image pads each caption to a multiple
    # of 32 tokens, the shorter to the longer); the merged layer sees the image tokens the
    # ratio implies beside the text, whole, and ratio 0 gives the unmerged image bitwise.
    # The default merges the last layer; its attention projects [image; text] in to_q.
    build, size, watched = {
        "ernie-image": (tiny_ernie_image_folder, 32, lambda pipe: pipe.transformer.layers[-1].self_attention.to_q),
        "zimage": (tiny_zimage_folder, 128, lambda pipe: pipe.transformer.layers[-1].attention.to_q),
    }[family]
    seen, images = generate_watching(monkeypatch, tmp_path, build(tmp_path), size, ratio, watched)
    # 8x8 tokens either way (ERNIE-Image: 32 px, a 2x VAE and 2x2 patchify; Z-Image: 128 px, an
    # 8x VAE and 2x2 patches), in 2x2 tiles (auto, far below 1024px); a 1-step warm-up and 2
    # steps, unmerged then with ToMA
    text = seen[0][1] - 64
    assert text > 1 and [b for b, _ in seen] == [2] * 6
    assert [n for _, n in seen] == [64 + text] * 3 + [64 - int(64 * ratio) + text] * 3
    baseline, merged = images
    if ratio == 0:
        assert torch.equal(merged, baseline)
    else:
        assert torch.isfinite(merged).all() and not torch.equal(merged, baseline)


def tiny_lumina2_folder(tmp_path):
    """A tiny Lumina 2 pipeline saved to a folder: a Gemma 2 model from config, the
    byte-level Qwen2 tokenizer (the pipeline pads every prompt, its system prompt before it,
    to 256 tokens), an 8x VAE with Flux's scaling and shift, and a tiny transformer whose
    caption positions reach past 256."""
    from diffusers import Lumina2Pipeline
    from transformers import Gemma2Config, Gemma2Model

    from tests.adapters.test_dit_mmdit import tiny_qwen2_tokenizer
    from tests.tiny_models import make_lumina2

    tokenizer = tiny_qwen2_tokenizer(tmp_path / "tok")
    torch.manual_seed(0)
    # 16: the transformer's cap_feat_dim
    text = Gemma2Config(**two_layer_text(len(tokenizer), 16, 512), pad_token_id=tokenizer.pad_token_id)
    transformer = make_lumina2(caption=300, caption_dim=16)
    Lumina2Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_flux_scaled_vae(4),
        text_encoder=Gemma2Model(text).eval(),
        tokenizer=tokenizer,
    ).save_pretrained(tmp_path / "lumina2")
    return tmp_path / "lumina2"


@pytest.mark.parametrize("ratio", [0.5, 0.0])
def test_generate_runs_a_lumina2_pipeline(ratio, tmp_path, one_thread, monkeypatch):
    # toma generate on Lumina2Pipeline, loaded back from its folder: its guidance passes run
    # apart (the prompt's caption and the negative one's, each its own length), the merged
    # layer sees the token count the ratio implies and the caption whole, and ratio 0 gives
    # the unmerged image bitwise
    # the default merges the last layer; its attention projects [caption; image] in to_q
    folder = tiny_lumina2_folder(tmp_path)
    seen, images = generate_watching(
        monkeypatch, tmp_path, folder, 128, ratio, lambda pipe: pipe.transformer.layers[-1].attn.to_q
    )
    # 128x128 px -> 8x8 tokens, in 2x2 tiles (auto, far below 1024px); a 1-step warm-up and 2
    # steps, unmerged then with ToMA, each a pass with the prompt, then one with the negative
    lengths = sorted({n - 64 for _, n in seen[:2]})
    assert len(lengths) == 2  # the two captions differ in length
    kept = 64 - int(64 * ratio)
    assert [b for b, _ in seen] == [1] * 12
    assert [n for _, n in seen[:6]] == [n for _, n in seen[:2]] * 3
    assert [n for _, n in seen[6:]] == [n - 64 + kept for _, n in seen[:2]] * 3
    baseline, merged = images
    if ratio == 0:
        assert torch.equal(merged, baseline)
    else:
        assert torch.isfinite(merged).all() and not torch.equal(merged, baseline)


def tiny_ltx2_folder(tmp_path):
    """A tiny LTX-2 pipeline saved to a folder: a Gemma 3 model from config (its SigLIP tower
    unused: the pipeline encodes text only), the byte-level Qwen2 tokenizer, text connectors
    of one layer per stream, a video VAE of 4x4 patches and no further compression (4x space,
    1x time), an audio VAE and vocoder of one level each, and the tiny transformer."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2Pipeline
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from tests.adapters.test_dit_mmdit import tiny_qwen2_tokenizer
    from tests.tiny_models import make_ltx2

    tokenizer = tiny_qwen2_tokenizer(tmp_path / "tok")
    tokenizer.model_max_length = 64  # the pipeline pads every prompt to this
    torch.manual_seed(0)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,  # the connectors read all 3 hidden states (embeddings and 2 layers)
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=256,
        sliding_window=64,
    )
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=14)
    streams = dict(num_attention_heads=2, attention_head_dim=8, num_layers=1, num_learnable_registers=None)
    LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=AutoencoderKLLTX2Video(
            latent_channels=8,
            block_out_channels=(8,) * 4,
            decoder_block_out_channels=(8,) * 3,
            layers_per_block=(1,) * 5,
            decoder_layers_per_block=(1,) * 4,
            spatio_temporal_scaling=(False,) * 4,
            decoder_spatio_temporal_scaling=(False,) * 3,
            upsample_factor=(1,) * 3,
            patch_size=4,
        ),
        # 8 channels once packed (4 latent channels x 8 / 4 mel bins): the transformer's audio_in_channels
        audio_vae=AutoencoderKLLTX2Audio(
            base_channels=8, ch_mult=(1,), num_res_blocks=1, latent_channels=4, mel_bins=8
        ),
        text_encoder=Gemma3ForConditionalGeneration(
            Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
        ).eval(),
        tokenizer=tokenizer,
        connectors=LTX2TextConnectors(
            caption_channels=16,
            text_proj_in_factor=3,
            video_hidden_dim=16,
            audio_hidden_dim=16,
            **{f"video_connector_{k}": v for k, v in streams.items()},
            **{f"audio_connector_{k}": v for k, v in streams.items()},
        ),
        transformer=make_ltx2(caption_channels=16),
        vocoder=LTX2Vocoder(
            in_channels=16,
            hidden_channels=8,
            upsample_kernel_sizes=[4],
            upsample_factors=[2],
            resnet_kernel_sizes=[3],
            resnet_dilations=[[1]],
        ),
    ).save_pretrained(tmp_path / "ltx2")
    return tmp_path / "ltx2"


@pytest.mark.parametrize("ratio", [0.5, 0.0])
def test_generate_runs_an_ltx2_pipeline(ratio, tmp_path, one_thread, monkeypatch, capsys):
    # toma generate on LTX2Pipeline (video and audio), loaded back from its folder: every
    # guidance pass merges the video to the token count the ratio implies, and ratio 0 gives
    # the unmerged clip bitwise
    seen: list[tuple[int, int]] = []

    def watch(pipe):
        # the default merges the last block; its self-attention projects the video tokens in to_q
        pipe.transformer.transformer_blocks[-1].attn1.to_q.register_forward_hook(
            lambda m, a, o: seen.append(tuple(a[0].shape[:2]))
        )

    from toma.tools.common import pipelines

    monkeypatch.setattr(pipelines, "_AUDIO_NOTED", set())
    folder = tiny_ltx2_folder(tmp_path)
    baseline, merged = generate_compare_clip(monkeypatch, tmp_path, folder, ratio, watch, width=32)  # 32 px steps
    # 5 frames x 64x32 px -> 5 x 16x8 tokens = 640; each step runs a CFG batch of 2, then a
    # spatio-temporal guidance pass and a modality-isolation pass of one sample each; a 1-step
    # warm-up and 2 steps, unmerged then with ToMA
    kept = 640 - int(640 * ratio)
    assert seen == [(2, 640), (1, 640), (1, 640)] * 3 + [(2, kept), (1, kept), (1, kept)] * 3
    # the audio it also returns is not saved, and toma says so once
    assert capsys.readouterr().err.count("LTX2Pipeline also returns audio") == 1
    if ratio == 0:
        assert torch.equal(merged, baseline)
    else:
        assert torch.isfinite(merged).all() and not torch.equal(merged, baseline)


def tiny_kandinsky5_folder(tmp_path):
    """A tiny Kandinsky 5 T2V pipeline saved to a folder: a Qwen2.5-VL model from config (its
    vision tower unused) with the byte-level Qwen2 tokenizer in place of its Qwen2VLProcessor
    (whose video processor needs torchvision, not installed here; the pipeline calls it
    with text only, which a processor hands to its tokenizer), a CLIP text model, a
    4-channel HunyuanVideo VAE (4x space, 4x time) and the tiny transformer."""
    from diffusers import Kandinsky5T2VPipeline

    from tests.adapters.test_dit_mmdit import tiny_qwen2_tokenizer
    from tests.tiny_models import TEXT_DIM, make_kandinsky5
    from tests.tiny_pipelines import tiny_hunyuan_video_vae, tiny_qwen25_vl

    tokenizer = tiny_qwen2_tokenizer(tmp_path / "tok")
    torch.manual_seed(0)
    Kandinsky5T2VPipeline(
        transformer=make_kandinsky5(),
        vae=tiny_hunyuan_video_vae(),
        # the templated prompt, one token per byte, runs past 1000 positions
        text_encoder=tiny_qwen25_vl(len(tokenizer), TEXT_DIM, positions=2048),
        tokenizer=tokenizer,
        text_encoder_2=CLIPTextModel(clip_config(max_position_embeddings=77)),  # it pads to 77
        tokenizer_2=tiny_clip_tokenizer(tmp_path / "clip"),
        scheduler=FlowMatchEulerDiscreteScheduler(),
    ).save_pretrained(tmp_path / "kandinsky5")
    return tmp_path / "kandinsky5"


@pytest.mark.parametrize("ratio", [0.5, 0.0])
def test_generate_runs_a_kandinsky5_pipeline(ratio, tmp_path, one_thread, monkeypatch):
    # toma generate on Kandinsky5T2VPipeline, loaded back from its folder: the merged visual
    # block sees the token count the ratio implies, and ratio 0 gives the unmerged clip bitwise
    seen: list[tuple[int, int]] = []

    def watch(pipe):
        # the default merges the last visual block; its self-attention projects the video in to_query
        block = pipe.transformer.visual_transformer_blocks[-1]
        block.self_attention.to_query.register_forward_hook(lambda m, a, o: seen.append(tuple(a[0].shape[:2])))

    baseline, merged = generate_compare_clip(monkeypatch, tmp_path, tiny_kandinsky5_folder(tmp_path), ratio, watch)
    # 5 frames x 64x48 px -> 2 x 16x12 latents -> 2 x 8x6 tokens (2x2 patches) = 96; the
    # conditional and unconditional passes run apart: a 1-step warm-up and 2 steps,
    # unmerged then with ToMA
    kept = 96 - int(96 * ratio)
    assert seen == [(1, 96)] * 6 + [(1, kept)] * 6
    if ratio == 0:
        assert torch.equal(merged, baseline)
    else:
        assert torch.isfinite(merged).all() and not torch.equal(merged, baseline)


def test_generate_runs_a_modular_pipeline_as_its_classic_one(tmp_path, one_thread, capsys):
    # a folder with modular_model_index.json only (FLUX.3 ships no other) loads as a modular
    # pipeline with its components; diffusers' Flux blocks compute what FluxPipeline does, so
    # the same tiny Flux saved both ways gives the same images, unmerged and merged, bitwise
    from diffusers.modular_pipelines import ModularPipeline

    from toma.tools.cli import main
    from toma.tools.common.pipelines import is_modular_pipeline, load_pipeline, pipeline_call

    build_flux(tmp_path).save_pretrained(tmp_path / "classic")
    modular = ModularPipeline.from_pretrained(str(tmp_path / "classic"), local_files_only=True)
    modular.load_components(dtype=torch.float32)
    modular.save_pretrained(str(tmp_path / "modular"), overwrite_modular_index=True)
    assert not (tmp_path / "modular" / "model_index.json").exists()
    args = SimpleNamespace(frames=None, guidance_scale=2.0, height=32, width=48)
    pipes = [load_pipeline(str(tmp_path / f), "cpu", torch.float32) for f in ("classic", "modular")]
    assert [is_modular_pipeline(p) for p in pipes] == [False, True]
    runs = []
    for pipe in pipes:
        run = [pipeline_call(pipe, ["a red fox"], [3], 2, args, "cpu", progress=False)]
        toma.apply_toma(pipe, ratio=0.5, flux_double_blocks=(0, 1), flux_single_blocks=(0, 1))
        run.append(pipeline_call(pipe, ["a red fox"], [3], 2, args, "cpu", progress=False))
        toma.remove_toma(pipe)
        runs.append(run)
    assert runs[0][0].shape == (1, 3, 32, 48) and not torch.equal(runs[0][0], runs[0][1])
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    common = ["--model", str(tmp_path / "modular"), "--height", "32", "--width", "32", "--steps", "2"]
    assert main(["generate", *common, "--threads", "1", "--out", str(tmp_path / "m.png")]) == 0
    assert (tmp_path / "m.png").exists()
    out = tmp_path / "ev"
    evaluated = ["eval", *common, "--num-images", "1", "--methods", "toma", "--blocks", "transformer_blocks=0-1"]
    assert main([*evaluated, "--threads", "1", "--out-dir", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["results"]
    assert [r["method"] for r in rows] == ["none", "toma"] and 0 < rows[1]["psnr"] < 99
    # its blocks draw images: --frames is refused as on a classic image pipeline
    assert main(["generate", *common, "--frames", "5", "--out", str(tmp_path / "x.png")]) == 2
    assert "--frames applies to video pipelines" in capsys.readouterr().err


def test_a_modular_pipeline_missing_a_component_is_a_clear_error(tmp_path, capsys):
    # FLUX.3's blocks reload with the prompt upsampler its saved pipeline had popped: a
    # folder without the upsampler's weights must say so, not fail inside the call
    import warnings

    from tests.tiny_models import make_flux3
    from tests.tiny_pipelines import tiny_flux3_modular_pipeline
    from toma.tools.cli import main

    pipe = tiny_flux3_modular_pipeline(tmp_path / "tok", make_flux3())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the save's notice that its index now points at the folder
        pipe.save_pretrained(str(tmp_path / "flux3"))
    for command in (["generate", "--out", str(tmp_path / "x.png")], ["eval", "--out-dir", str(tmp_path / "ev")]):
        assert main([command[0], "--model", str(tmp_path / "flux3"), *command[1:]]) == 2
        err = capsys.readouterr().err
        assert "is not a loadable diffusers pipeline folder" in err and "prompt_upsampler" in err
        assert "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


def test_a_modular_pipeline_takes_the_guidance_scale_on_its_guider(tmp_path):
    # FLUX.3's blocks take no guidance_scale: its guider holds the scale, so --guidance-scale
    # sets the guider; an input its blocks do not take is refused by its flag
    from tests.tiny_models import make_flux3
    from tests.tiny_pipelines import tiny_flux3_modular_pipeline
    from toma.tools.common.pipelines import modular_kwargs

    pipe = tiny_flux3_modular_pipeline(tmp_path / "tok", make_flux3())
    assert "guidance_scale" not in pipe.blocks.input_names and pipe.guider.guidance_scale == 2.0
    kwargs = modular_kwargs(pipe, {"num_inference_steps": 2, "output_type": "pt", "guidance_scale": 3.5})
    assert kwargs == {"num_inference_steps": 2, "output_type": "pt", "output": "images"}
    assert pipe.guider.guidance_scale == 3.5
    with pytest.raises(ValueError, match="--video is not an input of Flux3ModularPipeline's blocks"):
        modular_kwargs(pipe, {"video": [None]})
