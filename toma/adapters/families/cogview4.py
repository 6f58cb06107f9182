"""CogView4 (``CogView4Transformer2DModel``): joint attention over [text; image], with rotary on the image part.

Each ``CogView4TransformerBlock`` merges the image stream of its joint attention: the text
stream passes whole and leads the joint sequence, and the rotary tables (one ``(N, D)``
table for the batch, which the model makes or its caller passes to every block) are put in
the blocks' order at each block's call and gathered to the merged tokens' destinations;
as the processor applies one table to the whole batch, samples with plans of their own run
one merged attention call each. The size conditioning (``original_size``, ``target_size``,
``crop_coords``) only shifts the timestep embedding, the same for every token, so it
places nothing. A text padding mask (the forward's ``attention_mask``, ``(B, text)``) is
over the text alone, which the merged call keeps: it passes as it is. The block's MLP is
one module that runs on the image, then on the text: a site cannot tell its two calls
apart, so it stays unmerged (``merge_mlp=True`` is refused). The processor calls torch's
SDPA with a mask it builds and takes no other: while toma is applied, each merged
attention's processor is wrapped in one that is the processor's own call, or, given the key
bias (proportional attention), toma's equal of it with the bias on the keys and the text
padding folded in. Calls with packed per-sample rotary tables or the training processor's
masks (``attention_kwargs``) run unmerged, with a warning once.
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import InMask
from toma.adapters.attention import BIAS_KWARG, attend, key_bias
from toma.adapters.spec import BlockRope, FamilySpec, Grid, Quirks, Rotary, Site, image_grid, skip_first

_STOCK = "CogView4AttnProcessor"
# what CogView4TrainingAttnProcessor takes through attention_kwargs: masks over the unmerged
# latents, and packing of samples into one sequence
_TRAINING = ("latent_attn_mask", "text_attn_mask", "batch_flag")

# one (N, D) table for the whole batch, in the blocks' order (block_rope)
_ROTARY = Rotary("image_rotary_emb", None, shared=True)


class BiasedProcessor:
    """Stands in for a merged attention's ``CogView4AttnProcessor`` while toma is applied:
    a call without a key bias is that processor's own; a call with one (keyword
    :data:`~toma.adapters.attention.BIAS_KWARG`) runs :func:`joint_attention`."""

    def __init__(self, processor: object) -> None:
        self.processor = processor

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        _toma_key_bias: object = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The processor's call (its parameters are what diffusers' ``Attention`` passes on)."""
        if _toma_key_bias is None:
            return self.processor(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        return joint_attention(
            attn, _toma_key_bias, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb
        )


def joint_attention(
    attn: torch.nn.Module,
    bias: object,
    hidden_states: torch.Tensor,
    context: torch.Tensor,
    text_mask: torch.Tensor | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``CogView4AttnProcessor`` computes, with ``bias`` on the keys of its joint
    ``[text; image]`` attention (by the native backend's rule) and the text padding mask
    folded into it: that processor calls torch's SDPA with a mask of its own."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn
    from diffusers.models.embeddings import apply_rotary_emb

    text = context.shape[1]
    joint = torch.cat([context, hidden_states], dim=1)
    q, k, v = (proj(joint).unflatten(2, (attn.heads, -1)).transpose(1, 2) for proj in (attn.to_q, attn.to_k, attn.to_v))
    if attn.norm_q is not None:
        q = attn.norm_q(q).to(dtype=context.dtype)
    if attn.norm_k is not None:
        k = attn.norm_k(k).to(dtype=context.dtype)
    if rotary is not None:  # on the image's rows only, as the processor
        q = torch.cat([q[:, :, :text], apply_rotary_emb(q[:, :, text:], rotary, use_real_unbind_dim=-2)], dim=2)
        k = torch.cat([k[:, :, :text], apply_rotary_emb(k[:, :, text:], rotary, use_real_unbind_dim=-2)], dim=2)
    if text_mask is not None:
        # the processor keeps a key where the text mask does (the image's always); its rows
        # of padded text queries see no key, which no image token reads back
        keep = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device)
        keep[:, :text] = text_mask.to(device=q.device) > 0
        bias = bias.with_model_mask(keep)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, S, H, D), dispatch's layout
    # torch's SDPA, as that processor's, whatever backend is set: it follows none
    native = AttentionBackendName.NATIVE
    out = attend(dispatch_attention_fn, bias, q, k, v, dropout_p=0.0, is_causal=False, backend=native)
    out = attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(q)))
    return out[:, text:], out[:, :text]


def _mask_ok(attn: torch.nn.Module) -> str | None:
    if not isinstance(attn.processor, BiasedProcessor):
        name = type(attn.processor).__name__
        return f"toma applies the key bias in place of {_STOCK} only; this module's processor is {name}"
    return None


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    # the text padding mask (attention_mask) is over the text alone, which the merged call
    # keeps whole: it passes as it is
    return [
        Site(
            "attn1",
            "attn",
            rotary=_ROTARY,
            bias=InMask((BIAS_KWARG, None), key_bias, ok=_mask_ok, keys="encoder_hidden_states"),
        )
    ]


class _Quirks(Quirks):
    """The merged attentions' processors stand in for CogView4's own, to take the key bias."""

    def attach(self, model: torch.nn.Module, targets: list, cache: object, ledger: object) -> list[torch.nn.Module]:
        """Puts a :class:`BiasedProcessor` around each merged attention's stock processor
        (recorded in ``ledger``, whose undo puts the processor back); hooks nothing."""
        for target in targets:
            attn = target.module
            if type(attn.processor).__name__ == _STOCK:
                ledger.set_attr(attn, "processor", BiasedProcessor(attn.processor))
        return []


def _grid(model: torch.nn.Module, call: dict) -> Grid | str | None:
    if isinstance(call.get("image_rotary_emb"), list):
        return "a call with one rotary table per packed sample (a list of image_rotary_emb) does not merge"
    training = sorted(set(call.get("attention_kwargs") or {}) & set(_TRAINING))
    if training:
        return f"a call with the training processor's {', '.join(training)} (over the unmerged latents) does not merge"
    return image_grid(model, call)


SPEC = FamilySpec(
    name="cogview4",
    classes=("CogView4Transformer2DModel",),
    stacks=("transformer_blocks",),
    sites=_sites,
    grid=_grid,
    # the patch embedding returns (image, text): the first block's input is where the image tokens enter
    enter=("block", ""),
    leave="norm_out",
    # every block takes the tables as image_rotary_emb, 4th positionally (as the forward passes them)
    tables=(BlockRope("image_rotary_emb", 3, 0),),
    default_blocks=skip_first(5),
    reference=(64, 64),  # 1024px
)

QUIRKS = _Quirks()
