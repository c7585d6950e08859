"""Hash torch's and triton's installed code for the compile cache key in the background.

What: wraps ``CPUModelRunner.__init__``: when the model will be compiled and vLLM's key
holds inductor's factors (``VLLM_USE_MEGA_AOT_ARTIFACT``, on with torch >= 2.12), it
starts inductor's own ``triton_key.prefetch()`` and ``torch_key.prefetch()``
(``torch.utils._functools.prefetchable_cache``: the value is computed on torch's
two-thread prefetch pool; the first caller waits for it). The key itself is unchanged.
Why: the compile cache key is computed at the first forward, after the weights are
loaded, and on the start's critical path: ``triton_key`` reads and hashes the 476 MB
``libtriton.so`` (triton comes with xgrammar; it has no CPU backend) and torch's key
hashes torch's Python sources: 0.54 s and 0.19 s here, one core, warm page cache.
Started before the model is built, the hashing (which releases the GIL) overlaps the
load on the second core.
Verified by: tests/test_compile_key_prefetch.py (prefetch started only for a compiled
model with the mega artifact; the key's values are the same as without it).
Remove when: torch stops hashing triton on a build without a triton CPU backend, or
vLLM prefetches these itself.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.worker.cpu_model_runner"

RECORD = PatchRecord(
    name="compile_key_prefetch",
    target=f"{TARGET_MODULE}.CPUModelRunner.__init__",
    process=Process.WORKER,
    why="The compile cache key hashes libtriton.so (476 MB) and torch's sources on the start's "
    "critical path (0.7 s); prefetched, that overlaps the weight load.",
    verified_by="tests/test_compile_key_prefetch.py",
    remove_when="torch skips triton's hash without a triton CPU backend, or vLLM prefetches the key.",
)

# Whether this process started the prefetch (evidence / tests).
started = False


def wants_inductor_key(vllm_config) -> bool:
    """A compiled model whose AOT cache key includes inductor's system and torch factors."""
    from vllm import envs
    from vllm.config import CompilationMode

    return vllm_config.compilation_config.mode != CompilationMode.NONE and envs.VLLM_USE_MEGA_AOT_ARTIFACT


def prefetch_inductor_key() -> None:
    from torch._inductor.codecache import torch_key, triton_key

    global started
    triton_key.prefetch()
    torch_key.prefetch()
    started = True


def _wrap(module) -> None:
    def make(original):
        def __init__(self, vllm_config, *args, **kwargs):
            if wants_inductor_key(vllm_config):
                prefetch_inductor_key()
            original(self, vllm_config, *args, **kwargs)

        return __init__

    wrap_method_once(module.CPUModelRunner, "__init__", make)


def apply() -> str:
    now = when_imported(TARGET_MODULE, _wrap)
    return "inductor's torch/triton key hashed in the background for a compiled model" + (
        "" if now else " (on import)")
