"""SD3 / SD3.5 (``SD3Transformer2DModel``): joint attention over [image; text], no rotary.

Each ``JointTransformerBlock`` merges the image stream of its joint attention (the text
stream passes whole) and, on SD3.5, of its image-only second attention; the MLP merges
with ``merge_mlp``. Its processor calls torch's SDPA without a mask, so under proportional
attention a merged call runs toma's equal of it, with the key bias on the keys. Positions
are a learned embedding added at the patch embedding, so tokens are free to move from
there to the final norm.
"""

from __future__ import annotations

import torch

from toma.adapters.layouts import ViaCall
from toma.adapters.attention import BIAS_KWARG, attend, key_bias, key_bias_text_after
from toma.adapters.spec import FamilySpec, Site, image_grid, skip_first, tile_order_unless

_STOCK, _FUSED = "JointAttnProcessor2_0", "FusedJointAttnProcessor2_0"


def _mask_ok(attn: torch.nn.Module) -> str | None:
    name = type(attn.processor).__name__
    if name not in (_STOCK, _FUSED):
        return f"toma applies the key bias in place of {_STOCK} and {_FUSED} only; this module's processor is {name}"
    return None


def _projections(attn: torch.nn.Module, x: torch.Tensor, context: bool) -> tuple[torch.Tensor, ...]:
    """q, k, v of the image (or, with ``context``, the text) stream, and whether the
    processor normalizes them: diffusers' fused processor (``fuse_qkv_projections``) does not."""
    if type(attn.processor).__name__ == _FUSED:
        qkv = (attn.to_added_qkv if context else attn.to_qkv)(x)
        return (*qkv.chunk(3, dim=-1), False)
    if context:
        return attn.add_q_proj(x), attn.add_k_proj(x), attn.add_v_proj(x), True
    return attn.to_q(x), attn.to_k(x), attn.to_v(x), True


def _heads(attn: torch.nn.Module, x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.view(x.shape[0], -1, attn.heads, head_dim)  # (B, S, H, D), dispatch's layout


def _joint_attention(attn: torch.nn.Module, bias: object, hidden_states: torch.Tensor, context: torch.Tensor | None):
    """What SD3's ``JointAttnProcessor2_0`` (or its fused variant) computes, with ``bias`` on the keys of its joint
    ``[image; text]`` attention (by the native backend's rule): that processor calls torch's
    SDPA without a mask."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    *qkv, norms = _projections(attn, hidden_states, False)
    head_dim = qkv[1].shape[-1] // attn.heads
    q, k, v = (_heads(attn, t, head_dim) for t in qkv)
    if norms and attn.norm_q is not None:
        q = attn.norm_q(q)
    if norms and attn.norm_k is not None:
        k = attn.norm_k(k)
    image = hidden_states.shape[1]
    if context is not None:
        *qkv, norms = _projections(attn, context, True)
        cq, ck, cv = (_heads(attn, t, head_dim) for t in qkv)
        if norms and attn.norm_added_q is not None:
            cq = attn.norm_added_q(cq)
        if norms and attn.norm_added_k is not None:
            ck = attn.norm_added_k(ck)
        q, k, v = torch.cat([q, cq], dim=1), torch.cat([k, ck], dim=1), torch.cat([v, cv], dim=1)
    # torch's SDPA, as that processor's, whatever backend is set: it follows none
    native = AttentionBackendName.NATIVE
    out = attend(dispatch_attention_fn, bias, q, k, v, dropout_p=0.0, is_causal=False, backend=native)
    out = out.flatten(2, 3).to(q.dtype)
    image_out = attn.to_out[1](attn.to_out[0](out[:, :image]))
    if context is None:
        return image_out
    text_out = out[:, image:]
    return image_out, text_out if attn.context_pre_only else attn.to_add_out(text_out)


def _with_bias(forward, hook, *args, **kwargs):
    """SD3's bias route (a :class:`~toma.adapters.layouts.ViaCall`): a merged call with a key
    bias runs :func:`_joint_attention`."""
    bias = kwargs.pop(BIAS_KWARG, None)
    if bias is None:
        return forward(*args, **kwargs)
    hidden_states = args[0] if args else kwargs["hidden_states"]
    context = args[1] if len(args) > 1 else kwargs.get("encoder_hidden_states")
    return _joint_attention(hook.module, bias, hidden_states, context)


def _sites(stack: str, block: torch.nn.Module) -> list[Site]:
    sites = [Site("attn", "attn", bias=ViaCall(_with_bias, key_bias_text_after, ok=_mask_ok))]
    if getattr(block, "attn2", None) is not None:  # SD3.5: image-only self-attention
        sites.append(Site("attn2", "attn", bias=ViaCall(_with_bias, key_bias, ok=_mask_ok)))
    if getattr(block, "ff", None) is not None:
        sites.append(Site("ff", "mlp"))
    return sites


SPEC = FamilySpec(
    name="sd3",
    classes=("SD3Transformer2DModel",),
    stacks=("transformer_blocks",),
    sites=_sites,
    grid=image_grid,
    enter=("output", "pos_embed"),
    leave="norm_out",
    tile_order_ok=tile_order_unless("block_controlnet_hidden_states"),
    default_blocks=skip_first(5),
    reference=(64, 64),  # 1024px
)
