"""Each private name of diffusers, accelerate and cache-dit in toma/adapters/_private.py,
checked against the installed versions (CI installs those of .ci/constraints.txt)."""

from __future__ import annotations

import functools
import importlib.metadata
import inspect

import torch

from toma.adapters import _private
from toma.adapters.base import registry_ref


def test_the_tested_versions_are_installed():
    installed = {name: importlib.metadata.version(name) for name in _private.TESTED}
    assert installed == _private.TESTED


def hooked_linear(*names):
    from diffusers.hooks import HookRegistry, ModelHook

    module = torch.nn.Linear(2, 2)
    registry = HookRegistry.check_if_exists_or_initialize(module)
    for name in names:
        registry.register_hook(ModelHook(), name)
    return module, registry


def test_a_module_keeps_its_hook_registry_under_the_named_attribute():
    module, registry = hooked_linear("a")
    assert _private.registry(module) is registry
    _private.drop_registry(module)
    assert _private.registry(module) is None and not hasattr(module, _private.REGISTRY_ATTR)


def test_the_hook_chain_lists_names_and_function_references_innermost_first():
    module, registry = hooked_linear("a", "b")
    order, refs = _private.hook_chain(registry)
    assert order == ["a", "b"] and len(refs) == 2
    assert type(refs[0]).__name__ == _private.FUNCTION_REFERENCE
    assert {"forward", "original_forward", "pre_forward", "post_forward"} <= set(vars(refs[0]))
    assert _private.function_refs(registry) is refs


def test_the_registry_forward_is_a_partial_over_a_function_reference():
    module, registry = hooked_linear("a")
    forward = module.forward
    assert isinstance(forward, functools.partial)
    assert forward.func.__qualname__.startswith(_private.REGISTRY_FORWARD_PREFIX)
    assert registry_ref(forward) is _private.function_refs(registry)[-1]


def test_a_function_reference_calls_its_forward_or_its_hooks_own_new_forward():
    from diffusers.hooks import HookRegistry, ModelHook

    class WithNewForward(ModelHook):
        def new_forward(self, module, *args, **kwargs):
            return self.fn_ref.original_forward(*args, **kwargs)

    module, registry = hooked_linear("plain")
    HookRegistry.check_if_exists_or_initialize(module).register_hook(WithNewForward(), "own")
    plain, own = _private.function_refs(registry)
    assert not _private.own_new_forward(plain) and _private.own_new_forward(own)
    assert _private.wrapped_forward(plain) is plain.forward
    assert _private.wrapped_forward(own) is own.original_forward
    marker = object()
    _private.set_wrapped_forward(own, marker)
    assert own.original_forward is marker


def test_accelerate_keeps_the_forward_it_wraps():
    from accelerate.hooks import ModelHook, add_hook_to_module

    module = torch.nn.Linear(2, 2)
    add_hook_to_module(module, ModelHook())
    attr = _private.KEEPS_WRAPPED[module.forward.func.__qualname__]
    assert module.__dict__[attr].__func__ is torch.nn.Linear.forward


def test_cache_dit_keeps_the_forward_it_wraps():
    from cache_dit.caching.cache_adapters.cache_adapter import CachedAdapter

    source = inspect.getsource(CachedAdapter.mock_transformer)
    nested = [c for c in CachedAdapter.mock_transformer.__code__.co_consts if inspect.iscode(c)]
    names = {f"CachedAdapter.mock_transformer.<locals>.{c.co_name}" for c in nested}
    cache_dit_names = [q for q in _private.KEEPS_WRAPPED if q.startswith("CachedAdapter.")]
    assert cache_dit_names and set(cache_dit_names) <= names
    for qualname in cache_dit_names:
        assert f"{_private.KEEPS_WRAPPED[qualname]} = " in source
    from cache_dit.caching.patch_functors import functor_chroma

    assert f"transformer.{_private.CACHE_DIT_PATCHED} = True" in inspect.getsource(functor_chroma)


def test_blocks_chunk_their_feed_forward_by_the_named_attributes():
    from diffusers.models.attention import BasicTransformerBlock

    module = BasicTransformerBlock(8, 2, 4)
    assert getattr(module, _private.CHUNK_SIZE) is None
    module.set_chunk_feed_forward(3, 1)
    assert (getattr(module, _private.CHUNK_SIZE), getattr(module, _private.CHUNK_DIM)) == (3, 1)


def test_transformer_2d_flattens_its_image_in_the_named_methods():
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    for name, params in _private.IMAGE_METHODS.items():
        assert tuple(inspect.signature(getattr(Transformer2DModel, name)).parameters) == params


def test_processors_look_up_the_named_dispatch_function_in_their_module():
    from diffusers.models.transformers import transformer_flux

    assert callable(getattr(transformer_flux, _private.DISPATCH_FN))
    assert _private.DISPATCH_FN in transformer_flux.FluxAttnProcessor.__call__.__code__.co_names


def test_the_active_attention_backend_and_the_backends_are_read():
    from diffusers.models.attention_dispatch import AttentionBackendName

    assert isinstance(_private.active_backend(), AttentionBackendName)
    assert "native" in _private.backends() and "flex" in _private.backends()


def test_context_parallel_config_and_group_are_where_they_are_read():
    from diffusers import ContextParallelConfig, ModelMixin

    assert "_parallel_config" in vars(ModelMixin) or "_parallel_config" in inspect.getsource(ModelMixin)
    assert _private.context_parallel_config(torch.nn.Linear(2, 2)) is None
    assert "_flattened_mesh" in ContextParallelConfig.__dataclass_fields__
    from diffusers.hooks import context_parallel

    assert f'"{_private.CP_INPUT_HOOK_PREFIX}' in inspect.getsource(context_parallel) or (
        _private.CP_INPUT_HOOK_PREFIX in inspect.getsource(context_parallel)
    )
