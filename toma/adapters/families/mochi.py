"""Mochi 1 (``MochiTransformer3DModel``): asymmetric joint attention over [video; text], with 3-D rotary on the video.

Each ``MochiTransformerBlock`` merges the video stream of its joint attention and, with
``merge_mlp``, its video MLP (``ff``; the text has its own, narrower stream and MLP, which
pass whole). Its rotary tables (one ``(N, heads, D/2)`` table for the batch, from ``rope``)
follow the tokens into tile order and are gathered to the merged tokens' destinations; as
the processor applies one table to the whole batch, samples with plans of their own run
one merged attention call each. The processor drops each sample's text padding itself,
from the text mask (``encoder_attention_mask``, ``(B, text)``, over the text alone): a
merged call passes it as it is, and the sample's keys are its merged video tokens, then
its valid text tokens. Tiles span ``tile_frames`` latent frames (1 by default). The
pipeline's timestep rises over a run (``1000 - t`` is the usual one): the engine reads it
negated. The processor calls torch's SDPA itself, without a mask: while toma is applied,
each merged attention's processor is wrapped in one that is the processor's own call, or,
given the key bias (proportional attention), toma's equal of it with the bias on the
merged video keys and log mass 0 on the valid text keys after them (the padding masked out).
Its rotary frequencies are a parameter: under gradient checkpointing, a training forward
with them trainable runs unmerged, with a warning once (see :func:`_grid`).
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import InMask
from toma.adapters.attention import BIAS_KWARG, attend, key_bias_text_after
from toma.adapters.spec import FamilySpec, Grid, Quirks, RopeModule, Rotary, Site, skip_first

_STOCK = "MochiAttnProcessor2_0"

# one (N, heads, D/2) table for the whole batch, in tile order (rope)
_ROTARY = Rotary("image_rotary_emb", None, shared=True)


class BiasedProcessor:
    """Stands in for a merged attention's ``MochiAttnProcessor2_0`` while toma is applied: a
    call without a key bias is that processor's own; a call with one (keyword
    :data:`~toma.adapters.attention.BIAS_KWARG`) runs :func:`joint_attention`."""

    def __init__(self, processor: object) -> None:
        self.processor = processor

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        _toma_key_bias: object = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The processor's call (its parameters are what ``MochiAttention`` passes on)."""
        if _toma_key_bias is None:
            return self.processor(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        return joint_attention(
            attn, _toma_key_bias, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb
        )


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.unflatten(2, (heads, -1))  # (B, S, H, D)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The processor's rotation of interleaved channel pairs, in float32."""
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack([(even * cos - odd * sin).to(x.dtype), (even * sin + odd * cos).to(x.dtype)], dim=-1).flatten(-2)


def joint_attention(
    attn: torch.nn.Module,
    bias: object,
    hidden_states: torch.Tensor,
    context: torch.Tensor,
    text_mask: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``MochiAttnProcessor2_0`` computes, with ``bias`` on the merged video keys of each
    sample's ``[video; valid text]`` attention (by the native backend's rule).

    That processor calls torch's SDPA once per sample on its valid text tokens (found with
    ``nonzero``, a graph break under torch.compile), without a mask, and writes the valid
    text tokens' outputs first, then zeros. Here one call takes every text token, the
    padding masked out of the keys (folded into the bias: exp(-inf) adds nothing), and the
    text outputs are put in the processor's order with a stable sort, the rows past each
    sample's count zeroed: the same maths in shapes that do not depend on the mask."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    q, k, v = (_heads(proj(hidden_states), attn.heads) for proj in (attn.to_q, attn.to_k, attn.to_v))
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    cq, ck, cv = (_heads(proj(context), attn.heads) for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
    if attn.norm_added_q is not None:
        cq = attn.norm_added_q(cq)
    if attn.norm_added_k is not None:
        ck = attn.norm_added_k(ck)
    if rotary is not None:
        q, k = _rotate(q, *rotary), _rotate(k, *rotary)
    video, text = q.shape[1], cq.shape[1]
    valid = text_mask.to(device=q.device) != 0  # (B, text)
    bias = bias.with_model_mask(torch.cat([valid.new_ones(valid.shape[0], video), valid], dim=1))
    q, k, v = torch.cat([q, cq], dim=1), torch.cat([k, ck], dim=1), torch.cat([v, cv], dim=1)
    native = AttentionBackendName.NATIVE  # torch's SDPA, as that processor's, whatever backend is set
    out = attend(dispatch_attention_fn, bias, q, k, v, dropout_p=0.0, is_causal=False, backend=native)
    image_out, text_out = out.split_with_sizes((video, text), dim=1)
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # valid tokens first, in order
    text_out = text_out.gather(1, order[:, :, None, None].expand_as(text_out))
    counted = torch.arange(text, device=q.device) < valid.sum(dim=1, keepdim=True)
    text_out = text_out * counted[:, :, None, None].to(text_out.dtype)
    image_out = attn.to_out[1](attn.to_out[0](image_out.flatten(2, 3)))
    text_out = text_out.flatten(2, 3)
    if hasattr(attn, "to_add_out"):
        text_out = attn.to_add_out(text_out)
    return image_out, text_out


def _mask_ok(attn: torch.nn.Module) -> str | None:
    if not isinstance(attn.processor, BiasedProcessor):
        name = type(attn.processor).__name__
        return f"toma applies the key bias in place of {_STOCK} only; this module's processor is {name}"
    return None


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    # the text mask (attention_mask) is over the text alone, which the merged call keeps
    # whole: it passes as it is; the text keys follow the merged video keys
    attn = Site("attn1", "attn", rotary=_ROTARY, bias=InMask((BIAS_KWARG, None), key_bias_text_after, ok=_mask_ok))
    return [attn, Site("ff", "mlp")]


def _grid(model: torch.nn.Module, call: dict) -> Grid | str | None:
    if torch.is_grad_enabled() and model.gradient_checkpointing and model.pos_frequencies.requires_grad:
        return (
            "under gradient checkpointing with trainable rotary frequencies (pos_frequencies), a merged block's "
            "recomputation would not gather its rotary rows again (one gather serves every block of a forward), "
            "so backward would fail; freeze pos_frequencies (as LoRA training does) to merge"
        )
    video = call.get("hidden_states")  # (B, C, F, H, W), patched frame by frame
    if video is None or video.ndim != 5:
        return None
    p = model.config.patch_size
    return (video.shape[2], video.shape[3] // p, video.shape[4] // p)


def _falling_timestep(call: dict) -> torch.Tensor | None:
    """Mochi's pipeline passes ``t`` rising over a run (its scheduler inverts the sigmas);
    the engine counts steps by a falling timestep, so it gets ``-t``."""
    t = call.get("timestep")
    return None if t is None else -t


class _Quirks(Quirks):
    """The merged attentions' processors stand in for Mochi's own, to take the key bias."""

    def attach(self, model: torch.nn.Module, targets: list, cache: object, ledger: object) -> list[torch.nn.Module]:
        """Puts a :class:`BiasedProcessor` around each merged attention's stock processor
        (recorded in ``ledger``, whose undo puts the processor back); hooks nothing."""
        for target in targets:
            attn = target.module
            if target.site.part == "attn" and type(attn.processor).__name__ == _STOCK:
                ledger.set_attr(attn, "processor", BiasedProcessor(attn.processor))
        return []


SPEC = FamilySpec(
    name="mochi",
    classes=("MochiTransformer3DModel",),
    stacks=("transformer_blocks",),
    sites=_sites,
    grid=_grid,
    # the patch embedding runs frame by frame ((B * F, hw, C)): the first block's input is
    # where the (B, N, C) video tokens enter
    enter=("block", ""),
    leave="norm_out",
    tables=(RopeModule("rope", 0),),
    timestep=_falling_timestep,
    default_blocks=skip_first(5),
    video=True,
    reference=(30, 53),  # 480x848
)

QUIRKS = _Quirks()
