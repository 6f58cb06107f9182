"""Tiny diffusers models built from config with random weights (the real code paths)."""

from __future__ import annotations

import os

# The Triton kernels (tests/test_kernels.py) run in Triton's interpreter here. Triton reads
# the switch as it loads, and diffusers loads it, so it must be set before that import.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import FluxTransformer2DModel, UNet2DConditionModel  # noqa: E402

from toma.kernels import LAUNCH_OBSERVERS  # noqa: E402

CROSS_DIM = 32

# Every Triton launch the tests make, by signature: tests/test_kernel_compile.py, which
# runs last, compiles each one for real GPU targets (the interpreter checks what a kernel
# computes, not whether it compiles).
LAUNCHES: dict[str, dict] = {}


def _record_launch(name, kernel, args, meta) -> None:
    from toma.kernels.aot import record, record_key

    if not hasattr(kernel, "fn"):  # a stand-in kernel (tests/test_kernel_fallback.py)
        return
    rec = record(name, kernel, args, meta)
    LAUNCHES.setdefault(record_key(rec), rec)


LAUNCH_OBSERVERS.append(_record_launch)


def pytest_collection_modifyitems(config, items):
    # the compile check reads what every other test launched
    items.sort(key=lambda item: item.get_closest_marker("after_all_launches") is not None)


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


@pytest.fixture
def sdxl_unet() -> UNet2DConditionModel:
    return make_sdxl_unet()


@pytest.fixture
def sd15_unet() -> UNet2DConditionModel:
    return make_sd15_unet()


@pytest.fixture
def flux() -> FluxTransformer2DModel:
    return make_flux()


@pytest.fixture
def one_thread():
    """One torch thread for the test, then the previous count back.

    The tiny models gain nothing from more threads, and the CLI under test sets the count
    itself; restoring it keeps the rest of the suite unaffected.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_sd3(seed: int = 0, layers: int = 4, dual: tuple[int, ...] = (0, 1)):
    """SD3.5-like: joint attention, the first blocks with an image-only second attention."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    return SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=layers, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=CROSS_DIM, caption_projection_dim=16, pooled_projection_dim=16,
        pos_embed_max_size=32, dual_attention_layers=dual,
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
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=in_channels,
        out_channels=in_channels, text_dim=text_dim, freq_dim=16, ffn_dim=32, num_layers=layers, rope_max_seq_len=32,
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
        sample_size=8, num_layers=layers, patch_size=2, attention_head_dim=8, num_attention_heads=2, caption_channels=CROSS_DIM,
        in_channels=4, cross_attention_dim=16, out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
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
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=layers, caption_channels=CROSS_DIM,
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
