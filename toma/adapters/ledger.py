"""One record of every change toma makes to a model, undone from that record.

toma changes a model through several channels: diffusers hooks under its hook names, a
torch forward hook (:class:`~toma.adapters.caches.ForwardGuard`), the dispatch wrapper in a
processor's module (:mod:`toma.adapters.attention`), instance attributes (the patch itself,
``__deepcopy__``, a scheduler's ``set_timesteps``) and the links a cache or accelerate keeps
to a hook's forward. Each change goes through a :class:`Ledger` as it is made, which keeps
its undo; :meth:`Ledger.close` undoes them in reverse. ``remove_toma`` and an
``apply_toma`` that fails half-way both close the ledger, so neither needs to know the
channels.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from toma.adapters.base import register_innermost, registry_of, remove_hook
from toma.adapters.caches import unlink

__all__ = ["Ledger"]

_MISSING = object()


class Ledger:
    """The changes made to one model, each with its undo, in the order they were made."""

    def __init__(self) -> None:
        self._undo: list[tuple[str, Callable[[], Any]]] = []

    def __len__(self) -> int:
        return len(self._undo)

    def entries(self) -> list[str]:
        """What was changed, oldest first."""
        return [what for what, _ in self._undo]

    def record(self, what: str, undo: Callable[[], Any]) -> None:
        """Record a change made outside the ledger's own methods, with its undo."""
        self._undo.append((what, undo))

    def hook(self, module: torch.nn.Module, hook: Any, name: str, innermost: bool = True) -> None:
        """Register the diffusers hook ``hook`` as ``name`` on ``module``: innermost (see
        :func:`~toma.adapters.base.register_innermost`) or, with ``innermost=False``,
        outermost. Its undo removes it, then unlinks any wrapper that kept its forward."""
        try:
            if innermost:
                register_innermost(module, hook, name)
            else:
                registry_of(module).register_hook(hook, name)
        except BaseException:
            remove_hook(module, name)  # a registration that failed half-way leaves nothing
            raise

        def undo() -> None:
            remove_hook(module, name)
            if getattr(hook, "fn_ref", None) is not None:
                unlink(module, hook.fn_ref)

        self.record(f"diffusers hook {name!r} on {type(module).__name__}", undo)

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)``; the undo puts back the instance's own value, or
        deletes the attribute where the instance had none."""
        old = obj.__dict__.get(name, _MISSING)
        setattr(obj, name, value)
        self.record(f"attribute {name!r} of {type(obj).__name__}", lambda: _restore(obj.__dict__, name, old, value))

    def set_item(self, mapping: dict, key: str, value: Any, owner: Any) -> None:
        """``mapping[key] = value`` (an instance's ``__dict__``, bypassing ``__setattr__``);
        the undo puts back the old item where ``value`` is still the one there."""
        old = mapping.get(key, _MISSING)
        mapping[key] = value
        self.record(f"instance item {key!r} of {type(owner).__name__}", lambda: _restore(mapping, key, old, value))

    def close(self) -> None:
        """Undo every change, newest first. Every undo runs; the first error is raised after."""
        error: BaseException | None = None
        while self._undo:
            _, undo = self._undo.pop()
            try:
                undo()
            except BaseException as err:  # noqa: BLE001  (raised once the rest is undone)
                error = error or err
        if error is not None:
            raise error


def _restore(mapping: dict, key: str, old: Any, ours: Any) -> None:
    if mapping.get(key, _MISSING) is not ours:  # replaced since: someone else's now, left alone
        return
    if old is _MISSING:
        del mapping[key]
    else:
        mapping[key] = old
