"""Proportional attention on diffusers' dispatched attention: one exact form per backend.

A merged call's key bias rides into the family's processor as its attention mask, as a
:class:`KeyBias` (the log masses, not a float mask). The processor passes it unchanged
to ``dispatch_attention_fn``, which :func:`install` wraps in the processor's module: the
wrapper resolves the backend (the processor's, or diffusers' active one) and runs the form
:data:`RULES` gives it (:mod:`toma.core.proportional`):

* ``"mask"``: the float mask ``(Bp, 1, 1, Sk)``, on backends that fuse an additive mask;
* ``"key_channel"``: one more q/k/v channel and the original softmax scale, on kernels that
  take no mask (flash): exact on any kernel that takes an explicit scale;
* ``"flex"``: FlexAttention with a ``score_mod`` (compiled: fused);
* None: no exact form (SageAttention quantizes K per block to int8, where the bias channel
  would set the scale; XLA's takes no scale). The call runs without the bias, said once.

Processors that dispatch but cannot carry a :class:`KeyBias` in their mask argument (LTX
reshapes it, Qwen-Image builds its own, JoyAI-Image-Edit passes None) get it past them:
:func:`through_dispatch` holds it for the call's one dispatch, which folds the processor's
own mask in.

A form that fails at run time (flex has no backward on CPU) falls back to the float mask
in torch's SDPA, said once. Under ``proportional_attention=None`` the bias runs in the
forms of :data:`AUTO_FORMS` only. Any other mask goes to diffusers untouched, so the
wrapper changes nothing outside merged calls. The CPU rules are measured
(``benchmarks/proportional_cost.py``, BENCHMARKS.md); the CUDA ones are assumptions until
a GPU measures them: with a float mask torch's SDPA leaves its flash kernel for the
memory-efficient one, and the key channel's head dim 136 runs flash's 160 kernel (about
+25%), which is taken to cost less.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, NamedTuple

import torch

from toma.adapters import _private
from toma.core import proportional as P

MASK, KEY_CHANNEL, FLEX = "mask", "key_channel", "flex"
FORMS = (MASK, KEY_CHANNEL, FLEX)
# the forms proportional_attention=None runs (on CPU, where toma.adapters.merging.AUTO_DEVICES
# puts it): measured at most 3% of a merged forward there (mask +0.18% / +0.32%, key
# channel +0.81% / +2.22% on Flux / Wan; flex +2.75% / +18.2%): BENCHMARKS.md
AUTO_FORMS = (MASK, KEY_CHANNEL)

_FLASH = (KEY_CHANNEL, "takes no mask; head dim 136 runs its 160 kernel")

# diffusers backend -> {device type (or "device dtype"), "*": the form}; first match of
# "<device> <dtype>", "<device>", "*". A name not here is off, with a warning.
RULES: dict[str, dict[str, tuple[str | None, str]]] = {
    # CPU: SDPA's CPU kernel fuses the mask (measured cheaper than the key channel);
    # CUDA: a float mask moves SDPA from flash to memory-efficient attention (assumed
    # dearer than flash at 160); fp32 never runs flash, so the mask
    "native": {
        "cpu": (MASK, "SDPA's CPU kernel fuses the mask"),
        "cuda": (KEY_CHANNEL, "keeps SDPA on flash (assumed, unmeasured)"),
        "cuda float32": (MASK, "fp32 SDPA runs no flash kernel: memory-efficient fuses the mask"),
        "*": (MASK, "SDPA takes a float mask"),
    },
    "_native_math": {"*": (MASK, "unfused either way")},
    "_native_efficient": {"*": (MASK, "fuses the mask")},
    "_native_cudnn": {"*": (MASK, "fuses the mask")},
    "_native_flash": {"*": _FLASH},
    "_native_npu": {"*": (KEY_CHANNEL, "its mask is boolean")},
    "_native_xla": {"*": (None, "takes no softmax scale, so the key channel's would follow its head dim")},
    "flex": {"*": (FLEX, "score_mod, fused when compiled")},
    "flash": {"*": _FLASH},
    "flash_hub": {"*": _FLASH},
    "flash_varlen": {"*": (KEY_CHANNEL, "its mask is a boolean key padding mask")},
    "flash_varlen_hub": {"*": (KEY_CHANNEL, "its mask is a boolean key padding mask")},
    "_flash_3": {"*": (KEY_CHANNEL, "takes no mask; head dim 136 runs a wider kernel")},
    "_flash_3_hub": {"*": (KEY_CHANNEL, "takes no mask; head dim 136 runs a wider kernel")},
    "_flash_varlen_3": {"*": (KEY_CHANNEL, "takes no mask; head dim 136 runs a wider kernel")},
    "_flash_3_varlen_hub": {"*": (KEY_CHANNEL, "takes no mask; head dim 136 runs a wider kernel")},
    "flash_4_hub": {"*": (KEY_CHANNEL, "takes no mask")},
    "aiter_fa2_hub": {"*": (KEY_CHANNEL, "takes no mask")},
    "xformers": {"*": (MASK, "fuses an additive bias (unmeasured)")},
}
_SAGE = (None, "quantizes K per block to int8, where the bias channel would set the scale; it takes no mask")


def rule(backend: str, device: torch.device | str, dtype: torch.dtype) -> tuple[str | None, str]:
    """The form of the key bias on ``backend`` for tensors on ``device`` in ``dtype``, and why.

    ``(None, why)`` where no form is exact.
    """
    if backend.startswith("sage") or backend.startswith("_sage"):
        return _SAGE
    table = RULES.get(backend)
    if table is None:
        return None, f"toma has no rule for the attention backend {backend!r}"
    kind = torch.device(device).type
    name = str(dtype).removeprefix("torch.")
    for key in (f"{kind} {name}", kind, "*"):
        if key in table:
            return table[key]
    return None, f"no rule for {backend!r} on {kind}"


class KeyBias(NamedTuple):
    """The key bias of a merged call, passed as the processor's attention mask.

    A named tuple, so that torch.compile can hand one made inside a graph from a hook's
    frame to the processor's (it cannot rebuild a dataclass made in the graph).

    Attributes:
        log_mass: ``(Bp, S)`` over the call's first keys (0 for text, ``-inf`` for keys the
            model masks out), ``Bp`` 1 or the batch.
        pad_after: the call's keys after those ``S`` are unmerged (text after the image
            tokens, as in HunyuanVideo): log mass 0.
        pad_before: the call's keys before those ``S`` are unmerged, however many there
            are (Qwen-Image 2.1's cached prefix keys, which the processor puts before the
            tokens' own): log mass 0.
        model_mask: the model's own mask folded into ``log_mass`` (:meth:`with_model_mask`),
            which a call without the bias still takes.
        auto: the bias was not asked for (``proportional_attention=None``): it runs only in
            the forms of :data:`AUTO_FORMS`, and silently not in another.
        per_query: ``model_mask`` has a row per query (``(B, 1, Sq, S)``, as Chroma's), so it
            is not folded into ``log_mass``: the ``"mask"`` form adds the two, and the forms
            that take only a bias per key have no exact form for it.
        dense: where set, the float masks of this bias (:meth:`mask`) by dtype and key count,
            built once and shared by every call that hands in the same dict: the merged
            blocks of one plan on one model mask (a per-query mask is a pass over ``Sq x S``
            and as large, in every merged block otherwise).
    """

    log_mass: torch.Tensor
    pad_after: bool = False
    model_mask: torch.Tensor | None = None
    auto: bool = False
    per_query: bool = False
    pad_before: bool = False
    dense: dict | None = None

    def automatic(self) -> KeyBias:
        """This bias, applied only where its form is one of :data:`AUTO_FORMS`."""
        return self._replace(auto=True)

    def over(self, keys: int) -> torch.Tensor:
        """The log masses over a call's ``keys`` keys, ``(Bp, keys)``."""
        have = self.log_mass.shape[1]
        if have == keys:
            return self.log_mass
        if have > keys or not (self.pad_after or self.pad_before):
            raise ValueError(f"ToMA: a key bias over {have} keys met an attention call over {keys} keys")
        if self.pad_before:
            return P.with_text_keys(self.log_mass, before=keys - have)
        return P.with_text_keys(self.log_mass, after=keys - have)

    def mask(self, dtype: torch.dtype | None = None, keys: int | None = None) -> torch.Tensor:
        """As a float attention mask: ``(Bp, 1, 1, keys)``, or with a per-query model mask
        added, ``(B, 1, Sq, keys)``."""
        bias = P.additive_mask(self.log_mass if keys is None else self.over(keys), dtype)
        if not self.per_query:
            return bias
        if self.dense is not None:
            known = self.dense.get((bias.dtype, bias.shape[-1]))
            if known is None:
                known = self.dense[(bias.dtype, bias.shape[-1])] = self._per_query(bias)
            return known
        return self._per_query(bias)

    def _per_query(self, bias: torch.Tensor) -> torch.Tensor:
        own = self.model_mask
        if own.dtype == torch.bool:  # True keeps a key: one pass over the (B, 1, Sq, Sk) mask, not four
            return torch.where(own, bias, float("-inf"))
        return bias + own.to(bias.dtype)

    def with_model_mask(self, mask: torch.Tensor) -> KeyBias:
        """This bias and the model's own mask over the same ``S`` keys (bool: True keeps a
        key; or additive), in one bias.

        A key mask (``(B, S)``, ``(B, 1, S)``, ``(B, 1, 1, S)``: one row for every query, as
        diffusers' dispatch reads them) folds into the log masses. A ``(B, 1, Sq, S)`` mask
        with a row per query stays beside them (``per_query``)."""
        if mask.ndim == 4 and mask.shape[1] == 1 and mask.shape[2] > 1:
            self.over(mask.shape[-1])  # the same keys, or toma's bug: raised
            return self._replace(model_mask=mask, per_query=True)
        if not (mask.ndim == 2 or (mask.ndim in (3, 4) and mask.shape[1:-1] == (1,) * (mask.ndim - 2))):
            raise ValueError(
                f"ToMA: cannot fold an attention mask of shape {tuple(mask.shape)} into the key bias; "
                "key masks (B, S), (B, 1, S), (B, 1, 1, S) and per-query masks (B, 1, Sq, S) fold"
            )
        rows = mask.reshape(mask.shape[0], mask.shape[-1])
        log_mass = self.over(rows.shape[1])
        folded = P.masked_out(log_mass, rows) if rows.dtype == torch.bool else log_mass + rows.to(log_mass.dtype)
        return KeyBias(folded, model_mask=mask, auto=self.auto)

    def batch_slice(self, b: int, batch: int) -> KeyBias:
        """Sample ``b``'s bias, for a call on that sample alone."""

        def one(t: torch.Tensor | None) -> torch.Tensor | None:
            return t[b : b + 1] if t is not None and t.shape[0] == batch else t

        return self._replace(log_mass=one(self.log_mass), model_mask=one(self.model_mask), dense=None)


def key_bias(log_mass: torch.Tensor, batch: int, heads: int) -> KeyBias:
    """A bias ``form`` (:class:`~toma.adapters.layouts.InMask`) for processors that hand
    their mask to diffusers' dispatch: the log masses as a :class:`KeyBias` (:func:`install`
    applies it)."""
    return KeyBias(log_mass)


def key_bias_text_after(log_mass: torch.Tensor, batch: int, heads: int) -> KeyBias:
    """:func:`key_bias` for calls whose text keys follow the image keys (HunyuanVideo)."""
    return KeyBias(log_mass, pad_after=True)


def key_bias_prefix(log_mass: torch.Tensor, batch: int, heads: int) -> KeyBias:
    """:func:`key_bias` for calls whose processor puts unmerged keys of its own before the
    merged ones, as many as it has (Qwen-Image 2.1's cached prefix)."""
    return KeyBias(log_mass, pad_before=True)


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=4)


def _backend_name(backend: Any) -> str:
    if backend is None:
        backend = _private.active_backend()
    return getattr(backend, "value", backend)


_compiled_flex: Callable | None = None


def _flex() -> Callable:
    """torch's flex_attention inside a compiled region (it fuses there), else a compiled one."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():
        return flex_attention
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


# dispatch_attention_fn's positional parameters
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa", "attention_kwargs")
_MASK_SLOT = _NAMES.index("attn_mask")


# the keyword in which a merged call carries its key bias to a site's :class:`~toma.adapters.layouts.ViaCall`
BIAS_KWARG = "_toma_key_bias"
# the key bias of the merged call under way whose processor passes no mask of toma's to
# dispatch (:func:`through_dispatch`), as ``_pending.bias``: set for that call only, and
# thread-local, because two patched models called from two threads at once took each
# other's bias from the module-level list this once was (tests/adapters/test_threads.py).
# Not a ContextVar: Dynamo breaks the graph at ContextVar.get, and traces a thread-local's
# attributes (a forward never yields to another asyncio task mid-call, so the thread is
# the unit that can interleave).
_pending = threading.local()


def through_dispatch(forward: Callable, hook: Any, *args: Any, **kwargs: Any) -> Any:
    """A :class:`~toma.adapters.layouts.ViaCall` strategy for processors that call diffusers' dispatch but cannot carry
    a :class:`KeyBias` in their mask argument (LTX reshapes its mask per head, Qwen-Image
    builds its own): the bias waits, in this thread's state, for the call's
    one dispatch, which :func:`biased_dispatch` applies it to, with the processor's own
    mask folded in."""
    bias = kwargs.pop(BIAS_KWARG, None)
    if bias is None:
        return forward(*args, **kwargs)
    outer = getattr(_pending, "bias", None)
    _pending.bias = bias
    try:
        return forward(*args, **kwargs)
    finally:
        _pending.bias = outer


def dispatch_ok(module: torch.nn.Module) -> str | None:
    """A bias route's ``ok`` for :func:`through_dispatch` sites: why the module's current processor
    would not apply a pending bias (its module's dispatch is not toma's wrapper: a processor
    set after ``apply_toma``), or None."""
    processor = getattr(module, "processor", None)
    current = getattr(sys.modules.get(_home(processor)), _private.DISPATCH_FN, None)
    if getattr(current, "_toma_real", None) is None:
        return (
            f"its processor {type(processor).__name__} is called from a module whose dispatch toma did not "
            "wrap at apply_toma"
        )
    return None


def _home(processor: Any) -> str:
    """The module whose ``dispatch_attention_fn`` the processor's call looks up: where its
    class's ``__call__`` is defined (a subclass may inherit diffusers')."""
    call = getattr(type(processor), "__call__", None)
    return getattr(call, "__module__", None) or type(processor).__module__


def biased_dispatch(real: Callable) -> Callable:
    """``real`` (diffusers' ``dispatch_attention_fn``), applying a :class:`KeyBias` mask (or
    the pending one of :func:`through_dispatch`) by the backend's rule and passing every
    other call through."""

    @functools.wraps(real)
    def dispatch(*args: Any, **kwargs: Any) -> torch.Tensor:
        bias = args[_MASK_SLOT] if len(args) > _MASK_SLOT else kwargs.get("attn_mask")
        if not isinstance(bias, KeyBias):
            pending = getattr(_pending, "bias", None)
            if pending is None:
                return real(*args, **kwargs)
            own, bias = bias, pending
            if own is not None:  # the processor's own mask over the same keys
                bias = bias.with_model_mask(own)
        kwargs = {**dict(zip(_NAMES, args)), **kwargs}  # by name, so that the mask and scale can be replaced
        query, key, value = kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value")
        del kwargs["attn_mask"]
        return attend(real, bias, query, key, value, **kwargs)

    dispatch._toma_real = real  # type: ignore[attr-defined]
    return dispatch


def attend(
    real: Callable, bias: KeyBias, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """Dispatched attention over ``(B, S, H, D)`` tensors with ``bias`` in the backend's form."""
    name = _backend_name(kwargs.get("backend"))
    form, why = rule(name, query.device, query.dtype)
    if kwargs.get("parallel_config") is not None and form is not None:
        # context parallel: keys (and their channel) travel between ranks, a mask does not
        form = KEY_CHANNEL
    if bias.auto and form not in AUTO_FORMS:  # not asked for, and dearer than measured cheap
        return real(query, key, value, attn_mask=bias.model_mask, **kwargs)
    if form is None:
        _warn_once(
            name,
            f"ToMA: proportional attention is off on the {name!r} attention backend: {why}; "
            "merged attention runs without the log-mass bias",
        )
        return real(query, key, value, attn_mask=bias.model_mask, **kwargs)
    if bias.per_query and form != MASK:
        # a bias per key cannot carry a mask whose rows differ by query
        if not bias.auto:
            _warn_once(
                f"{name}:{form}:per_query",
                f"ToMA: proportional attention is off where the model's attention mask has a row per query "
                f"(as Chroma's) on the {name!r} backend, whose form ({form}) carries a bias per key only; "
                "those merged calls run without the log-mass bias",
            )
        return real(query, key, value, attn_mask=bias.model_mask, **kwargs)
    scale = kwargs.pop("scale", None)
    log_mass = bias.over(key.shape[1])  # a mismatch is toma's bug: raised, not fallen back from
    try:
        if form == MASK:
            return real(query, key, value, attn_mask=bias.mask(query.dtype, key.shape[1]), scale=scale, **kwargs)
        if form == KEY_CHANNEL:
            q, k, v, wide_scale = P.key_channel(query, key, value, log_mass, scale, layout="bshd")
            return P.drop_key_channel(real(q, k, v, scale=wide_scale, **kwargs), value.shape[-1])
        return P.flex_attention_with_bias(query, key, value, log_mass, scale, "bshd", _flex())
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as err:
        if torch.compiler.is_compiling():
            raise
        detail = str(err).splitlines()[0] if str(err) else ""
        if form != MASK and not kwargs.get("parallel_config") and not kwargs.get("enable_gqa"):
            # e.g. flex, which has no backward on CPU: torch's SDPA with the float mask is
            # the same maths on any device
            _warn_once(
                f"{name}:{form}",
                f"ToMA: proportional attention's {form} failed on the {name!r} backend "
                f"({type(err).__name__}: {detail}); those calls take the bias as a float mask "
                "in torch's SDPA",
            )
            mask = bias.mask(query.dtype, key.shape[1])
            return _sdpa_with_mask(query, key, value, mask, scale, kwargs.get("dropout_p", 0.0))
        _warn_once(
            f"{name}:{form}",
            f"ToMA: proportional attention's {form} failed on the {name!r} backend "
            f"({type(err).__name__}: {detail}); merged attention runs without the "
            "log-mass bias there",
        )
        return real(query, key, value, attn_mask=bias.model_mask, scale=scale, **kwargs)


def _sdpa_with_mask(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: Any, dropout: float
) -> torch.Tensor:
    """Attention over ``(B, S, H, D)`` tensors with a float mask (:meth:`KeyBias.mask`), in torch's SDPA."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out.transpose(1, 2)


# module name -> the attention modules of live patches whose processors call its dispatch
_users: dict[str, weakref.WeakSet] = {}


def install(module_name: str, users: list[torch.nn.Module]) -> bool:
    """Wrap ``dispatch_attention_fn`` in the module ``module_name`` (a processor's) for the
    attention modules ``users``. Wraps once: again only if something replaced the wrapper
    since (a patch never removed leaves it, harmlessly: other calls pass through). False if
    the module calls no such function."""
    module = sys.modules.get(module_name)
    current = getattr(module, _private.DISPATCH_FN, None) if module is not None else None
    if current is None:
        return False
    if getattr(current, "_toma_real", None) is None:
        setattr(module, _private.DISPATCH_FN, biased_dispatch(current))
    _users.setdefault(module_name, weakref.WeakSet()).update(users)
    return True


def uninstall(module_name: str, users: list[torch.nn.Module]) -> None:
    """Drop ``users``; once no attention module of a live patch needs the wrapper, put the
    module's own function back (if the wrapper is still the one there)."""
    left = _users.get(module_name)
    if left is None:
        return
    for user in users:
        left.discard(user)
    if len(left):
        return
    del _users[module_name]
    module = sys.modules.get(module_name)
    current = getattr(module, _private.DISPATCH_FN, None) if module is not None else None
    real = getattr(current, "_toma_real", None)
    if real is not None:
        setattr(module, _private.DISPATCH_FN, real)


_DISPATCHED = (key_bias, key_bias_text_after, key_bias_prefix)


def dispatch_modules(targets: list) -> dict[str, list[torch.nn.Module]]:
    """The modules of the processors that receive a :class:`KeyBias` among ``targets``
    (the engine's :class:`~toma.adapters.base.Patched`), read from the live processors,
    each with the attention modules whose processors they are."""
    found: dict[str, list[torch.nn.Module]] = {}
    for target in targets:
        site = target.site
        bias = None if site is None else site.bias
        if bias is None or (bias.form not in _DISPATCHED and getattr(bias, "call", None) is not through_dispatch):
            continue
        module = target.module.get_submodule(site.span.call) if site.span is not None else target.module
        processor = getattr(module, "processor", None)
        if processor is not None:
            found.setdefault(_home(processor), []).append(module)
    return found
