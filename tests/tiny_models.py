"""The tiny denoisers the tests build, one table of them, and nothing of toma's.

Every family's model is built from a config dict with small random weights (the real
diffusers code paths, no downloads), with an input builder for one call. The table
:data:`FAMILIES` gives, per family, what the conformance tests and the bitwise A/B of
refactors (``benchmarks/bitwise_ab.py``) need: the model, a call's inputs, and the
``apply_toma`` options that merge every block of the tiny model. This module imports no
toma, so that one process can run it against two versions of the library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from diffusers import FluxTransformer2DModel, UNet2DConditionModel

CROSS_DIM = 32
TEXT_DIM = CROSS_DIM


def make_sdxl_unet(seed: int = 0) -> UNet2DConditionModel:
    """SDXL-like: no attention at full latent resolution, text_time added conditioning."""
    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        cross_attention_dim=CROSS_DIM,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=8 * 6 + CROSS_DIM,
        norm_num_groups=8,
    ).eval()


def make_sd15_unet(seed: int = 0) -> UNet2DConditionModel:
    """SD-1.5-like: attention from the full latent resolution down."""
    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=4,
        cross_attention_dim=CROSS_DIM,
        norm_num_groups=8,
    ).eval()


def make_flux(seed: int = 0, double: int = 2, single: int = 2) -> FluxTransformer2DModel:
    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=CROSS_DIM,
        pooled_projection_dim=CROSS_DIM,
        axes_dims_rope=(4, 6, 6),
    ).eval()


def unet_inputs(batch: int, h: int, w: int, sdxl: bool, dtype=torch.float32, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    kwargs = {
        "sample": torch.randn(batch, 4, h, w, generator=g).to(dtype),
        "timestep": torch.tensor(500),
        "encoder_hidden_states": torch.randn(batch, 7, CROSS_DIM, generator=g).to(dtype),
    }
    if sdxl:
        kwargs["added_cond_kwargs"] = {
            "text_embeds": torch.randn(batch, CROSS_DIM, generator=g).to(dtype),
            "time_ids": torch.tensor([[h * 8, w * 8, 0, 0, h * 8, w * 8]], dtype=dtype).repeat(batch, 1),
        }
    return kwargs


def flux_inputs(batch: int, h: int, w: int, text: int = 5, dtype=torch.float32, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    return {
        "hidden_states": torch.randn(batch, h * w, 16, generator=g).to(dtype),
        "encoder_hidden_states": torch.randn(batch, text, CROSS_DIM, generator=g).to(dtype),
        "pooled_projections": torch.randn(batch, CROSS_DIM, generator=g).to(dtype),
        "timestep": torch.full((batch,), 0.7, dtype=dtype),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(text, 3),
    }


def make_sd3(seed: int = 0, layers: int = 4, dual: tuple[int, ...] = (0, 1)):
    """SD3.5-like: joint attention, the first blocks with an image-only second attention."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    return SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=layers,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=CROSS_DIM,
        caption_projection_dim=16,
        pooled_projection_dim=16,
        pos_embed_max_size=32,
        dual_attention_layers=dual,
    ).eval()


def sd3_inputs(batch: int, h: int, w: int, text: int = 5, seed: int = 1) -> dict:
    """Latents of ``h x w`` (tokens ``h/2 x w/2``)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, 4, h, w, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, CROSS_DIM, generator=g),
        "pooled_projections": torch.randn(batch, 16, generator=g),
        "timestep": torch.full((batch,), 500.0),
    }


def make_wan(seed: int = 0, layers: int = 3, in_channels: int = 4, text_dim: int = CROSS_DIM):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=in_channels,
        out_channels=in_channels,
        text_dim=text_dim,
        freq_dim=16,
        ffn_dim=32,
        num_layers=layers,
        rope_max_seq_len=32,
    ).eval()


def wan_inputs(batch: int, frames: int, h: int, w: int, text: int = 5, seed: int = 1) -> dict:
    """Latents of ``frames x h x w`` (tokens ``frames x h/2 x w/2``)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, 4, frames, h, w, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": torch.randn(batch, text, CROSS_DIM, generator=g),
    }


def make_pixart(seed: int = 0, layers: int = 3):
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(seed)
    return PixArtTransformer2DModel(
        sample_size=8,
        num_layers=layers,
        patch_size=2,
        attention_head_dim=8,
        num_attention_heads=2,
        caption_channels=CROSS_DIM,
        in_channels=4,
        cross_attention_dim=16,
        out_channels=8,
        attention_bias=True,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
    ).eval()


def pixart_inputs(batch: int, h: int, w: int, text: int = 5, seed: int = 1) -> dict:
    """Latents of ``h x w`` (tokens ``h/2 x w/2``), with a text mask that hides the last text token."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, text)
    mask[:, -1] = 0
    return {
        "hidden_states": torch.randn(batch, 4, h, w, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, CROSS_DIM, generator=g),
        "timestep": torch.full((batch,), 500),
        "encoder_attention_mask": mask,
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
    }


def make_ltx(seed: int = 0, layers: int = 3):
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(seed)
    return LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=layers,
        caption_channels=CROSS_DIM,
    ).eval()


def ltx_inputs(batch: int, frames: int, h: int, w: int, text: int = 5, seed: int = 1) -> dict:
    """Flattened latents of ``frames x h x w`` tokens, with a text mask."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, text)
    mask[:, -1] = 0
    return {
        "hidden_states": torch.randn(batch, frames * h * w, 8, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, CROSS_DIM, generator=g),
        "timestep": torch.full((batch,), 500),
        "encoder_attention_mask": mask,
        "num_frames": frames,
        "height": h,
        "width": w,
    }


def make_ltx2(seed: int = 0, layers: int = 2, **config):
    """LTX-2: a video stream (2 heads of 8) and an audio stream (2 heads of 4) in each block."""
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(seed)
    return LTX2VideoTransformer3DModel(
        **{
            "in_channels": 8,
            "out_channels": 8,
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "cross_attention_dim": 16,
            "audio_in_channels": 8,
            "audio_out_channels": 8,
            "audio_num_attention_heads": 2,
            "audio_attention_head_dim": 4,
            "audio_cross_attention_dim": 8,
            "num_layers": layers,
            "caption_channels": CROSS_DIM,
            **config,
        }
    ).eval()


def ltx2_inputs(
    batch: int, frames: int, h: int, w: int, audio: int = 7, text: int = 5, seed: int = 1, coords: bool = False
) -> dict:
    """Flattened video latents of ``frames x h x w`` tokens and ``audio`` audio latents, each
    stream with its prompt and text mask; with ``coords``, the pipelines' ``video_coords``."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, text)
    mask[:, -1] = 0
    kw = {
        "hidden_states": torch.randn(batch, frames * h * w, 8, generator=g),
        "audio_hidden_states": torch.randn(batch, audio, 8, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, CROSS_DIM, generator=g),
        "audio_encoder_hidden_states": torch.randn(batch, text, CROSS_DIM, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "encoder_attention_mask": mask,
        "audio_encoder_attention_mask": mask.clone(),
        "num_frames": frames,
        "height": h,
        "width": w,
        "audio_num_frames": audio,
    }
    if coords:  # as LTX2Pipeline computes them (the rope's own, default scale factors)
        from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoRotaryPosEmbed

        kw["video_coords"] = LTX2AudioVideoRotaryPosEmbed(dim=16).prepare_video_coords(batch, frames, h, w, "cpu")
    return kw


def make_qwen(layers: int = 3):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        axes_dims_rope=(4, 6, 6),
    ).eval()


def qwen_inputs(batch: int, h: int, w: int, text: int = 5, seed: int = 1) -> dict:
    """Packed latents of ``h x w`` tokens (2x2 latent patches of 4 channels), a text mask of ones."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, h * w, 16, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, TEXT_DIM, generator=g),
        "encoder_hidden_states_mask": torch.ones(batch, text),
        "timestep": torch.full((batch,), 0.5),
        "img_shapes": [[(1, h, w)]] * batch,
    }


def make_flux2(double: int = 2, single: int = 2, text_dim: int = TEXT_DIM):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=text_dim,
        timestep_guidance_channels=16,
        axes_dims_rope=(4, 4, 4, 4),
    ).eval()


def flux2_inputs(batch: int, h: int, w: int, text: int = 5, seed: int = 1) -> dict:
    """Packed latents of ``h x w`` tokens with Flux.2's (t, h, w, l) ids, as its pipelines make them."""
    g = torch.Generator().manual_seed(seed)
    one = torch.arange(1)
    img_ids = torch.cartesian_prod(one, torch.arange(h), torch.arange(w), one)
    txt_ids = torch.cartesian_prod(one, one, one, torch.arange(text))
    return {
        "hidden_states": torch.randn(batch, h * w, 16, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, TEXT_DIM, generator=g),
        "timestep": torch.full((batch,), 0.5),
        "img_ids": img_ids[None].expand(batch, -1, -1),
        "txt_ids": txt_ids[None].expand(batch, -1, -1),
        "guidance": torch.full((batch,), 3.5),
    }


def make_flux3(seed: int = 0, layers: int = 2, single: int = 2, flow_map: bool = False):
    """FLUX.3: per-mode blocks (the image's, references', text's), then single-stream blocks
    on [text; image]; 2 heads of 16 channels, 4-axis rotary over (4, 4, 4, 4) channels.
    ``flow_map``: the step-distilled model's, which also embeds the step's target timestep."""
    from diffusers import Flux3Transformer2DModel

    torch.manual_seed(seed)
    return Flux3Transformer2DModel(
        in_channels=16,
        cond_in_channels=16,
        num_layers=layers,
        num_single_layers=single,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        timestep_channels=32,
        mlp_ratio=2.0,
        axes_dims_rope=(4, 4, 4, 4),
        flow_map=flow_map,
    ).eval()


def flux3_inputs(batch: int, h: int, w: int, text: int = 5, references: int = 0) -> dict:
    """Packed latents of ``h x w`` tokens with FLUX.3's (t, h, w, l) ids, one set for the
    batch; with ``references``, that many reference images of the same size after it (their
    ids' first column 1, 2, ...)."""
    g = torch.Generator().manual_seed(1)
    one = torch.arange(1)
    img_ids = torch.cartesian_prod(one, torch.arange(h), torch.arange(w), one)
    kw = {
        "hidden_states": torch.randn(batch, h * w, 16, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, TEXT_DIM, generator=g),
        "timestep": torch.full((batch,), 0.5),
        "img_ids": img_ids,
        "txt_ids": torch.cartesian_prod(one, one, one, torch.arange(text)),
    }
    if references:
        ids = [img_ids + torch.tensor([r, 0, 0, 0]) for r in range(1, references + 1)]
        kw["image_cond_hidden_states"] = torch.randn(batch, references * h * w, 16, generator=g)
        kw["image_cond_ids"] = torch.cat(ids)
    return kw


def make_hunyuan(seed: int = 0, layers: int = 2, single: int = 2, in_channels: int = 4, **config):
    """Dual-stream then single-stream blocks, 2 heads of 8 channels, 3-D rotary over (2, 2, 4) channels."""
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(seed)
    return HunyuanVideoTransformer3DModel(
        in_channels=in_channels,
        out_channels=in_channels,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=layers,
        num_single_layers=single,
        num_refiner_layers=1,
        patch_size=2,
        patch_size_t=1,
        text_embed_dim=TEXT_DIM,
        pooled_projection_dim=16,
        rope_axes_dim=(2, 2, 4),
        **config,
    ).eval()


def hunyuan_inputs(batch: int, frames: int, h: int, w: int, text: int = 6, padded: int = 2, seed: int = 1) -> dict:
    """Latents ``(B, 4, frames, h, w)`` (tokens ``frames x h/2 x w/2``); the last sample's
    last ``padded`` text tokens are padding."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, text)
    if padded:
        mask[-1, -padded:] = 0
    return {
        "hidden_states": torch.randn(batch, 4, frames, h, w, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": torch.randn(batch, text, TEXT_DIM, generator=g),
        "encoder_attention_mask": mask,
        "pooled_projections": torch.randn(batch, 16, generator=g),
        "guidance": torch.full((batch,), 3500.0),
    }


def make_cogvideox(
    seed: int = 0, layers: int = 3, patch_size_t: int | None = None, in_channels: int = 4, text_dim: int = 16
):
    """CogVideoX-5B-like (rotary positions from the caller); ``patch_size_t=2`` is CogVideoX 1.5."""
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(seed)
    return CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=in_channels,
        out_channels=in_channels,
        time_embed_dim=8,
        text_embed_dim=text_dim,
        num_layers=layers,
        sample_width=8,
        sample_height=8,
        sample_frames=5,
        patch_size=2,
        patch_size_t=patch_size_t,
        temporal_compression_ratio=4,
        max_text_seq_length=8,
        use_rotary_positional_embeddings=True,
        patch_bias=patch_size_t is None,
    ).eval()


def cogvideox_rotary(frames: int, th: int, tw: int, head_dim: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(frames * th * tw, head_dim)`` cos and sin tables CogVideoXPipeline passes, raster order."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    return get_3d_rotary_pos_embed(head_dim, ((0, 0), (th, tw)), (th, tw), frames)


def cogvideox_inputs(batch: int, frames: int, h: int, w: int, text: int = 5, patch_t: int = 1, seed: int = 1) -> dict:
    """Latents ``(B, frames, 4, h, w)`` (tokens ``frames / patch_t x h/2 x w/2``) and their rotary tables."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, frames, 4, h, w, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, 16, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "image_rotary_emb": cogvideox_rotary(frames // patch_t, h // 2, w // 2),
    }


def make_hunyuan15(seed: int = 0, layers: int = 2, in_channels: int = 4):
    """HunyuanVideo 1.5-like: dual-stream blocks only, 2 heads of 8 channels, 3-D rotary over
    (2, 2, 4) channels, 4 latent channels out (``in_channels``: its pipeline's 9 also take the
    condition latents and mask)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(seed)
    return HunyuanVideo15Transformer3DModel(
        in_channels=in_channels,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=layers,
        num_refiner_layers=1,
        patch_size=2,
        patch_size_t=1,
        text_embed_dim=TEXT_DIM,
        text_embed_2_dim=16,
        image_embed_dim=16,
        rope_axes_dim=(2, 2, 4),
    ).eval()


def hunyuan15_inputs(batch: int, frames: int, h: int, w: int, text: int = 6, seed: int = 1) -> dict:
    """Latents ``(B, 4, frames, h, w)`` (tokens ``frames x h/2 x w/2``), MLLM text with a mask of
    ones, 3 ByT5 tokens and 2 image-embedding tokens (nonzero: image-to-video)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, 4, frames, h, w, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": torch.randn(batch, text, TEXT_DIM, generator=g),
        "encoder_attention_mask": torch.ones(batch, text),
        "encoder_hidden_states_2": torch.randn(batch, 3, 16, generator=g),
        "encoder_attention_mask_2": torch.ones(batch, 3),
        "image_embeds": torch.randn(batch, 2, 16, generator=g),
    }


def make_wan_vace(
    seed: int = 0,
    layers: int = 3,
    vace_layers: tuple[int, ...] = (0, 2),
    channels: int = 4,
    vace_in_channels: int = 6,
):
    """Wan VACE-like: 3 Wan blocks, control blocks whose hints join blocks 0 and 2; latents of
    ``channels`` and a control input of ``vace_in_channels``."""
    from diffusers import WanVACETransformer3DModel

    torch.manual_seed(seed)
    return WanVACETransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=channels,
        out_channels=channels,
        text_dim=CROSS_DIM,
        freq_dim=16,
        ffn_dim=32,
        num_layers=layers,
        rope_max_seq_len=32,
        vace_layers=list(vace_layers),
        vace_in_channels=vace_in_channels,
    ).eval()


def wan_vace_inputs(batch: int, frames: int, h: int, w: int, text: int = 5, seed: int = 1) -> dict:
    """Wan's call plus control latents of the same ``frames x h x w`` (6 channels)."""
    g = torch.Generator().manual_seed(seed + 1)
    return {
        **wan_inputs(batch, frames, h, w, text, seed),
        "control_hidden_states": torch.randn(batch, 6, frames, h, w, generator=g),
    }


def make_skyreels(seed: int = 0, layers: int = 3, **config):
    """SkyReels-V2-like (text to video): Wan's block layout."""
    from diffusers import SkyReelsV2Transformer3DModel

    torch.manual_seed(seed)
    return SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=CROSS_DIM,
        freq_dim=16,
        ffn_dim=32,
        num_layers=layers,
        rope_max_seq_len=32,
        **config,
    ).eval()


def make_wan_animate(seed: int = 0, layers: int = 4):
    """Wan-Animate-like: 4 Wan blocks, face adapters after blocks 0 and 2, a motion encoder for 16x16 faces."""
    from diffusers import WanAnimateTransformer3DModel

    torch.manual_seed(seed)
    return WanAnimateTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=12,
        latent_channels=4,
        out_channels=4,
        text_dim=CROSS_DIM,
        freq_dim=16,
        ffn_dim=32,
        num_layers=layers,
        image_dim=16,
        rope_max_seq_len=32,
        motion_encoder_channel_sizes={"16": 8, "8": 8, "4": 8},
        motion_encoder_size=16,
        motion_style_dim=8,
        motion_dim=4,
        motion_encoder_dim=8,
        face_encoder_hidden_dim=8,
        face_encoder_num_heads=2,
        inject_face_latents_blocks=2,
    ).eval()


def wan_animate_inputs(batch: int, frames: int, h: int, w: int, text: int = 5, seed: int = 1) -> dict:
    """Latents of ``frames x h x w`` (the reference frame, then ``frames - 1``), pose latents for
    the last ``frames - 1``, a CLIP image embedding, and ``4 (frames - 1) - 3`` 16x16 face frames
    (the face encoder's strides bring them to ``frames - 1``)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, 12, frames, h, w, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": torch.randn(batch, text, CROSS_DIM, generator=g),
        "encoder_hidden_states_image": torch.randn(batch, 3, 16, generator=g),
        "pose_hidden_states": torch.randn(batch, 4, frames - 1, h, w, generator=g),
        "face_pixel_values": torch.randn(batch, 3, 4 * (frames - 1) - 3, 16, 16, generator=g),
    }


def make_cosmos(seed: int = 0, layers: int = 3, **config):
    """Cosmos-Predict2-like: no learnable positional embedding. Without the padding-mask input
    channel, which diffusers resizes with torchvision (not a test dependency)."""
    from diffusers import CosmosTransformer3DModel

    torch.manual_seed(seed)
    return CosmosTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=12,
        num_layers=layers,
        mlp_ratio=2.0,
        text_embed_dim=CROSS_DIM,
        adaln_lora_dim=8,
        max_size=(8, 32, 32),
        patch_size=(1, 2, 2),
        concat_padding_mask=False,
        extra_pos_embed_type=config.pop("extra_pos_embed_type", None),
        **config,
    ).eval()


def cosmos_inputs(batch: int, frames: int, h: int, w: int, text: int = 5, seed: int = 1) -> dict:
    """Latents of ``frames x h x w`` (tokens ``frames x h/2 x w/2``) and text."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, 4, frames, h, w, generator=g),
        "timestep": torch.full((batch,), 0.5),
        "encoder_hidden_states": torch.randn(batch, text, CROSS_DIM, generator=g),
    }


def make_longcat(seed: int = 0, double: int = 2, single: int = 2):
    """LongCat-Image-like: Flux.1's layout, 2 heads of 16 channels."""
    from diffusers import LongCatImageTransformer2DModel

    torch.manual_seed(seed)
    return LongCatImageTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=CROSS_DIM,
        pooled_projection_dim=CROSS_DIM,
        axes_dims_rope=(4, 6, 6),
    ).eval()


def longcat_ids(modality: int, start: int, h: int, w: int) -> torch.Tensor:
    """The ``(h * w, 3)`` ids LongCat's pipelines give an image: modality, then row and column from ``start``."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([torch.full_like(rows, modality), rows + start, cols + start], -1).reshape(-1, 3).float()


def longcat_inputs(
    batch: int, h: int, w: int, text: int = 5, refs: tuple[int, int] | None = None, seed: int = 1
) -> dict:
    """Packed latents of ``h x w`` tokens with ids of modality 1 after ``text`` text ids; with
    ``refs``, an edit call: a reference image's ``refs[0] x refs[1]`` tokens (modality 2) after them."""
    g = torch.Generator().manual_seed(seed)
    arange = torch.arange(text, dtype=torch.float32)
    ids = longcat_ids(1, text, h, w)
    tokens = h * w
    if refs is not None:
        ids = torch.cat([ids, longcat_ids(2, text, *refs)])
        tokens += refs[0] * refs[1]
    return {
        "hidden_states": torch.randn(batch, tokens, 16, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, CROSS_DIM, generator=g),
        "timestep": torch.full((batch,), 0.7),
        "img_ids": ids,
        "txt_ids": torch.stack([torch.zeros(text), arange, arange], -1),
    }


def make_hunyuanimage(seed: int = 0, layers: int = 2, single: int = 2):
    """HunyuanImage 2.1-like: dual- then single-stream blocks, 2 heads of 8 channels, 2-D rotary over (4, 4)."""
    from diffusers import HunyuanImageTransformer2DModel

    torch.manual_seed(seed)
    return HunyuanImageTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=layers,
        num_single_layers=single,
        num_refiner_layers=1,
        patch_size=(2, 2),
        text_embed_dim=TEXT_DIM,
        rope_axes_dim=(4, 4),
    ).eval()


def hunyuanimage_inputs(batch: int, h: int, w: int, text: int = 6, padded: int = 2, seed: int = 1) -> dict:
    """Latents ``(B, 4, h, w)`` (tokens ``h/2 x w/2``); the last sample's last ``padded`` text tokens are padding."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, text)
    if padded:
        mask[-1, -padded:] = 0
    return {
        "hidden_states": torch.randn(batch, 4, h, w, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": torch.randn(batch, text, TEXT_DIM, generator=g),
        "encoder_attention_mask": mask,
    }


def make_joyimage(seed: int = 0, layers: int = 2):
    """JoyAI-Image-Edit-like: dual-stream blocks, 2 heads of 16 channels, 3-D rotary (4, 6, 6)."""
    from diffusers import JoyImageEditTransformer3DModel

    torch.manual_seed(seed)
    return JoyImageEditTransformer3DModel(
        patch_size=[1, 2, 2],
        in_channels=4,
        hidden_size=32,
        num_attention_heads=2,
        text_dim=TEXT_DIM,
        mlp_width_ratio=2.0,
        num_layers=layers,
        rope_dim_list=[4, 6, 6],
    ).eval()


def joyimage_inputs(batch: int, h: int, w: int, refs: int = 0, text: int = 5, seed: int = 1) -> dict:
    """Latents of one ``h x w`` frame (tokens ``h/2 x w/2``); with ``refs``, an edit call
    ``(B, refs + 1, 4, 1, h, w)``: the reference items first, the generated one last, as
    JoyImageEditPipeline passes them."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, 4, 1, h, w) if not refs else (batch, refs + 1, 4, 1, h, w)
    return {
        "hidden_states": torch.randn(*shape, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": torch.randn(batch, text, TEXT_DIM, generator=g),
    }


def make_animatediff_unet(seed: int = 0):
    """AnimateDiff-like (``UNetMotionModel``): an SD-1.5-like UNet whose levels each add
    motion modules, temporal attention over the frames of every latent pixel."""
    from diffusers import UNetMotionModel

    torch.manual_seed(seed)
    return UNetMotionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"),
        up_block_types=("UpBlockMotion", "CrossAttnUpBlockMotion"),
        norm_num_groups=8,
        cross_attention_dim=CROSS_DIM,
        num_attention_heads=2,
        motion_num_attention_heads=2,
        motion_max_seq_length=32,
        use_motion_mid_block=False,
    ).eval()


def animatediff_inputs(batch: int, frames: int, h: int, w: int, seed: int = 1) -> dict:
    """Latents ``(B, 4, frames, h, w)``; the text once per frame, as AnimateDiff's pipelines pass it."""
    g = torch.Generator().manual_seed(seed)
    return {
        "sample": torch.randn(batch, 4, frames, h, w, generator=g),
        "timestep": torch.tensor(500),
        "encoder_hidden_states": torch.randn(batch, 7, CROSS_DIM, generator=g).repeat_interleave(frames, dim=0),
    }


def make_svd_unet(seed: int = 0):
    """Stable Video Diffusion-like (``UNetSpatioTemporalConditionModel``): spatial
    transformer blocks, each followed by a temporal one over the frames."""
    from diffusers import UNetSpatioTemporalConditionModel

    torch.manual_seed(seed)
    return UNetSpatioTemporalConditionModel(
        sample_size=16,
        in_channels=8,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=24,
        cross_attention_dim=CROSS_DIM,
        transformer_layers_per_block=1,
        num_attention_heads=(2, 4),
        num_frames=3,
    ).eval()


def svd_inputs(batch: int, frames: int, h: int, w: int, seed: int = 1) -> dict:
    """Latents ``(B, frames, 8, h, w)`` (noise and the conditioning image's), one image embedding, 3 added time ids."""
    g = torch.Generator().manual_seed(seed)
    return {
        "sample": torch.randn(batch, frames, 8, h, w, generator=g),
        "timestep": torch.tensor(500.0),
        "encoder_hidden_states": torch.randn(batch, 1, CROSS_DIM, generator=g),
        "added_time_ids": torch.randn(batch, 3, generator=g),
    }


def kontext_inputs(batch: int, h: int, w: int, rh: int, rw: int) -> dict:
    """Flux Kontext's call: an ``h x w`` image's tokens, then a reference image's ``rh x rw``
    (ids with a first column of 1)."""
    kw = flux_inputs(batch, h, w)
    rows, cols = torch.meshgrid(torch.arange(rh), torch.arange(rw), indexing="ij")
    ref_ids = torch.stack([torch.ones_like(rows), rows, cols], -1).reshape(-1, 3).float()
    g = torch.Generator().manual_seed(7)
    return {
        **kw,
        "img_ids": torch.cat([kw["img_ids"], ref_ids]),
        "hidden_states": torch.cat([kw["hidden_states"], torch.randn(batch, rh * rw, 16, generator=g)], dim=1),
    }


def flux_joint_mask(kw: dict, keep: torch.Tensor) -> dict:
    """A Flux.1 / FLUX.2 call with the key mask ``keep`` ``(B, S)`` in ``joint_attention_kwargs``, ``(B, 1, 1, S)``."""
    return {**kw, "joint_attention_kwargs": {"attention_mask": keep[:, None, None, :]}}


def make_chroma(seed: int = 0, double: int = 2, single: int = 2):
    """Chroma: Flux.1's blocks with pruned modulation from one small approximator."""
    from diffusers import ChromaTransformer2DModel

    torch.manual_seed(seed)
    return ChromaTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=CROSS_DIM,
        axes_dims_rope=(4, 6, 6),
        approximator_num_channels=16,
        approximator_hidden_dim=32,
        approximator_layers=1,
    ).eval()


def chroma_inputs(batch: int, h: int, w: int, text: int = 5) -> dict:
    """Flux.1's call without pooled projections. Without the pipeline's mask
    (:func:`chroma_pipeline_mask`): diffusers' checkpointed forward drops it from the
    single-stream blocks, so with it the checkpointed forward computes another function."""
    kw = flux_inputs(batch, h, w, text)
    del kw["pooled_projections"]
    return kw


def chroma_pipeline_mask(batch: int, text: int, tokens: int) -> torch.Tensor:
    """The ``attention_mask`` Chroma's pipeline makes: the text padding hidden but its first
    token (the second sample's last two text tokens are padding), ones over the image; float,
    as the pipeline's (its text mask is in the latents' dtype, the image's ones join it), so
    the blocks' outer product is an additive 0/1 mask."""
    keep = torch.ones(batch, text + tokens)
    if batch > 1:
        keep[1, text - 1] = 0
    return keep


def chroma_joint_mask(kw: dict, keep: torch.Tensor) -> dict:
    """A Chroma call with the ``(B, S)`` key mask ``keep`` as its ``attention_mask``."""
    return {**kw, "attention_mask": keep}


def make_krea2(seed: int = 0, layers: int = 2):
    """Krea 2: text fusion, then single-stream blocks on [text; image] with grouped-query attention."""
    from diffusers import Krea2Transformer2DModel

    torch.manual_seed(seed)
    model = Krea2Transformer2DModel(
        in_channels=16,
        num_layers=layers,
        attention_head_dim=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        timestep_embed_dim=16,
        text_hidden_dim=TEXT_DIM,
        num_text_layers=2,
        text_num_attention_heads=2,
        text_num_key_value_heads=2,
        text_intermediate_size=32,
        num_layerwise_text_blocks=1,
        num_refiner_text_blocks=1,
        axes_dims_rope=(4, 6, 6),
    )
    with torch.no_grad():  # its norms and modulation tables start at 0 (identity); make them matter
        for name, p in model.named_parameters():
            if "norm" in name or "scale_shift_table" in name:
                p.normal_(0, 0.1)
    return model.eval()


def krea2_inputs(batch: int, h: int, w: int, text: int = 5, padded: int = 0) -> dict:
    """An ``h x w`` image's tokens, two tapped text layers per token, ``position_ids`` as the
    pipeline's (text rows 0, image rows ``(0, row, column)``) and its bool text mask (the last
    sample's last ``padded`` tokens hidden)."""
    g = torch.Generator().manual_seed(1)
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    image_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    mask = torch.ones(batch, text, dtype=torch.bool)
    if padded:
        mask[-1, -padded:] = False
    return {
        "hidden_states": torch.randn(batch, h * w, 16, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, 2, TEXT_DIM, generator=g),
        "timestep": torch.full((batch,), 0.7),
        "position_ids": torch.cat([torch.zeros(text, 3), image_ids]),
        "encoder_attention_mask": mask,
    }


def make_zimage(seed: int = 0, layers: int = 2):
    """Z-Image: one noise- and one context-refiner block, then main layers on [image; caption]."""
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(seed)
    model = ZImageTransformer2DModel(
        dim=32,
        n_layers=layers,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=TEXT_DIM,
        axes_dims=[4, 6, 6],
        axes_lens=[256, 32, 32],  # caption positions first: room for captions padded to 64
    )
    with torch.no_grad():  # its norms start at 1 and its pad tokens at 0; make them matter
        for name, p in model.named_parameters():
            if "norm" in name or "pad_token" in name:
                p.normal_(0, 0.1)
    return model.eval()


def zimage_inputs(batch: int, h: int, w: int, text: int = 5, longer: int = 0) -> dict:
    """Lists of ``(16, 1, h, w)`` latents (2x2 patches) and ``(text, C)`` caption features,
    the last sample's caption ``longer`` tokens longer."""
    g = torch.Generator().manual_seed(1)
    caps = [torch.randn(text + (longer if i == batch - 1 else 0), TEXT_DIM, generator=g) for i in range(batch)]
    return {
        "x": [torch.randn(16, 1, h, w, generator=g) for _ in range(batch)],
        "t": torch.full((batch,), 0.7),
        "cap_feats": caps,
    }


def make_minimax_h3(seed: int = 0, layers: int = 2):
    """MiniMax H3: a text refiner block, then blocks on the packed [text; audio; video] sequence."""
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        hidden_size=32,
        num_layers=layers,
        num_refiner_layers=1,
        ffn_dim=32,
        in_channels=4,
        audio_in_channels=4,
        text_dim=TEXT_DIM,
        freq_dim=16,
        time_embed_hidden_dim=32,
        time_embed_dim=16,
        rope_freq_dim=2,  # 2 * 3 * 2 of the 16 head channels rotated
    )
    with torch.no_grad():  # its norms start at 1; make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.1)
    return model.eval()


def minimax_h3_inputs(
    batch: int,
    frames: int,
    h: int,
    w: int,
    text: int = 5,
    audio: int = 3,
    audio_t: float | None = None,
    anchors: tuple[str, ...] = (),
) -> dict:
    """A call as the modular pipeline's t2va layout makes it (fl2va with keyframe ``anchors``,
    whose rows come after the text): ``frames`` latent frames of ``h x w`` latents (4 channels,
    1x2x2 patches), ``audio`` stereo audio latents, the packed layout from its own
    ``build_packed_sequence`` and the row timesteps from ``build_row_timesteps`` (the audio at
    ``audio_t``, by default the video's 0.7; keyframes at 0.9)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
        MiniMaxH3SetTimestepsStep,
        patchify_video_latents,
    )

    g = torch.Generator().manual_seed(1)
    ids, tags, video, audio_rows, text_rows, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.ones(text, dtype=torch.long), frames, h, w, audio, (1, 2, 2), 2, 2, 0, anchors
    )
    conditioning = len(anchors) * (h // 2) * (w // 2)
    timestep, row_index = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video, audio_rows, conditioning, 0, text, 0.7, 0.7 if audio_t is None else audio_t, 0.9, 1.0
    )
    latents = torch.randn(batch, 4, len(anchors) + frames, h, w, generator=g)  # keyframes' rows first
    return {
        "hidden_states": patchify_video_latents(latents, (1, 2, 2)).reshape(batch, -1, 16),
        "audio_hidden_states": torch.randn(batch, audio_rows.numel(), 4, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, TEXT_DIM, generator=g),
        "timestep": timestep,
        "timestep_indices": row_index,
        "token_tags": tags,
        "position_ids": ids.float(),
        "video_indices": video,
        "audio_indices": audio_rows,
        "text_indices": text_rows,
    }


def make_ideogram4(seed: int = 0, layers: int = 2):
    """Ideogram 4: sandwich-norm blocks on the packed [padding; text; image] sequence, M-RoPE."""
    from diffusers import Ideogram4Transformer2DModel

    torch.manual_seed(seed)
    model = Ideogram4Transformer2DModel(
        in_channels=16,
        num_layers=layers,
        attention_head_dim=16,
        num_attention_heads=2,
        intermediate_size=32,
        adaln_dim=16,
        llm_features_dim=TEXT_DIM,
        rope_theta=10000,
        mrope_section=(4, 2, 2),  # the 8 frequencies of a 16-channel head
    )
    with torch.no_grad():  # its norms start at 1; make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.1)
    return model.eval()


def ideogram4_inputs(batch: int, h: int, w: int, text: int = 5, padded: int = 2, image_only: bool = False) -> dict:
    """An ``h x w`` image's tokens as the pipeline packs them for its conditional transformer:
    ``text`` text slots, the last sample's prompt ``padded`` tokens shorter (left padding), the
    layout from its own ``_prepare_ids``; with ``image_only``, the unconditional transformer's
    call (the image's slots alone, zero text features), as the pipeline slices it."""
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import Ideogram4Pipeline

    g = torch.Generator().manual_seed(1)
    lengths = [text] * batch
    lengths[-1] = text - padded
    ids, segments, indicator = Ideogram4Pipeline._prepare_ids(lengths, h, w, text, "cpu")
    latents = torch.randn(batch, h * w, 16, generator=g)
    if image_only:
        return {
            "hidden_states": latents,
            "timestep": torch.full((batch,), 0.3),
            "encoder_hidden_states": torch.zeros(batch, h * w, TEXT_DIM),
            "position_ids": ids[:, text:],
            "segment_ids": segments[:, text:],
            "indicator": indicator[:, text:],
        }
    return {
        "hidden_states": torch.cat([torch.zeros(batch, text, 16), latents], dim=1),
        "timestep": torch.full((batch,), 0.3),  # model time: 0 is noise, 1 clean
        "encoder_hidden_states": torch.randn(batch, text + h * w, TEXT_DIM, generator=g),
        "position_ids": ids,
        "segment_ids": segments,
        "indicator": indicator,
    }


def make_bria_fibo(seed: int = 0, double: int = 2, single: int = 2):
    """Bria FIBO: Flux.1's blocks, half the text's channels replaced per block from a text-encoder layer."""
    from diffusers import BriaFiboTransformer2DModel

    torch.manual_seed(seed)
    return BriaFiboTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=CROSS_DIM,
        axes_dims_rope=(4, 6, 6),
        text_encoder_dim=16,
    ).eval()


def bria_fibo_inputs(batch: int, h: int, w: int, text: int = 5, blocks: int = 4, padded: int = 0) -> dict:
    """Flux.1's call without pooled projections, with one text-encoder layer per block and,
    with ``padded``, the pipeline's bool key mask hiding the last sample's last text tokens."""
    kw = flux_inputs(batch, h, w, text)
    del kw["pooled_projections"]
    g = torch.Generator().manual_seed(5)
    kw["text_encoder_layers"] = [torch.randn(batch, text, 16, generator=g) for _ in range(blocks)]
    if padded:
        keep = torch.ones(batch, text + h * w, dtype=torch.bool)
        keep[-1, text - padded : text] = False
        kw = flux_joint_mask(kw, keep)
    return kw


def make_hidream(seed: int = 0, double: int = 2, single: int = 2):
    """HiDream-I1: double-stream then single-stream blocks on [image; text], 2-expert MoE MLPs."""
    from diffusers import HiDreamImageTransformer2DModel

    torch.manual_seed(seed)
    return HiDreamImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=16,
        num_attention_heads=2,
        caption_channels=[24, 20],  # T5, Llama
        text_emb_dim=12,
        num_routed_experts=2,
        num_activated_experts=1,
        axes_dims_rope=(4, 6, 6),
        max_resolution=(32, 32),
        llama_layers=list(range(double + single)),
    ).eval()


def hidream_inputs(batch: int, h: int, w: int, text: int = 5, llama: int = 3, layers: int = 4) -> dict:
    """Square ``(4, 2h, 2w)`` latents (2x2 patches), T5 features, ``layers`` Llama layers' features
    (a list of ``(B, llama, C)``, which the forward indexes as it does the pipeline's stacked
    ``(layers, B, llama, C)``, and which the tests can cut per sample)."""
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(batch, 4, 2 * h, 2 * w, generator=g),
        "timesteps": torch.full((batch,), 700.0),
        "encoder_hidden_states_t5": torch.randn(batch, text, 24, generator=g),
        "encoder_hidden_states_llama3": [torch.randn(batch, llama, 20, generator=g) for _ in range(layers)],
        "pooled_embeds": torch.randn(batch, 12, generator=g),
    }


def make_kandinsky5(seed: int = 0, layers: int = 3, **config):
    """Kandinsky 5: one text block, then visual blocks (self-attention, cross-attention, MLP)."""
    from diffusers import Kandinsky5Transformer3DModel

    torch.manual_seed(seed)
    model = Kandinsky5Transformer3DModel(
        in_visual_dim=4,
        out_visual_dim=4,
        in_text_dim=TEXT_DIM,
        in_text_dim2=16,
        time_dim=16,
        patch_size=(1, 2, 2),
        model_dim=32,
        ff_dim=64,
        num_text_blocks=1,
        num_visual_blocks=layers,
        axes_dims=(4, 6, 6),
        **config,
    )
    with torch.no_grad():  # its modulations start at zero (every block an identity); make them matter
        for name, p in model.named_parameters():
            if "modulation" in name:
                p.normal_(0, 0.2)
    return model.eval()


def kandinsky5_inputs(batch: int, frames: int, h: int, w: int, text: int = 5, seed: int = 1) -> dict:
    """The T2V pipeline's call on channel-last latents ``(B, frames, h, w, 4)``: rotary
    positions as it makes them (per latent frame, per 2x2 patch row and column)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, frames, h, w, 4, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, TEXT_DIM, generator=g),
        "pooled_projections": torch.randn(batch, 16, generator=g),
        "timestep": torch.full((batch,), 700.0),
        "visual_rope_pos": [torch.arange(frames), torch.arange(h // 2), torch.arange(w // 2)],
        "text_rope_pos": torch.arange(text),
        "scale_factor": (1, 2, 2),  # the pipeline's _get_scale_factor at 480p sizes
    }


def make_ernie_image(seed: int = 0, layers: int = 2):
    """ERNIE-Image: shared-AdaLN blocks on one sequence-first [image; text] stream."""
    from diffusers import ErnieImageTransformer2DModel

    torch.manual_seed(seed)
    model = ErnieImageTransformer2DModel(
        hidden_size=32,
        num_attention_heads=2,
        num_layers=layers,
        ffn_hidden_size=64,
        in_channels=16,
        out_channels=16,
        patch_size=1,
        text_in_dim=16,
        rope_axes_dim=(4, 6, 6),
    )
    with torch.no_grad():  # its modulation and output layer start at zero (a zero output); make them matter
        for name, p in model.named_parameters():
            if "adaLN_modulation" in name or "final_linear" in name:
                p.normal_(0, 0.2)
    return model.eval()


def ernie_image_inputs(batch: int, h: int, w: int, text: int = 5, padded: int = 0) -> dict:
    """Latents ``(B, 16, h, w)`` (one token per latent pixel) and the pipeline's padded text
    (``ErnieImagePipeline._pad_text``): the last sample's prompt ``padded`` tokens shorter."""
    from diffusers.pipelines.ernie_image.pipeline_ernie_image import ErnieImagePipeline

    g = torch.Generator().manual_seed(1)
    hiddens = [torch.randn(text - (padded if i == batch - 1 else 0), 16, generator=g) for i in range(batch)]
    text_bth, text_lens = ErnieImagePipeline._pad_text(hiddens, "cpu", torch.float32, 16)
    return {
        "hidden_states": torch.randn(batch, 16, h, w, generator=g),
        "timestep": torch.full((batch,), 700.0),
        "text_bth": text_bth,
        "text_lens": text_lens,
    }


def make_lumina2(seed: int = 0, layers: int = 2, caption: int = 64, caption_dim: int = TEXT_DIM):
    """Lumina 2: a caption and a noise refiner block, then blocks on [caption; image] per
    sample (2 query heads of 16 channels sharing one key head; 3-D rotary over (4, 6, 6),
    caption positions up to ``caption``)."""
    from diffusers import Lumina2Transformer2DModel

    torch.manual_seed(seed)
    model = Lumina2Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        hidden_size=32,
        num_layers=layers,
        num_refiner_layers=1,
        num_attention_heads=2,
        num_kv_heads=1,
        multiple_of=16,
        axes_dim_rope=(4, 6, 6),
        axes_lens=(caption, 64, 64),
        cap_feat_dim=caption_dim,
    )
    return model.eval()


def lumina2_inputs(batch: int, h: int, w: int, text: int = 6, padded: int = 0) -> dict:
    """Latents ``(B, 4, h, w)`` (2x2 patches) and the pipeline's padded caption with its
    mask: the last sample's caption ``padded`` tokens shorter (its sequence then starts its
    image ``padded`` tokens earlier)."""
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(batch, text, dtype=torch.bool)
    if padded:
        mask[-1, -padded:] = False
    return {
        "hidden_states": torch.randn(batch, 4, h, w, generator=g),
        "timestep": torch.full((batch,), 0.3),  # 1 - t / 1000: it rises over a run
        "encoder_hidden_states": torch.randn(batch, text, TEXT_DIM, generator=g),
        "encoder_attention_mask": mask,
    }


def make_qwenimage21(seed: int = 0, layers: int = 2):
    """Qwen-Image 2.1: single-stream blocks over [text; target image] (2 heads of 16
    channels, complex 3-D rotary over (4, 6, 6) channels), 16 latent channels, unpatched."""
    from diffusers import QwenImage21Transformer2DModel

    torch.manual_seed(seed)
    return QwenImage21Transformer2DModel(
        in_channels=16,
        out_channels=16,
        num_layers=layers,
        attention_head_dim=16,
        num_attention_heads=2,
        context_in_dim=TEXT_DIM,
        mlp_ratio=2,
        axes_dims_rope=(4, 6, 6),
    ).eval()


def qwenimage21_inputs(batch: int, h: int, w: int, text: int = 7, mode: str = "cached", layers: int = 2) -> dict:
    """A text-to-image call on an ``h x w`` target (``h * w`` a multiple of 4: the encoder's
    image slots stand for 2x2 tokens) after ``text`` prompt tokens. ``"cached"``: the
    pipeline's steps after the first, decoding from a prefix cache, here of random keys and
    values (``(B, text, heads, 16)`` a layer: what the queries attend to, besides their own,
    is an input like any other); ``"extract"``: its first step, filling a new cache."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    g = torch.Generator().manual_seed(1)
    cache = QwenImage21KVCache(layers)
    if mode == "cached":
        for layer in cache.layer_caches:
            layer.store(torch.randn(batch, text, 2, 16, generator=g), torch.randn(batch, text, 2, 16, generator=g))
    slots = torch.cat([torch.zeros(batch, text, dtype=torch.bool), torch.ones(batch, h * w // 4, dtype=torch.bool)], 1)
    return {
        "hidden_states": torch.randn(batch, h * w, 16, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, TEXT_DIM, generator=g),
        "timestep": torch.full((batch,), 0.5),
        "img_shapes": [[(1, h, w)]] * batch,
        "img_mask": slots,
        "encoder_hidden_states_mask": torch.ones(batch, text, dtype=torch.bool),
        "kv_cache": cache,
        "kv_cache_mode": mode,
    }


def make_helios(seed: int = 0, layers: int = 2):
    """Helios: Wan's blocks (2 heads of 16, 3-D rotary over (4, 6, 6) channels) with the
    three history embedders and the history keys' scaling (``is_amplify_history``) on."""
    from diffusers import HeliosTransformer3DModel

    torch.manual_seed(seed)
    return HeliosTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=64,
        num_layers=layers,
        rope_dim=(4, 6, 6),
        is_amplify_history=True,
    ).eval()


def helios_inputs(batch: int, frames: int, h: int, w: int, history: bool = True) -> dict:
    """A call generating ``frames`` latent frames of ``h x w`` (``(h/2) x (w/2)`` tokens a
    frame) after its pipeline's three histories of the same size: 2 short frames, 2 mid
    (embedded 2x2x2 coarser) and 3 long (4x4x4, padded), each with its frame indices."""
    g = torch.Generator().manual_seed(1)
    latents = lambda f: torch.randn(batch, 4, f, h, w, generator=g)  # noqa: E731
    index = lambda a, b: torch.arange(a, b)[None].expand(batch, -1)  # noqa: E731
    kw = {
        "hidden_states": latents(frames),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": torch.randn(batch, 5, TEXT_DIM, generator=g),
        "indices_hidden_states": index(7, 7 + frames),
    }
    if history:
        for name, f, first in (("long", 3, 0), ("mid", 2, 3), ("short", 2, 5)):
            kw[f"latents_history_{name}"] = latents(f)
            kw[f"indices_latents_history_{name}"] = index(first, first + f)
    return kw


def make_framepack(seed: int = 0, layers: int = 2, single: int = 2):
    """FramePack: HunyuanVideo's blocks (2 heads of 8, 3-D rotary over (2, 2, 4) channels)
    with the history embedders and the image projection its checkpoints have."""
    from diffusers import HunyuanVideoFramepackTransformer3DModel

    torch.manual_seed(seed)
    return HunyuanVideoFramepackTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=layers,
        num_single_layers=single,
        num_refiner_layers=1,
        patch_size=2,
        patch_size_t=1,
        text_embed_dim=TEXT_DIM,
        pooled_projection_dim=TEXT_DIM,
        rope_axes_dim=(2, 2, 4),
        has_image_proj=True,
        image_proj_dim=16,
        has_clean_x_embedder=True,
    ).eval()


def framepack_inputs(batch: int, frames: int, h: int, w: int, text: int = 6, padded: int = 2, seed: int = 1) -> dict:
    """The pipeline's call: ``frames x h x w`` latents to generate (tokens ``frames x h/2 x
    w/2``), 3 clean history frames, 4 at 2x and 4 at 4x (``h``, ``w`` multiples of 8), each
    with its frame indices (1-D, as the pipeline's: keep their lengths off the batch size,
    which the tests cut per sample); text with the last sample's last ``padded`` tokens
    masked, 3 image-embedding tokens."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, text)
    if batch > 1 and padded:
        mask[-1, text - padded :] = 0

    def latents(count: int) -> torch.Tensor:
        return torch.randn(batch, 4, count, h, w, generator=g)

    def indices(start: int, count: int) -> torch.Tensor:
        return torch.arange(start, start + count)

    return {
        "hidden_states": latents(frames),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": torch.randn(batch, text, TEXT_DIM, generator=g),
        "encoder_attention_mask": mask,
        "pooled_projections": torch.randn(batch, TEXT_DIM, generator=g),
        "image_embeds": torch.randn(batch, 3, 16, generator=g),
        "indices_latents": indices(11, frames),
        "guidance": torch.full((batch,), 6000.0),
        "latents_clean": latents(3),
        "indices_latents_clean": indices(0, 3),
        "latents_history_2x": latents(4),
        "indices_latents_history_2x": indices(3, 4),
        "latents_history_4x": latents(4),
        "indices_latents_history_4x": indices(7, 4),
    }


def make_chronoedit(seed: int = 0, layers: int = 2, image: bool = False):
    """ChronoEdit-like: condition channels, a reasoning clip of 8 frames whose ends a
    two-frame call takes; with ``image``, image embeddings before the text (as Wan 2.1 I2V,
    whose cross-attention takes the keys before the last 512 as the image's)."""
    from diffusers import ChronoEditTransformer3DModel

    torch.manual_seed(seed)
    return ChronoEditTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=8,
        out_channels=4,
        text_dim=CROSS_DIM,
        freq_dim=16,
        ffn_dim=32,
        num_layers=layers,
        image_dim=16 if image else None,
        added_kv_proj_dim=16 if image else None,
        rope_max_seq_len=32,
        rope_temporal_skip_len=8,
    ).eval()


def chronoedit_inputs(batch: int, frames: int, h: int, w: int, text: int = 5, image: int = 0, seed: int = 1) -> dict:
    """Latents and condition (8 channels) of ``frames x h x w`` (tokens ``frames x h/2 x w/2``),
    with ``image`` image-embedding tokens (then the text must be the pipeline's 512)."""
    g = torch.Generator().manual_seed(seed)
    kw = {
        "hidden_states": torch.randn(batch, 8, frames, h, w, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": torch.randn(batch, text, CROSS_DIM, generator=g),
    }
    if image:
        kw["encoder_hidden_states_image"] = torch.randn(batch, image, 16, generator=g)
    return kw


def make_cogview4(seed: int = 0, layers: int = 2, in_channels: int = 4):
    """CogView4-like: joint [text; image] attention, rotary on the image part, size conditioning."""
    from diffusers import CogView4Transformer2DModel

    torch.manual_seed(seed)
    return CogView4Transformer2DModel(
        patch_size=2,
        in_channels=in_channels,
        out_channels=4,
        num_layers=layers,
        attention_head_dim=8,
        num_attention_heads=2,
        text_embed_dim=CROSS_DIM,
        time_embed_dim=16,
        condition_dim=4,
        pos_embed_max_size=32,
        sample_size=16,
        rope_axes_dim=(16, 16),
    ).eval()


def cogview4_inputs(batch: int, h: int, w: int, text: int = 5, seed: int = 1) -> dict:
    """Latents ``(B, 4, h, w)`` (tokens ``h/2 x w/2``), the pipeline's size conditioning."""
    g = torch.Generator().manual_seed(seed)
    size = torch.tensor([[8.0 * h, 8.0 * w]]).repeat(batch, 1)
    return {
        "hidden_states": torch.randn(batch, 4, h, w, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, CROSS_DIM, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "original_size": size,
        "target_size": size.clone(),
        "crop_coords": torch.zeros(batch, 2),
    }


def make_mochi(seed: int = 0, layers: int = 2, trainable_rotary: bool = False):
    """Mochi-like: a video stream and a narrower text stream in joint attention, 3-D rotary
    (its frequencies drawn at random: the class starts them at 0, where every row is alike;
    frozen, as LoRA training leaves them, unless ``trainable_rotary``)."""
    from diffusers import MochiTransformer3DModel

    torch.manual_seed(seed)
    model = MochiTransformer3DModel(
        patch_size=2,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=layers,
        pooled_projection_dim=16,
        in_channels=4,
        text_embed_dim=CROSS_DIM,
        time_embed_dim=16,
        max_sequence_length=16,
    )
    with torch.no_grad():
        model.pos_frequencies.normal_()
    model.pos_frequencies.requires_grad_(trainable_rotary)
    return model.eval()


def mochi_inputs(batch: int, frames: int, h: int, w: int, text: int = 6, padded: int = 2, seed: int = 1) -> dict:
    """Latents ``(B, 4, frames, h, w)`` (tokens ``frames x h/2 x w/2``), text whose last sample
    pads its last ``padded`` tokens (the pipeline's T5 mask), and an early step's timestep,
    which rises over a run (from 0 to 1000)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, text, dtype=torch.bool)
    if padded:
        mask[-1, -padded:] = False
    return {
        "hidden_states": torch.randn(batch, 4, frames, h, w, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, CROSS_DIM, generator=g),
        "timestep": torch.full((batch,), 0.5),
        "encoder_attention_mask": mask,
    }


@dataclass(frozen=True)
class Family:
    """One row of the table: ``make()`` builds the tiny model, ``inputs(batch)`` one call's
    keyword arguments, ``options`` the ``apply_toma`` settings that merge its blocks, and
    ``adapter`` the name ``apply_toma`` reports."""

    name: str
    adapter: str
    make: Callable[[], torch.nn.Module]
    inputs: Callable[[int], dict]
    options: dict = field(default_factory=dict)
    proportional: bool = True  # whether apply_toma accepts proportional_attention=True here
    cross: bool = False  # whether it has a cross-attention to merge the queries of
    mlp: bool = True  # whether it has an MLP to merge (CogView4's runs on image and text in turn: none)
    # a call on an odd, non-square token grid (video: 1 or an odd number of frames; the
    # UNets, whose convolutions halve the latent, a non-square one whose tiles pad), and
    # the image tokens each merged block sees there
    odd: Callable[[int], dict] | None = None
    odd_tokens: int = 0
    # a call on a grid the default 4x4 tiles divide, where tokens stay in tile order
    # between merges; None where ``inputs`` is one already
    divided: Callable[[int], dict] | None = None
    # the token grid (t, h, w) of an ``inputs`` call: the latent grid for the UNets, whose
    # deeper levels halve it (rounding up, as their strided convolutions do)
    grid: tuple[int, int, int] | None = None
    # the forward keyword of a (B, T) text padding mask, where the model takes one
    text_mask: str | None = None
    # where the forward takes an attention mask over its joint [text; image] sequence:
    # joint_mask(kw, keep) is the call with the (B, S) bool mask ``keep`` (True keeps a key)
    # in the family's place and layout (Flux.1, FLUX.2: joint_attention_kwargs; Chroma:
    # attention_mask); None where it takes none
    joint_mask: Callable[[dict, torch.Tensor], dict] | None = None
    # whether its forwards may run in tile order; False where every call adds raster-ordered
    # residuals between blocks (Wan VACE's control hints)
    tile_order: bool = True
    # the forward keyword of the denoising timestep, and whether it rises over a run
    # (Z-Image's t, 1 - sigma) rather than falls
    timestep: str = "timestep"
    rising_timestep: bool = False
    # whether diffusers' gradient-checkpointed forward runs at all (HunyuanImage's fails, unpatched too)
    checkpointing: bool = True
    # whether text runs through the blocks as tokens (Qwen-Image 2.1's cached passes take it
    # as cached keys and values only, which tests/adapters/test_qwenimage21.py covers)
    text_in_blocks: bool = True
    # how far a sample's output in a batch of 2 may be from its output alone: float32 ulps
    # (~1e-7 an op) reach ~1e-6; Kandinsky 5's processor rounds its rotated queries and keys
    # to bfloat16, where such an ulp can tip an element by one bfloat16 ulp (2**-8 relative):
    # 5.6e-6 unmerged, 3.5e-5 merged (tokens averaged by another plan's sums), so 1e-4
    batch_atol: float = 1e-5

    def divided_inputs(self, batch: int) -> dict:
        """A call on a token grid the default tiles divide (see ``divided``)."""
        return (self.divided or self.inputs)(batch)

    def every_part(self) -> dict:
        """``options`` merging every part the family has: attention, MLP, cross-attention."""
        return {**self.options, "merge_mlp": self.mlp, "merge_crossattn": self.cross}

    def output(self, model: torch.nn.Module, kw: dict) -> torch.Tensor:
        """The denoiser's prediction for ``kw``, without gradients."""
        with torch.no_grad():
            return self.sample(model, kw)

    def sample(self, model: torch.nn.Module, kw: dict) -> torch.Tensor:
        """The denoiser's prediction for ``kw`` as one batch tensor."""
        out = model(**kw).sample
        return torch.stack(out) if isinstance(out, list) else out  # Z-Image: one tensor per sample


FLUX_ALL = {"flux_double_blocks": (0, 1), "flux_single_blocks": (0, 1)}

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "sdxl",
            "unet",
            make_sdxl_unet,
            lambda b: unet_inputs(b, 16, 16, sdxl=True),
            {"merge_mlp": True},  # its one attention level: down_blocks.1 and the mid block, both at 1/2
            cross=True,
            odd=lambda b: unet_inputs(b, 8, 24, sdxl=True),
            odd_tokens=4 * 12,
            grid=(1, 16, 16),
            text_mask="encoder_attention_mask",
        ),
        Family(
            "sd15",
            "unet",
            make_sd15_unet,
            lambda b: unet_inputs(b, 10, 14, sdxl=False),
            {"merge_mlp": True},
            cross=True,
            odd=lambda b: unet_inputs(b, 10, 14, sdxl=False),
            odd_tokens=10 * 14,
            divided=lambda b: unet_inputs(b, 16, 16, sdxl=False),
            grid=(1, 10, 14),
            text_mask="encoder_attention_mask",
        ),
        Family(
            "flux",
            "flux",
            make_flux,
            lambda b: flux_inputs(b, 8, 8),
            FLUX_ALL,
            odd=lambda b: flux_inputs(b, 5, 7),
            odd_tokens=35,
            grid=(1, 8, 8),
            joint_mask=flux_joint_mask,
        ),
        Family(
            "flux-kontext",
            "flux",
            make_flux,
            lambda b: kontext_inputs(b, 8, 8, 4, 4),
            FLUX_ALL,
            odd=lambda b: kontext_inputs(b, 5, 7, 3, 3),
            odd_tokens=35,
            grid=(1, 8, 8),
            joint_mask=flux_joint_mask,
        ),
        Family(
            "sd3",
            "sd3",
            make_sd3,
            lambda b: sd3_inputs(b, 16, 20),
            {"blocks": {"transformer_blocks": range(4)}},
            proportional=True,
            odd=lambda b: sd3_inputs(b, 10, 14),
            odd_tokens=35,
            divided=lambda b: sd3_inputs(b, 16, 16),
            grid=(1, 8, 10),
        ),
        Family(
            "pixart",
            "pixart",
            make_pixart,
            lambda b: pixart_inputs(b, 16, 20),
            {"blocks": {"transformer_blocks": range(3)}},
            cross=True,
            odd=lambda b: pixart_inputs(b, 10, 14),
            odd_tokens=35,
            divided=lambda b: pixart_inputs(b, 16, 16),
            grid=(1, 8, 10),
            text_mask="encoder_attention_mask",
        ),
        Family(
            "wan",
            "wan",
            make_wan,
            lambda b: wan_inputs(b, 4, 12, 16),
            {"blocks": {"blocks": range(3)}},
            cross=True,
            odd=lambda b: wan_inputs(b, 3, 10, 14),
            odd_tokens=3 * 35,
            divided=lambda b: wan_inputs(b, 4, 16, 16),
            grid=(4, 6, 8),
        ),
        Family(
            "ltx",
            "ltx",
            make_ltx,
            lambda b: ltx_inputs(b, 4, 6, 8),
            {"blocks": {"transformer_blocks": range(3)}},
            proportional=True,
            cross=True,
            odd=lambda b: ltx_inputs(b, 3, 5, 7),
            odd_tokens=3 * 35,
            divided=lambda b: ltx_inputs(b, 4, 8, 8),
            grid=(4, 6, 8),
            text_mask="encoder_attention_mask",
        ),
        Family(
            "ltx2",
            "ltx2",
            make_ltx2,
            lambda b: ltx2_inputs(b, 4, 6, 8),
            {"blocks": {"transformer_blocks": range(2)}},
            proportional=True,
            cross=True,
            odd=lambda b: ltx2_inputs(b, 3, 5, 7),
            odd_tokens=3 * 35,
            divided=lambda b: ltx2_inputs(b, 4, 8, 8),
            grid=(4, 6, 8),
            text_mask="encoder_attention_mask",
        ),
        Family(
            "qwenimage",
            "qwenimage",
            make_qwen,
            lambda b: qwen_inputs(b, 8, 10),
            {"blocks": {"transformer_blocks": range(3)}},
            proportional=True,
            odd=lambda b: qwen_inputs(b, 5, 7),
            odd_tokens=35,
            divided=lambda b: qwen_inputs(b, 8, 8),
            grid=(1, 8, 10),
            text_mask="encoder_hidden_states_mask",
        ),
        Family(
            "flux2",
            "flux2",
            make_flux2,
            lambda b: flux2_inputs(b, 8, 10),
            {"blocks": {"transformer_blocks": range(2), "single_transformer_blocks": range(2)}},
            proportional=True,
            odd=lambda b: flux2_inputs(b, 5, 7),
            odd_tokens=35,
            divided=lambda b: flux2_inputs(b, 8, 8),
            grid=(1, 8, 10),
            joint_mask=flux_joint_mask,
        ),
        Family(
            "hunyuanvideo",
            "hunyuanvideo",
            make_hunyuan,
            lambda b: hunyuan_inputs(b, 3, 8, 8),
            {"blocks": {"transformer_blocks": range(2), "single_transformer_blocks": range(2)}},
            proportional=True,
            odd=lambda b: hunyuan_inputs(b, 1, 10, 14),
            odd_tokens=35,
            grid=(3, 4, 4),
            text_mask="encoder_attention_mask",
        ),
        Family(
            "cogvideox",
            "cogvideox",
            make_cogvideox,
            lambda b: cogvideox_inputs(b, 3, 8, 8),
            {"blocks": {"transformer_blocks": range(3)}},
            proportional=True,
            odd=lambda b: cogvideox_inputs(b, 3, 10, 14),
            odd_tokens=3 * 35,
            grid=(3, 4, 4),
        ),
        Family(
            "hunyuanvideo15",
            "hunyuanvideo15",
            make_hunyuan15,
            lambda b: hunyuan15_inputs(b, 3, 8, 8),
            {"blocks": {"transformer_blocks": range(2)}},
            proportional=True,
            odd=lambda b: hunyuan15_inputs(b, 1, 10, 14),
            odd_tokens=35,
            grid=(3, 4, 4),
            text_mask="encoder_attention_mask",
        ),
        Family(
            "wan-vace",
            "wan-vace",
            make_wan_vace,
            lambda b: wan_vace_inputs(b, 4, 12, 16),
            {"blocks": {"blocks": range(3), "vace_blocks": range(2)}},
            cross=True,
            odd=lambda b: wan_vace_inputs(b, 3, 10, 14),
            odd_tokens=3 * 35,
            divided=lambda b: wan_vace_inputs(b, 4, 16, 16),
            grid=(4, 6, 8),
            tile_order=False,
        ),
        Family(
            "skyreels-v2",
            "skyreels-v2",
            make_skyreels,
            lambda b: wan_inputs(b, 4, 12, 16),
            {"blocks": {"blocks": range(3)}},
            cross=True,
            odd=lambda b: wan_inputs(b, 3, 10, 14),
            odd_tokens=3 * 35,
            divided=lambda b: wan_inputs(b, 4, 16, 16),
            grid=(4, 6, 8),
        ),
        Family(
            "wan-animate",
            "wan-animate",
            make_wan_animate,
            lambda b: wan_animate_inputs(b, 4, 12, 16),
            {"blocks": {"blocks": range(4)}},
            cross=True,
            odd=lambda b: wan_animate_inputs(b, 3, 10, 14),
            odd_tokens=3 * 35,
            divided=lambda b: wan_animate_inputs(b, 4, 16, 16),
            grid=(4, 6, 8),
        ),
        Family(
            "cosmos",
            "cosmos",
            make_cosmos,
            lambda b: cosmos_inputs(b, 3, 8, 8),
            {"blocks": {"transformer_blocks": range(3)}},
            proportional=True,
            cross=True,
            odd=lambda b: cosmos_inputs(b, 3, 10, 14),
            odd_tokens=3 * 35,
            grid=(3, 4, 4),
        ),
        Family(
            "longcat-image",
            "longcat-image",
            make_longcat,
            lambda b: longcat_inputs(b, 8, 8),
            {"blocks": {"transformer_blocks": range(2), "single_transformer_blocks": range(2)}},
            odd=lambda b: longcat_inputs(b, 5, 7),
            odd_tokens=35,
            grid=(1, 8, 8),
        ),
        Family(
            "longcat-image-edit",
            "longcat-image",
            make_longcat,
            lambda b: longcat_inputs(b, 8, 8, refs=(4, 4)),
            {"blocks": {"transformer_blocks": range(2), "single_transformer_blocks": range(2)}},
            odd=lambda b: longcat_inputs(b, 5, 7, refs=(3, 3)),
            odd_tokens=35,
            grid=(1, 8, 8),
        ),
        Family(
            "hunyuanimage",
            "hunyuanimage",
            make_hunyuanimage,
            lambda b: hunyuanimage_inputs(b, 16, 20),
            {"blocks": {"transformer_blocks": range(2), "single_transformer_blocks": range(2)}},
            odd=lambda b: hunyuanimage_inputs(b, 10, 14),
            odd_tokens=35,
            divided=lambda b: hunyuanimage_inputs(b, 16, 16),
            grid=(1, 8, 10),
            text_mask="encoder_attention_mask",
            checkpointing=False,
        ),
        Family(
            "chroma",
            "chroma",
            make_chroma,
            lambda b: chroma_inputs(b, 8, 8),
            {"blocks": {"transformer_blocks": range(2), "single_transformer_blocks": range(2)}},
            odd=lambda b: chroma_inputs(b, 5, 7),
            odd_tokens=35,
            grid=(1, 8, 8),
            joint_mask=chroma_joint_mask,
        ),
        Family(
            "joyimage",
            "joyimage",
            make_joyimage,
            lambda b: joyimage_inputs(b, 16, 20),
            {"blocks": {"double_blocks": range(2)}},
            proportional=True,
            odd=lambda b: joyimage_inputs(b, 10, 14),
            odd_tokens=35,
            divided=lambda b: joyimage_inputs(b, 16, 16),
            grid=(1, 8, 10),
        ),
        Family(
            "joyimage-edit",
            "joyimage",
            make_joyimage,
            lambda b: joyimage_inputs(b, 16, 20, refs=1),
            {"blocks": {"double_blocks": range(2)}},
            proportional=True,
            odd=lambda b: joyimage_inputs(b, 10, 14, refs=1),
            odd_tokens=35,
            divided=lambda b: joyimage_inputs(b, 16, 16, refs=1),
            grid=(1, 8, 10),
        ),
        Family(
            "krea2",
            "krea2",
            make_krea2,
            lambda b: krea2_inputs(b, 8, 10, padded=2),
            {"blocks": {"transformer_blocks": range(2)}},
            odd=lambda b: krea2_inputs(b, 5, 7, padded=2),
            odd_tokens=35,
            divided=lambda b: krea2_inputs(b, 8, 8, padded=2),
            grid=(1, 8, 10),
            text_mask="encoder_attention_mask",
        ),
        Family(
            "zimage",
            "zimage",
            make_zimage,
            lambda b: zimage_inputs(b, 16, 16),
            {"blocks": {"layers": range(2)}},
            odd=lambda b: zimage_inputs(b, 10, 14),  # 5x7 tokens, which the forward pads to 64
            odd_tokens=35,
            grid=(1, 8, 8),
            tile_order=False,  # the forward keeps raster order (see toma/adapters/families/zimage.py)
            timestep="t",
            rising_timestep=True,
        ),
        Family(
            "bria-fibo",
            "bria-fibo",
            make_bria_fibo,
            lambda b: bria_fibo_inputs(b, 8, 8, padded=2),
            {"blocks": {"transformer_blocks": range(2), "single_transformer_blocks": range(2)}},
            odd=lambda b: bria_fibo_inputs(b, 5, 7, padded=2),
            odd_tokens=35,
            grid=(1, 8, 8),
            joint_mask=flux_joint_mask,
        ),
        Family(
            "framepack",
            "framepack",
            make_framepack,
            lambda b: framepack_inputs(b, 3, 16, 16),
            {"blocks": {"transformer_blocks": range(2), "single_transformer_blocks": range(2)}},
            odd=lambda b: framepack_inputs(b, 1, 10, 14),  # one frame of 5x7 tokens
            odd_tokens=35,
            grid=(3, 8, 8),
            text_mask="encoder_attention_mask",
            tile_order=False,  # the forward keeps raster order (see toma/adapters/families/framepack.py)
        ),
        Family(
            "helios",
            "helios",
            make_helios,
            lambda b: helios_inputs(b, 2, 16, 16),
            {"blocks": {"blocks": range(2)}},
            cross=True,
            odd=lambda b: helios_inputs(b, 1, 10, 14),  # one frame of 5x7 tokens
            odd_tokens=35,
            grid=(2, 8, 8),
            tile_order=False,  # the forward keeps raster order (see toma/adapters/families/helios.py)
        ),
        Family(
            "hidream",
            "hidream",
            make_hidream,
            lambda b: hidream_inputs(b, 8, 8),
            {"blocks": {"double_stream_blocks": range(2), "single_stream_blocks": range(2)}},
            proportional=False,
            odd=lambda b: hidream_inputs(b, 5, 7),  # padded to max_resolution's 256 tokens, masked
            odd_tokens=35,
            divided=lambda b: hidream_inputs(b, 8, 8),
            grid=(1, 8, 8),
            timestep="timesteps",
        ),
        Family(
            "minimax-h3",
            "minimax-h3",
            make_minimax_h3,
            lambda b: minimax_h3_inputs(b, 2, 16, 20),
            {"blocks": {"transformer_blocks": range(2)}},
            odd=lambda b: minimax_h3_inputs(b, 1, 10, 14),
            odd_tokens=35,
            divided=lambda b: minimax_h3_inputs(b, 2, 16, 16),
            grid=(2, 8, 10),
        ),
        Family(
            "ideogram4",
            "ideogram4",
            make_ideogram4,
            lambda b: ideogram4_inputs(b, 8, 10),
            {"blocks": {"layers": range(2)}},
            odd=lambda b: ideogram4_inputs(b, 5, 7),
            odd_tokens=35,
            divided=lambda b: ideogram4_inputs(b, 8, 8),
            grid=(1, 8, 10),
            rising_timestep=True,
        ),
        Family(
            "kandinsky5",
            "kandinsky5",
            make_kandinsky5,
            lambda b: kandinsky5_inputs(b, 4, 12, 16),
            {"blocks": {"visual_transformer_blocks": range(3)}},
            cross=True,
            odd=lambda b: kandinsky5_inputs(b, 3, 10, 14),
            odd_tokens=3 * 35,
            divided=lambda b: kandinsky5_inputs(b, 4, 16, 16),
            grid=(4, 6, 8),
            batch_atol=1e-4,
        ),
        Family(
            "ernie-image",
            "ernie-image",
            make_ernie_image,
            lambda b: ernie_image_inputs(b, 8, 10, padded=2),
            {"blocks": {"layers": range(2)}},
            odd=lambda b: ernie_image_inputs(b, 5, 7, padded=2),
            odd_tokens=35,
            grid=(1, 8, 10),
            tile_order=False,  # the forward keeps raster order (see toma/adapters/families/ernie_image.py)
        ),
        Family(
            "lumina2",
            "lumina2",
            make_lumina2,
            # captions of one length (the pipeline's calls: one prompt, CFG's two passes apart);
            # test_text_masks and test_lumina2.py pad one, which shifts its image
            lambda b: lumina2_inputs(b, 16, 20),
            {"blocks": {"layers": range(2)}},
            proportional=False,
            odd=lambda b: lumina2_inputs(b, 10, 14),
            odd_tokens=35,
            grid=(1, 8, 10),
            text_mask="encoder_attention_mask",
            tile_order=False,  # the forward keeps raster order (see toma/adapters/families/lumina2.py)
            rising_timestep=True,
        ),
        Family(
            "qwenimage21",
            "qwenimage21",
            make_qwenimage21,
            # a cached pass (every step of the pipeline's but the first, which runs unmerged)
            lambda b: qwenimage21_inputs(b, 8, 8),
            {"blocks": {"transformer_blocks": range(2)}},
            odd=lambda b: qwenimage21_inputs(b, 5, 12),
            odd_tokens=60,
            grid=(1, 8, 8),
            text_in_blocks=False,
        ),
        Family(
            "flux3",
            "flux3",
            make_flux3,
            lambda b: flux3_inputs(b, 8, 8),
            {"blocks": {"mode_blocks.image": range(2), "single_transformer_blocks": range(2)}},
            odd=lambda b: flux3_inputs(b, 5, 7),
            odd_tokens=35,
            grid=(1, 8, 8),
        ),
        Family(
            "chronoedit",
            "chronoedit",
            make_chronoedit,
            # two frames: the pipeline's edit without temporal reasoning (input and edited image)
            lambda b: chronoedit_inputs(b, 2, 12, 16),
            {"blocks": {"blocks": range(2)}},
            cross=True,
            odd=lambda b: chronoedit_inputs(b, 3, 10, 14),
            odd_tokens=3 * 35,
            divided=lambda b: chronoedit_inputs(b, 2, 16, 16),
            grid=(2, 6, 8),
        ),
        Family(
            "cogview4",
            "cogview4",
            make_cogview4,
            lambda b: cogview4_inputs(b, 16, 20),
            {"blocks": {"transformer_blocks": range(2)}},
            odd=lambda b: cogview4_inputs(b, 10, 14),
            odd_tokens=35,
            divided=lambda b: cogview4_inputs(b, 16, 16),
            grid=(1, 8, 10),
            text_mask="attention_mask",
            mlp=False,
        ),
        Family(
            "mochi",
            "mochi",
            make_mochi,
            lambda b: mochi_inputs(b, 3, 8, 8),
            {"blocks": {"transformer_blocks": range(2)}},
            odd=lambda b: mochi_inputs(b, 3, 10, 14),
            odd_tokens=3 * 35,
            grid=(3, 4, 4),
            text_mask="encoder_attention_mask",
            rising_timestep=True,
        ),
    )
}
