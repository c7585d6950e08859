"""Let vLLM load the compiled model it saved on CPU, instead of compiling it again each start.

What: gives torch's ``BundledAOTAutogradSerializableCallable`` (what ``aot_compile``
saves for a plain ``"inductor"`` backend) a ``finalize_loading(vllm_config)`` that does
nothing, if it has none.
Why: vLLM 0.30's ``compilation.decorators._try_load_aot_compiled_fn`` calls
``loaded_fn._artifacts.compiled_fn.finalize_loading(...)`` on every artifact it loads,
a method only vLLM's own ``VllmSerializableFunction`` (``VLLM_COMPILE`` mode) has. The
CPU platform compiles in ``DYNAMO_TRACE_ONCE`` mode with ``backend="inductor"``, so
its artifact is torch's bundle; the load raises "'function' object has no attribute
'finalize_loading'", vLLM logs "Compiling model again due to a load failure" and
compiles from scratch: ~80 s of every start of a compiled model on this box. The
bundle is fully deserialized by ``load_compiled_function`` (its inductor graphs are
loaded there), so there is nothing left to finalize.
Verified by: tests/test_compile_cache_load.py (the method exists, is idempotent, leaves
vLLM's own class alone); tests/e2e/test_compile_cache.py (a second compiled start loads
the artifact: vLLM's ``num_aot_artifacts_loaded`` counter and no recompile, with the
same greedy answer as the first start).
Remove when: vLLM's loader checks for ``finalize_loading`` (or CPU compiles through
``VllmSerializableFunction``); run the e2e test without this patch.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "torch._dynamo.aot_compile_types"
TARGET_CLASS = "BundledAOTAutogradSerializableCallable"
METHOD = "finalize_loading"

RECORD = PatchRecord(
    name="compile_cache_load",
    kind=Kind.FIX,
    target=f"{TARGET_MODULE}.{TARGET_CLASS}.{METHOD} "
    "(called by vllm.compilation.decorators._try_load_aot_compiled_fn)",
    process=Process.WORKER,  # the model is compiled and loaded where it runs
    why="vLLM 0.30 calls finalize_loading on every loaded AOT artifact; CPU's inductor bundle "
    "has none, so every compiled start recompiles (~80 s here) instead of loading the cache.",
    verified_by="tests/test_compile_cache_load.py; tests/e2e/test_compile_cache.py (second "
    "start loads the artifact, no recompile, same answer).",
    remove_when="vLLM's AOT loader tolerates artifacts without finalize_loading, or CPU compiles "
    "through VllmSerializableFunction.",
    upstream="none found",
)


def apply() -> str:
    now = when_imported(TARGET_MODULE, _add_method)
    return f"{TARGET_CLASS}.{METHOD} is a no-op" + ("" if now else " (on import)")


def _finalize_loading(self, vllm_config=None) -> None:
    """Nothing to do: ``load_compiled_function`` already loaded the inductor graphs."""


def _add_method(module) -> None:
    cls = getattr(module, TARGET_CLASS)
    if not hasattr(cls, METHOD):
        setattr(cls, METHOD, _finalize_loading)
