"""The compile-cache patch: CPU's saved inductor bundle can be finalized like vLLM's own artifacts."""

from __future__ import annotations

import types

from vllm_omni_edge.patches.worker import compile_cache_load


def fake_torch_module():
    class Bundle:  # stands in for torch's BundledAOTAutogradSerializableCallable
        def __call__(self, *args):
            return args

    return types.SimpleNamespace(BundledAOTAutogradSerializableCallable=Bundle), Bundle


def test_the_bundle_gets_a_finalize_loading_that_changes_nothing():
    module, bundle_cls = fake_torch_module()
    compile_cache_load._add_method(module)
    bundle = bundle_cls()
    before = dict(vars(bundle))
    assert bundle.finalize_loading(object()) is None  # vLLM passes its config
    assert vars(bundle) == before and bundle(1, 2) == (1, 2)


def test_adding_twice_or_to_a_class_that_has_one_keeps_the_existing_method():
    module, bundle_cls = fake_torch_module()
    compile_cache_load._add_method(module)
    first = bundle_cls.finalize_loading
    compile_cache_load._add_method(module)
    assert bundle_cls.finalize_loading is first

    def own(self, vllm_config):
        return "upstream"

    module2, bundle2 = fake_torch_module()
    bundle2.finalize_loading = own
    compile_cache_load._add_method(module2)
    assert bundle2().finalize_loading(None) == "upstream"  # a torch that grows one keeps it


def test_on_torch_itself_vllms_loader_finds_the_method():
    import inspect

    from torch._dynamo import aot_compile_types
    from vllm.compilation import caching, decorators

    compile_cache_load._add_method(aot_compile_types)
    assert callable(aot_compile_types.BundledAOTAutogradSerializableCallable.finalize_loading)
    # What the patch answers: vLLM 0.30's loader calls the method on whatever it loaded.
    assert "compiled_fn.finalize_loading(" in inspect.getsource(decorators._try_load_aot_compiled_fn)
    # vLLM's own artifact class keeps its real method.
    assert caching.VllmSerializableFunction.finalize_loading is not compile_cache_load._finalize_loading
