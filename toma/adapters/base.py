"""What every model adapter shares: hooks, the hook name and the records of what was patched."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from toma.adapters import _private

HOOK_NAME = "toma"
CHUNK_HOOK_NAME = "toma_chunk"  # a block's second hook, where its MLP's chunking is taken over
RESIDUAL_HOOK_NAME = "toma_residual"  # a block's hook that leaves its residual adds to the merge hooks
REPLAY_HOOK_NAME = "toma_replay"  # a block's outermost hook, for its recomputation under checkpointing
ROPE_HOOK_NAME = "toma_rope"  # a block's hook that puts the rotary tables it takes in the blocks' order
PREFIX_HOOK_NAME = "toma_prefix"  # a block's hook that aligns per-sample prefixes (Lumina 2)
HOOK_NAMES = (
    HOOK_NAME,
    CHUNK_HOOK_NAME,
    RESIDUAL_HOOK_NAME,
    REPLAY_HOOK_NAME,
    ROPE_HOOK_NAME,
    PREFIX_HOOK_NAME,
)  # every name an adapter's attach registers hooks under


class Hook:
    """A diffusers model hook (the interface of ``diffusers.hooks.ModelHook``).

    Written out here rather than subclassed so that ``import toma`` does not import
    ``diffusers.hooks``, whose package imports every cache hook and the model code they
    need (seconds); diffusers' ``HookRegistry`` only calls these methods.
    """

    _is_stateful = False
    fn_ref: Any = None

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def deinitalize_hook(self, module: torch.nn.Module) -> torch.nn.Module:  # diffusers' spelling
        return module

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        return output

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        return module


def registry_of(module: torch.nn.Module) -> Any:
    """The module's diffusers ``HookRegistry``, created if needed."""
    from diffusers.hooks import HookRegistry

    return HookRegistry.check_if_exists_or_initialize(module)


def register_innermost(module: torch.nn.Module, hook: Any, name: str) -> None:
    """Register the diffusers hook ``hook`` as ``name`` on ``module``, inside any hooks it already has.

    A diffusers hook registered later wraps the earlier ones. toma's hooks change what a
    module computes on (merged tokens, tile order); a hook of a cache (TaylorSeer predicts a
    module's outputs from earlier steps) must see the module as toma makes it, whichever was
    enabled first. Otherwise, enabled before toma, it would extrapolate merged outputs
    across steps whose plans differ, and the order of enabling would change the images.
    """
    registry = registry_of(module)
    chain = _private.hook_chain(registry)
    outer = module.forward
    registry.register_hook(hook, name)
    if chain is None or len(chain[0]) < 2 or len(chain[1]) != len(chain[0]):
        return
    order, refs = chain
    # registered outermost; link it in at the bottom of the chain instead
    first, added = refs[0], refs[-1]
    base = _private.wrapped_forward(first)
    wrapped = module.forward
    module.forward = outer
    _private.set_wrapped_forward(added, base)
    _private.set_wrapped_forward(first, wrapped)
    order.insert(0, order.pop())
    refs.insert(0, refs.pop())


@dataclass(frozen=True)
class Patched:
    """One merged sub-module.

    Attributes:
        name: its qualified name inside the denoiser.
        module: the module itself.
        where: a short human description (resolution level, stream).
        downsample: token-grid downsample factor relative to the model's input grid.
        site: for families on the engine, how the sub-module merges (``engine.Site``).
    """

    name: str
    module: torch.nn.Module
    where: str
    downsample: int = 1
    site: Any = None  # the engine's Site, for families on the engine


@dataclass(frozen=True)
class Skipped:
    """A block that could have been merged but was not, and why."""

    name: str
    reason: str


def step_timestep(cache: Any, timestep: Any) -> float | None:
    """The timestep a step hook hands to ``cache.begin_forward``.

    Only plans kept across steps (``recompute_every > 1``) and step windows
    (``start_step``/``stop_step``) need it, to count steps and notice a new denoising run;
    otherwise every forward builds fresh plans and the timestep is not read, which on a
    GPU saves a device-to-host synchronisation per denoiser call.
    """
    config = cache.config
    return timestep_value(timestep) if config.recompute_every > 1 or config.windowed else None


def timestep_value(timestep: Any) -> float | None:
    """The denoising timestep as a Python float (first batch element), or None if absent.

    None too while a CUDA graph is being captured: reading a GPU value would synchronise,
    which capture forbids, and a captured forward must build its own plans anyway.
    """
    if timestep is None:
        return None
    if isinstance(timestep, torch.Tensor):
        if timestep.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        return float(timestep.reshape(-1)[0]) if timestep.numel() else None
    return float(timestep)


def remove_hook(module: torch.nn.Module, name: str) -> bool:
    """Remove the diffusers hook ``name`` from ``module``; returns whether it had one.

    When no hook is left, the module is put back exactly as it was: diffusers leaves the
    original ``forward`` behind as an instance attribute, which would shadow a later
    change of the module's class (tomesd patches blocks that way).
    """
    registry = _private.registry(module)
    if registry is None or registry.get_hook(name) is None:
        return False
    ref = registry.get_hook(name).fn_ref
    current = module.__dict__.get("forward")
    # a forward assigned after the registry's last (cache-dit's), which removing the
    # outermost hook would overwrite with the forward the registry once wrapped
    refs = _private.function_refs(registry)
    foreign = refs is not None and current is not None and registry_ref(current) not in refs
    _remove_keeping_later_hooks(registry, name)
    if foreign:
        module.forward = current
    if ref is not None:  # a foreign forward may still call it: it passes through from now on
        ref.pre_forward, ref.post_forward = _pass_args, _pass_output
    if not registry.hooks:
        forward = module.__dict__.get("forward")
        if getattr(forward, "__self__", None) is module and getattr(forward, "__func__", None) is type(module).forward:
            del module.forward
        _private.drop_registry(module)
    return True


def registry_ref(forward: Any) -> Any:
    """The diffusers ``HookFunctionReference`` of a forward a ``HookRegistry`` installed, or None.

    The registry installs ``partial(new_forward, module)``, ``new_forward`` a closure over the
    hook's function reference.
    """
    func = getattr(forward, "func", None)
    qualname = getattr(func, "__qualname__", "")
    if not isinstance(forward, functools.partial) or not qualname.startswith(_private.REGISTRY_FORWARD_PREFIX):
        return None
    for cell in func.__closure__ or ():
        contents = cell.cell_contents
        if type(contents).__name__ == _private.FUNCTION_REFERENCE:
            return contents
    return None


def _pass_args(module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    return args, kwargs


def _pass_output(module: torch.nn.Module, output: Any) -> Any:
    return output


def _remove_keeping_later_hooks(registry: Any, name: str) -> None:
    """``registry.remove_hook(name)``, keeping a hook registered after it working.

    diffusers (0.42) rewires the next hook's ``forward`` to the removed hook's original;
    a next hook with a ``new_forward`` (FirstBlockCache's, for one) calls its
    ``original_forward`` instead, which then still points at the removed hook, and ends up
    as the module's forward once that hook goes too: toma's hooks would keep running after
    ``remove_toma``. The next hook's references are set right here.
    """
    chain = _private.hook_chain(registry)
    if chain is None or name not in chain[0]:
        registry.remove_hook(name, recurse=False)
        return
    order, refs = chain
    index = order.index(name)
    if index == len(order) - 1 or not _private.own_new_forward(refs[index + 1]):
        registry.remove_hook(name, recurse=False)
        return
    removed, following = refs[index], refs[index + 1]
    original = _private.wrapped_forward(removed)
    kept = following.forward
    registry.remove_hook(name, recurse=False)
    following.forward, following.original_forward = kept, original
