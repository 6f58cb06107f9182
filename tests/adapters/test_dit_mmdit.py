"""Dual-stream MMDiTs with rotary positions on the engine (QwenImage, Flux.2), and the
engine's per-sample calls for processors that take one rotary table for the whole batch."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxPosEmbed

import toma
from toma.adapters.ledger import Ledger
from toma.adapters.base import HOOK_NAME, remove_hook
from toma.adapters.engine import FamilySpec, Rotary, Site, attach, find_targets
from toma.adapters.layouts import TEXT_FIRST, Span
from toma.adapters.spec import RopeModule
from toma.config import ToMAConfig
from toma.adapters.state import PlanCache


# ------------------------------------------------------------------ the engine, on a toy model
class _SharedRotaryAttention(torch.nn.Module):
    """Joint attention over [text; image] that applies one ``(S, D)`` rotary table to the
    whole batch, as diffusers' ``apply_rotary_emb`` does (``cos[None, :, None, :]``)."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, image_rotary_emb):
        text = encoder_hidden_states.shape[1]
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(2)  # (B, S, heads, D) each
        q, k = (
            apply_rotary_emb(q, image_rotary_emb, sequence_dim=1),
            apply_rotary_emb(k, image_rotary_emb, sequence_dim=1),
        )
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        o = self.out(o.transpose(1, 2).flatten(2))
        return o[:, text:], o[:, :text]


class _ToyBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.attn = _SharedRotaryAttention()

    def forward(self, hidden_states, encoder_hidden_states, image_rotary_emb):
        image, text = self.attn(self.norm(hidden_states), encoder_hidden_states, image_rotary_emb=image_rotary_emb)
        return hidden_states + image, encoder_hidden_states + text


class ToyMMDiT(torch.nn.Module):
    """Image tokens ``(B, h*w, 4)`` and text ``(B, T, 16)``; rotary rows for [text; image]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj_in = torch.nn.Linear(4, 16)
        self.rope = FluxPosEmbed(theta=10000, axes_dim=[4, 4])
        self.blocks = torch.nn.ModuleList([_ToyBlock() for _ in range(2)])
        self.norm_out = torch.nn.LayerNorm(16)

    def forward(self, hidden_states, encoder_hidden_states, height: int, width: int):
        text = encoder_hidden_states.shape[1]
        rows = torch.arange(height).repeat_interleave(width)
        cols = torch.arange(width).repeat(height)
        ids = torch.cat([torch.stack([torch.arange(text) + 100, torch.zeros(text)], 1), torch.stack([rows, cols], 1)])
        tables = self.rope(ids.float())
        x = self.proj_in(hidden_states)
        for block in self.blocks:
            x, encoder_hidden_states = block(x, encoder_hidden_states, tables)
        return self.norm_out(x)


def _toy_spec(shared: bool) -> FamilySpec:
    rotary = (
        Rotary("image_rotary_emb", None, shared=True) if shared else Rotary("image_rotary_emb", None, _keep_text_gather)
    )
    return FamilySpec(
        name="toy",
        classes=("ToyMMDiT",),
        stacks=("blocks",),
        sites=lambda stack, block: [Site("attn", "attn", rotary=rotary)],
        grid=lambda model, call: (1, call["height"], call["width"]),
        enter=("output", "proj_in"),
        leave="norm_out",
        tables=(RopeModule("rope", 0),),
    )


def _keep_text_gather(table, dest):
    # the per-sample (Bp, S, D) tables a broadcasting processor would take
    text = table.shape[0] - 48
    return torch.cat([table[:text].expand(dest.shape[0], -1, -1), table[text:][dest]], dim=1)


def _toy_inputs(batch: int) -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(batch, 48, 4, generator=g),
        "encoder_hidden_states": torch.randn(batch, 3, 16, generator=g),
        "height": 6,
        "width": 8,
    }


def _patch_toy(model: torch.nn.Module, spec: FamilySpec, **options) -> list[torch.nn.Module]:
    config = ToMAConfig(ratio=0.5, blocks={"blocks": range(2)}, **options)
    targets, _ = find_targets(spec, model, config)
    return attach(spec, model, targets, PlanCache(config), Ledger())


def test_shared_rotary_runs_each_sample_with_its_own_table():
    # a batch of 2 with a plan per sample: each sample's output is its batch-1 output
    model = ToyMMDiT()
    kw = _toy_inputs(2)
    with torch.no_grad():
        ref = model(**kw)
    hooked = _patch_toy(model, _toy_spec(shared=True))
    calls: list[tuple] = []
    handle = model.blocks[1].attn.qkv.register_forward_hook(lambda m, a, o: calls.append(tuple(a[0].shape[:2])))
    with torch.no_grad():
        both = model(**kw)
        alone = [
            model(**{**kw, **{k: kw[k][b : b + 1] for k in ("hidden_states", "encoder_hidden_states")}})
            for b in range(2)
        ]
    handle.remove()
    assert calls[:2] == [(1, 3 + 24)] * 2  # one call per sample, text whole and half the 48 image tokens
    assert not torch.allclose(both, ref, atol=1e-3)
    for b in range(2):
        torch.testing.assert_close(both[b : b + 1], alone[b], rtol=1e-5, atol=1e-6)
    for module in hooked:
        remove_hook(module, HOOK_NAME)
    with torch.no_grad():
        assert torch.equal(model(**kw), ref)


def test_shared_rotary_with_one_plan_for_the_batch_makes_one_call():
    model = ToyMMDiT()
    _patch_toy(model, _toy_spec(shared=True), share_batch_plan=True)
    calls: list[tuple] = []
    model.blocks[0].attn.qkv.register_forward_hook(lambda m, a, o: calls.append(tuple(a[0].shape[:2])))
    with torch.no_grad():
        model(**_toy_inputs(2))
    assert calls == [(2, 3 + 24)]


def test_per_sample_tables_break_a_shared_table_processor():
    # the check above fails without the mechanism: per-sample tables do not broadcast
    model = ToyMMDiT()
    _patch_toy(model, _toy_spec(shared=False))
    with pytest.raises(RuntimeError):
        with torch.no_grad():
            model(**_toy_inputs(2))


def test_rotary_needs_a_gather_unless_shared():
    with pytest.raises(ValueError, match="Rotary needs a gather function unless shared=True"):
        Rotary("image_rotary_emb", None)


class _SpanBlock(torch.nn.Module):
    """A single-stream block on [text; image]: its norm feeds attention and an MLP in
    parallel, and ``proj_out`` joins them before the residual (Flux's single blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.mlp = torch.nn.Linear(16, 32)
        self.proj_out = torch.nn.Linear(16 + 32, 16)

    def forward(self, hidden_states):
        n = self.norm(hidden_states)
        a = self.attn(n, n, n, need_weights=False)[0]
        return hidden_states + self.proj_out(torch.cat([a, F.gelu(self.mlp(n))], dim=-1))


class ToySingleStream(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj_in = torch.nn.Linear(4, 16)
        self.blocks = torch.nn.ModuleList([_SpanBlock() for _ in range(2)])
        self.norm_out = torch.nn.LayerNorm(16)

    def forward(self, hidden_states, encoder_hidden_states, height: int, width: int):
        x = torch.cat([encoder_hidden_states, self.proj_in(hidden_states)], dim=1)
        for block in self.blocks:
            x = block(x)
        return self.norm_out(x)


def test_a_spanning_site_merges_from_one_output_to_another():
    # out = x + [text; U proj_out([attn; mlp]([n_text; M n_image]))]: attention and the MLP
    # both run on the merged tokens, the residual and the text stay whole
    spec = FamilySpec(
        name="toy",
        classes=("ToySingleStream",),
        stacks=("blocks",),
        sites=lambda stack, block: [Site("norm", "attn", layout=TEXT_FIRST, span=Span(call="attn", until="proj_out"))],
        grid=lambda model, call: (1, call["height"], call["width"]),
        enter=("block", ""),
        leave="norm_out",
    )
    model, kw = ToySingleStream(), _toy_inputs(2)
    config = ToMAConfig(ratio=0.5, blocks={"blocks": (1,)})
    targets, _ = find_targets(spec, model, config)
    assert [t.name for t in targets] == ["blocks.1"]
    cache = PlanCache(config)
    hooked = attach(spec, model, targets, cache, Ledger())
    seen = []
    handle = model.blocks[1].mlp.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[1]))
    with torch.no_grad():
        out = model(**kw)
        handle.remove()
        [plan] = [p for _, p in cache._plans.values()]  # 6x8 grid, 4x4 tiles: padded, so raster order
        for module in hooked:
            remove_hook(module, HOOK_NAME)
        block = model.blocks[1]
        x = block_input = model.blocks[0](
            torch.cat([kw["encoder_hidden_states"], model.proj_in(kw["hidden_states"])], 1)
        )
        n = block.norm(x)
        n = torch.cat([n[:, :3], plan.merge(n[:, 3:])], dim=1)
        y = block.proj_out(torch.cat([block.attn(n, n, n, need_weights=False)[0], F.gelu(block.mlp(n))], dim=-1))
        expected = model.norm_out(block_input + torch.cat([y[:, :3], plan.unmerge(y[:, 3:])], dim=1))
    assert seen == [3 + plan.num_merged] and plan.num_merged < 48
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ QwenImage and Flux.2
from tests.tiny_models import TEXT_DIM, flux2_inputs, make_flux2, make_qwen, qwen_inputs  # noqa: E402

ALL_QWEN = {"blocks": {"transformer_blocks": range(3)}}
ALL_FLUX2 = {"blocks": {"transformer_blocks": range(2), "single_transformer_blocks": range(2)}}
MMDITS = {  # family -> (model maker, inputs(batch, token rows, token columns), every block)
    "qwenimage": (make_qwen, qwen_inputs, ALL_QWEN),
    "flux2": (make_flux2, flux2_inputs, ALL_FLUX2),
}


def run(model, **kw):
    with torch.no_grad():
        return model(**kw, return_dict=False)[0]


def record_lengths(model, family: str):
    """Sequence lengths reaching the image and text projections of every attention."""
    image: list[tuple] = []
    text: list[int] = []
    handles = []
    for block in model.transformer_blocks:
        handles.append(block.attn.to_q.register_forward_hook(lambda m, a, o: image.append(tuple(a[0].shape[:2]))))
        handles.append(block.attn.add_q_proj.register_forward_hook(lambda m, a, o: text.append(a[0].shape[1])))
    for block in getattr(model, "single_transformer_blocks", ()):
        handles.append(
            block.attn.to_qkv_mlp_proj.register_forward_hook(lambda m, a, o: image.append(tuple(a[0].shape[:2])))
        )
    return image, text, handles


@pytest.mark.parametrize("family", MMDITS)
@pytest.mark.parametrize("h,w", [(6, 10), (5, 7), (12, 4)])
def test_grids_the_tiles_do_not_divide_and_non_square(family, h, w):
    make, inputs, blocks = MMDITS[family]
    model, kw = make(), inputs(2, h, w)
    ref = run(model, **kw)
    patch = toma.apply_toma(model, ratio=0.5, **blocks)
    image, _, handles = record_lengths(model, family)
    out = run(model, **kw)
    for handle in handles:
        handle.remove()
    kept = patch.cache.layout(1, h, w).num_merged
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert kept < h * w and {n for _, n in image} <= {kept, 5 + kept}


def test_qwen_text_mask_applies_to_merged_attention():
    # masked text tokens are hidden from merged image tokens: changing them changes nothing
    model = make_qwen()
    kw = qwen_inputs(2, 8, 8, text=6)
    kw["encoder_hidden_states_mask"][:, -2:] = 0
    patch = toma.apply_toma(model, ratio=0.5, **ALL_QWEN)
    image, _, handles = record_lengths(model, "qwenimage")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: it merges
        out = run(model, **kw)
    for h in handles:
        h.remove()
    assert image == [(1, patch.cache.layout(1, 8, 8).num_merged)] * 6  # 3 blocks, one call per sample
    changed = dict(kw, encoder_hidden_states=kw["encoder_hidden_states"].clone())
    changed["encoder_hidden_states"][:, -2:] = 100.0
    torch.testing.assert_close(run(model, **changed), out, rtol=1e-5, atol=1e-6)
    unmasked = {k: dict(v, encoder_hidden_states_mask=torch.ones(2, 6)) for k, v in (("kw", kw), ("changed", changed))}
    assert not torch.allclose(
        run(model, **unmasked["changed"]), run(model, **unmasked["kw"]), atol=1e-3
    )  # the tokens matter unmasked


@pytest.mark.parametrize("family", MMDITS)
def test_set_attention_backend_reaches_merged_attention(family, monkeypatch):
    import importlib

    make, inputs, blocks = MMDITS[family]
    module = importlib.import_module(f"diffusers.models.transformers.transformer_{family}")
    model, kw = make(), inputs(2, 8, 8)
    seen = []
    real = module.dispatch_attention_fn
    monkeypatch.setattr(
        module,
        "dispatch_attention_fn",
        lambda *a, backend=None, **k: seen.append((a[0].shape[:2], backend)) or real(*a, backend=backend, **k),
    )
    ref = run(model, **kw)
    toma.apply_toma(model, ratio=0.5, **blocks)
    model.set_attention_backend("_native_math")
    seen.clear()
    merged = run(model, **kw)
    assert seen and all(shape[0] == 1 and shape[1] < 5 + 64 for shape, _ in seen)  # per sample, merged
    assert all(str(b) == "AttentionBackendName._NATIVE_MATH" for _, b in seen)
    assert not torch.allclose(merged, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", MMDITS)
def test_default_blocks_skip_the_first_and_flux_options_are_refused(family):
    make = MMDITS[family][0]
    model = make(layers=12) if family == "qwenimage" else make(double=8, single=12)
    patch = toma.apply_toma(model, ratio=0.5)
    names = [p.name for p in patch.patched]
    if family == "qwenimage":
        assert names == [f"transformer_blocks.{i}.attn" for i in range(5, 12)]
    else:  # 8 double blocks: the skip is capped at half a stack
        assert names == [f"transformer_blocks.{i}.attn" for i in range(4, 8)] + [
            f"single_transformer_blocks.{i}.attn" for i in range(5, 12)
        ]
    toma.remove_toma(model)
    with pytest.raises(ValueError, match="flux_double_blocks applies to Flux.1 only; .* places merging with blocks="):
        toma.apply_toma(model, flux_double_blocks=(1,))
    assert toma.get_toma(model) is None and not hasattr(model, "_diffusers_hook")


def tiny_qwen2_tokenizer(folder):
    """A byte-level Qwen2 tokenizer, one token per byte, with a chat template (no download)."""
    import json

    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = Qwen2Tokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), pad_token="<|endoftext|>")
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n"
    )
    return tokenizer


def test_qwenimage_pipeline_round_trip(tmp_path):
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    from tests.tiny_pipelines import merged_round_trip, tiny_qwen25_vl

    tokenizer = tiny_qwen2_tokenizer(tmp_path / "tok")
    torch.manual_seed(0)
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=AutoencoderKLQwenImage(
            base_dim=4,
            z_dim=4,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
        ),
        text_encoder=tiny_qwen25_vl(len(tokenizer), TEXT_DIM),
        tokenizer=tokenizer,
        transformer=make_qwen(),
    )
    pipe.save_pretrained(tmp_path / "pipe")
    pipe = QwenImagePipeline.from_pretrained(tmp_path / "pipe", local_files_only=True)
    kw = dict(
        negative_prompt="blurry",
        true_cfg_scale=2.0,
        height=64,
        width=128,
        num_inference_steps=2,
        max_sequence_length=64,
        output_type="np",
    )

    def generate():
        return pipe("a red fox", generator=torch.Generator().manual_seed(0), **kw).images

    # 64x128 px -> 8x16 latent -> 4x8 tokens (2x2 patches), half kept; the conditional and
    # unconditional passes run apart
    merged_round_trip(pipe, generate, [(1, 16)] * 4, blocks={"transformer_blocks": range(3)})


def test_flux2_klein_pipeline_round_trip(tmp_path):
    # Flux2Pipeline's text encoder (Mistral 3 with a Pixtral processor) cannot be built
    # offline; FLUX.2 [klein]'s pipeline runs the same transformer with a Qwen3 encoder
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.tiny_pipelines import merged_round_trip, tiny_flux2_vae

    tokenizer = tiny_qwen2_tokenizer(tmp_path / "tok")
    torch.manual_seed(0)
    encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=128,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
            eos_token_id=None,
        )
    ).eval()
    vae = tiny_flux2_vae()
    # the pipeline stacks 3 of the encoder's hidden states: text width 3 x 16
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=encoder,
        tokenizer=tokenizer,
        transformer=make_flux2(text_dim=48),
    )
    pipe.save_pretrained(tmp_path / "pipe")
    pipe = Flux2KleinPipeline.from_pretrained(tmp_path / "pipe", local_files_only=True)
    kw = dict(
        height=32,
        width=64,
        num_inference_steps=2,
        max_sequence_length=32,
        text_encoder_out_layers=(0, 1, 2),
        output_type="np",
    )

    def generate():
        return pipe(prompt="a red fox", generator=torch.Generator().manual_seed(0), **kw).images

    # 32x64 px -> 16x32 latent (the tiny VAE halves) -> 8x16 tokens (2x2 patches), half kept
    merged_round_trip(pipe, generate, [(1, 64)] * 4, blocks=ALL_FLUX2["blocks"])


@pytest.mark.parametrize("arch", ["tiny-qwenimage", "tiny-flux2"])
def test_bench_runs_the_tiny_archs(arch, tmp_path, capsys, one_thread):
    import json

    from toma.tools.cli import main

    rc = main(
        [
            "bench",
            "--arch",
            arch,
            "--resolution",
            "64",
            "--batch",
            "2",
            "--ratios",
            "0.5",
            "--methods",
            "none,toma,ideal",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--no-profile",
            "--out",
            str(tmp_path),
            "--name",
            "b",
            "--no-progress",
        ]
    )
    assert rc == 0, capsys.readouterr().out
    report = json.loads((tmp_path / "b.json").read_text())
    assert {r["method"] for r in report["results"]} == {"none", "toma", "ideal"}
    assert report["blocks"] == (
        {"transformer_blocks": 2}
        if arch == "tiny-qwenimage"
        else {"transformer_blocks": 2, "single_transformer_blocks": 2}
    )


def test_full_size_configs_build_as_published():
    # the published widths, on the meta device (no memory)
    from toma.tools.archs import ARCHS, build_model, count_parameters

    qwen = build_model(ARCHS["qwenimage"], device="meta")
    flux2 = build_model(ARCHS["flux2"], device="meta")
    assert len(qwen.transformer_blocks) == 60 and qwen.inner_dim == 3072
    assert (len(flux2.transformer_blocks), len(flux2.single_transformer_blocks), flux2.inner_dim) == (8, 48, 6144)
    assert 20.0e9 < count_parameters(qwen) < 20.8e9  # "Qwen-Image, a 20B MMDiT"
    assert 31.5e9 < count_parameters(flux2) < 32.5e9  # "FLUX.2 [dev], 32B"


def test_flux2_reads_its_image_ids_once_per_run(monkeypatch):
    # reading ids waits for the GPU: a run that passes the same ids at every step reads them once
    from toma.adapters import grids

    reads = []
    real = grids.ids_grid
    monkeypatch.setattr(grids, "ids_grid", lambda ids: reads.append(ids) or real(ids))
    model = make_flux2()
    toma.apply_toma(model, ratio=0.5, **ALL_FLUX2)
    kw = flux2_inputs(1, 8, 8)
    for t in (0.9, 0.8, 0.7):
        run(model, **{**kw, "timestep": torch.full((1,), t)})
    assert len(reads) == 1
    other = make_flux2()  # another patched model keeps its own reader
    toma.apply_toma(other, ratio=0.5, **ALL_FLUX2)
    run(other, **kw)
    assert len(reads) == 2


def _permutation_matches_unpatched(make, kw, blocks, monkeypatch, tiled):
    """With every token its own destination (2x2 tiles keeping 4) and hard assignment,
    merging is a permutation: the output must equal the unpatched model's (in tile order,
    or raster order, as on the Triton path)."""
    if not tiled:
        monkeypatch.setattr(toma.adapters.state.PlanCache, "tile_order_layout", lambda self, grid, device=None: None)
    model = make()
    with torch.no_grad():
        ref = model(**kw).sample
        toma.apply_toma(model, ratio=0.05, tile_size=2, temperature=0, **blocks)
        torch.testing.assert_close(model(**kw).sample, ref, rtol=0, atol=1e-5)
        toma.remove_toma(model)
        toma.apply_toma(model, ratio=0.5, **blocks)
        merged = model(**kw).sample
        assert merged.shape == ref.shape and torch.isfinite(merged).all() and not torch.equal(merged, ref)


@pytest.mark.parametrize("tiled", [True, False], ids=["tile-order", "raster"])
def test_qwenimage_edit_reference_tokens_pass_whole(monkeypatch, tiled):
    # Qwen-Image-Edit appends the reference image's tokens to the generated image's and
    # lists both shapes per sample in img_shapes: the reference passes whole, like text
    kw = qwen_inputs(2, 4, 6)
    g = torch.Generator().manual_seed(7)
    kw = {
        **kw,
        "hidden_states": torch.cat([kw["hidden_states"], torch.randn(2, 8, 16, generator=g)], dim=1),
        "img_shapes": [[(1, 4, 6), (1, 2, 4)]] * 2,
    }
    _permutation_matches_unpatched(make_qwen, kw, {"blocks": {"transformer_blocks": (0, 1, 2)}}, monkeypatch, tiled)


@pytest.mark.parametrize("tiled", [True, False], ids=["tile-order", "raster"])
def test_flux2_reference_images_pass_whole(monkeypatch, tiled):
    # FLUX.2 appends reference images' tokens (ids with t = 10, 20, ...) to the generated image's
    kw = flux2_inputs(2, 4, 6)
    one = torch.arange(1)
    ref_ids = torch.cat(
        [
            torch.cartesian_prod(torch.tensor([10]), torch.arange(2), torch.arange(4), one),
            torch.cartesian_prod(torch.tensor([20]), torch.arange(2), torch.arange(2), one),
        ]
    )
    g = torch.Generator().manual_seed(7)
    kw = {
        **kw,
        "hidden_states": torch.cat([kw["hidden_states"], torch.randn(2, 12, 16, generator=g)], dim=1),
        "img_ids": torch.cat([kw["img_ids"], ref_ids[None].expand(2, -1, -1)], dim=1),
    }
    blocks = {"blocks": {"transformer_blocks": (0, 1), "single_transformer_blocks": (0, 1)}}
    _permutation_matches_unpatched(make_flux2, kw, blocks, monkeypatch, tiled)
