"""ToMA on a denoiser whose ``forward`` someone replaces after :func:`toma.apply_toma`.

toma's hook on the denoiser itself (the step hook: token grid, timestep, tile order; the
UNet's equivalent) is a diffusers hook, and diffusers hooks live in the module's
``forward`` attribute. Code that assigns ``forward`` afterwards drops it, and the model then
runs unmerged although every merge hook inside it stays in place. cache-dit does this:
``cache_dit.enable_cache`` replaces the transformer's forward outright with its own copy
for some families (its "patch functors": Flux.1, Chroma, HiDream, HunyuanDiT, ...) before
wrapping it; in the other order (cache first, then ToMA) toma's hook wraps cache-dit's
forward and all is well.

:class:`ForwardGuard`, a torch forward pre-hook on the denoiser (torch's hooks run whatever
``forward`` the module has), follows the chain of forwards from the module's current one.
When toma's hook is no longer on it, the guard runs the hook itself; toma's hook then
passes through in any call the guard took, so that it never runs twice. Wrappers that keep
the forward they wrap where it can be found (diffusers' hook registry, cache-dit's cached
forward, accelerate's offload hooks) are followed; anything else counts as a replacement.
The guard's verdict is kept per forward object: a call costs one identity check.

On removal, diffusers' registry would put the forward it once wrapped back in place,
over the replacement: :func:`toma.adapters.base.remove_hook` keeps a foreign forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from toma.adapters import _private
from toma.adapters.base import HOOK_NAME, registry_ref

__all__ = ["ForwardGuard", "guard", "reaches", "unlink"]

# the wrappers that keep what they wrap on the module (cache-dit's, accelerate's)
_KEEPS_WRAPPED = _private.KEEPS_WRAPPED
_MAX_LINKS = 64  # a chain longer than this is taken to be a cycle: not reached


def reaches(module: torch.nn.Module, forward: Any, target: Any) -> bool:
    """Whether calling ``forward`` (the module's forward attribute, or None for its class's)
    runs the diffusers hook whose function reference is ``target``."""
    for _ in range(_MAX_LINKS):
        if not isinstance(forward, functools.partial):
            return False  # the class's forward, or a function that replaced it
        ref = registry_ref(forward)
        if ref is not None:
            if ref is target:
                return True
            forward = _private.wrapped_forward(ref)
            continue
        attr = _KEEPS_WRAPPED.get(getattr(forward.func, "__qualname__", ""))
        if attr is None or attr not in module.__dict__:
            return False
        forward = module.__dict__[attr]
    return False


class ForwardGuard:
    """Runs toma's hook on ``model`` from a torch forward pre-hook when the model's forward
    no longer reaches it (see the module docstring).

    Args:
        model: the patched denoiser.
        hook: toma's diffusers hook on it, registered (its ``fn_ref`` set).
    """

    def __init__(self, model: torch.nn.Module, hook: Any) -> None:
        self.hook = hook
        self.ref = hook.fn_ref
        self.taken = False  # whether the guard runs the hook in the current call
        self.seen: Any = model.__dict__.get("forward")
        self.reached = reaches(model, self.seen, self.ref)
        pre, post = self.ref.pre_forward, self.ref.post_forward

        def pre_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
            return (args, kwargs) if self.taken else pre(module, *args, **kwargs)

        def post_forward(module: torch.nn.Module, output: Any) -> Any:
            return output if self.taken else post(module, output)

        self.ref.pre_forward, self.ref.post_forward = pre_forward, post_forward
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, always_call=True),
        ]

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        forward = module.__dict__.get("forward")
        if forward is not self.seen:
            self.seen, self.reached = forward, reaches(module, forward, self.ref)
        self.taken = not self.reached
        if not self.taken:
            return None
        return self.hook.pre_forward(module, *args, **kwargs)

    def _after(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        if not self.taken:
            return None
        self.taken = False
        return self.hook.post_forward(module, output)

    def remove(self) -> None:
        """Remove the torch hooks (toma's diffusers hook goes with the rest of toma's)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.taken = False


def unlink(module: torch.nn.Module, ref: Any) -> None:
    """After toma's hook with function reference ``ref`` left ``module``: where a wrapper
    keeps the forward it wraps (cache-dit's ``_original_forward``) and that is the forward
    toma's hook installed, keep the one toma's wrapped instead, so that the wrapper's own
    removal (``cache_dit.disable_cache``) puts back the module's forward, not toma's."""
    for attr in _KEEPS_WRAPPED.values():
        if registry_ref(module.__dict__.get(attr)) is ref:
            module.__dict__[attr] = _private.wrapped_forward(ref)


def guard(model: torch.nn.Module) -> ForwardGuard | None:
    """A :class:`ForwardGuard` for toma's hook on ``model``, or None if it has none."""
    registry = _private.registry(model)
    hook = registry.get_hook(HOOK_NAME) if registry is not None else None
    if hook is None or getattr(hook, "fn_ref", None) is None:
        return None
    return ForwardGuard(model, hook)
