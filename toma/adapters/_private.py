"""Every private name of diffusers, accelerate and cache-dit that toma reads or writes.

They are not these projects' API and may change in any release, so they are named here
once, each with what toma needs of it, and ``tests/adapters/test_private.py`` checks each
against the installed versions. CI installs the versions in ``.ci/constraints.txt``; the
README names the tested range. Nothing here imports diffusers at module import.
"""

from __future__ import annotations

from typing import Any

import torch

# the versions these names were written against (CI's .ci/constraints.txt)
TESTED = {"diffusers": "0.42.1", "accelerate": "1.16.0", "cache-dit": "1.5.3"}

# -- diffusers' hook registry (diffusers.hooks.HookRegistry) ------------------------------

# the attribute where a module keeps its HookRegistry
REGISTRY_ATTR = "_diffusers_hook"
# the registry installs ``partial(new_forward, module)`` as the module's forward, where
# new_forward is a closure defined in HookRegistry.register_hook over a HookFunctionReference
REGISTRY_FORWARD_PREFIX = "HookRegistry."
FUNCTION_REFERENCE = "HookFunctionReference"


def registry(module: torch.nn.Module) -> Any:
    """The module's diffusers HookRegistry, or None (without creating one)."""
    return getattr(module, REGISTRY_ATTR, None)


def drop_registry(module: torch.nn.Module) -> None:
    """Remove the module's empty HookRegistry, so that the module is as it was before."""
    delattr(module, REGISTRY_ATTR)


def hook_chain(registry: Any) -> tuple[list, list] | None:
    """The registry's hook names and their function references, innermost first
    (``_hook_order``, ``_fn_refs``), as the registry's own lists; None if either is not a list."""
    order, refs = getattr(registry, "_hook_order", None), getattr(registry, "_fn_refs", None)
    if not isinstance(order, list) or not isinstance(refs, list):
        return None
    return order, refs


def function_refs(registry: Any) -> list | None:
    """The registry's function references (``_fn_refs``), or None."""
    chain = hook_chain(registry)
    return None if chain is None else chain[1]


def wrapped_forward(ref: Any) -> Any:
    """The forward a function reference calls next: its ``original_forward`` where the hook
    has a ``new_forward`` of its own, else its ``forward``."""
    return ref.original_forward if own_new_forward(ref) else ref.forward


def own_new_forward(ref: Any) -> bool:
    """Whether the hook of a function reference has a ``new_forward`` of its own (then the
    reference's ``original_forward`` is what it calls next)."""
    return getattr(ref, "original_forward", None) is not None


def set_wrapped_forward(ref: Any, forward: Any) -> None:
    """Make a function reference call ``forward`` next (see :func:`wrapped_forward`)."""
    if own_new_forward(ref):
        ref.original_forward = forward
    else:
        ref.forward = forward


# -- wrappers that keep the forward they wrap on the module --------------------------------

# by the qualified name of the function their ``functools.partial`` calls: the module
# attribute where the wrapped forward is
KEEPS_WRAPPED = {
    # cache-dit 1.5.3, caching/cache_adapters/cache_adapter.py
    "CachedAdapter.mock_transformer.<locals>.new_forward_with_hf_hook": "_original_forward",
    # accelerate 1.16.0, hooks.py (CPU offload, device maps)
    "add_hook_to_module.<locals>.new_forward": "_old_forward",
}

# cache-dit's mark on a module whose forward its patch functor replaced
CACHE_DIT_PATCHED = "_is_patched"

# -- diffusers' blocks ----------------------------------------------------------------------

# feed-forward chunking of a block (set_chunk_feed_forward): the slice length and dimension
CHUNK_SIZE, CHUNK_DIM = "_chunk_size", "_chunk_dim"

# Transformer2DModel's methods that flatten its image to tokens and back, with the
# parameters toma's replacements take (toma/adapters/unet.py)
FLATTEN_IMAGE, UNFLATTEN_IMAGE = "_operate_on_continuous_inputs", "_get_output_for_continuous_inputs"
IMAGE_METHODS = {
    FLATTEN_IMAGE: ("self", "hidden_states"),
    UNFLATTEN_IMAGE: (
        "self",
        "hidden_states",
        "residual",
        "batch_size",
        "height",
        "width",
        "inner_dim",
    ),
}

# -- attention dispatch -----------------------------------------------------------------------

# the function processors call, looked up in their own module's globals at each call
DISPATCH_FN = "dispatch_attention_fn"


def active_backend() -> Any:
    """diffusers' active attention backend (``_AttentionBackendRegistry``), a name enum."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    return _AttentionBackendRegistry.get_active_backend()[0]


def backends() -> list[str]:
    """The names of every attention backend diffusers registers."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    return [b.value for b in _AttentionBackendRegistry.list_backends()]


# -- context parallelism -----------------------------------------------------------------------


def context_parallel_config(model: torch.nn.Module) -> Any:
    """The model's ContextParallelConfig (``model._parallel_config.context_parallel_config``), or None."""
    parallel = getattr(model, "_parallel_config", None)
    return getattr(parallel, "context_parallel_config", None)


# the names of diffusers' context-parallel split hooks start so; each hook's ``metadata`` is its input plan
CP_INPUT_HOOK_PREFIX = "cp_input---"


def context_parallel_group(cp: Any) -> Any:
    """The process group over all of a ContextParallelConfig's ranks (``_flattened_mesh``)."""
    return cp._flattened_mesh.get_group()
