"""Keep bf16 attention off vLLM's AMX kernels: on the AMX box they decode wrong answers.

What: wraps ``vllm.v1.attention.backends.cpu_attn._get_attn_isa`` so that where it
would pick ``"amx"`` it returns ``"vec"`` (the AVX-512 kernels vLLM uses for every
other dtype and block size). Both callers (the attention metadata builder and the
KV-cache packing in ``platforms/cpu.py``) look the function up in its module at call
time, so the cache layout and the kernel always agree.
Why: on the 2-core Intel Xeon with AMX (2026-12-01), the default model in bf16 answers
"What is the capital of France?" with "L'Étoile, la Marseillaise, la femme, ..."
through ``isa="amx"`` and with "The capital of France is Paris." through ``"vec"``
(same process layout, same weights; fp32, which never uses AMX attention, also says
Paris). The cpu_int4 checkpoint on tinygemm goes wrong the same way. Prompt scoring
(prefill) is unaffected: bf16 vLLM scored 0.0011 nats KLD against transformers in
``2026-12-01-formats-default``, which is why the fidelity grids did not catch it;
the answer goes wrong in decode. Cause not isolated (vLLM's AMX attention kernel, or
tile state shared with oneDNN's AMX GEMMs on the same thread).
Flag: ``VLLM_OMNI_EDGE_AMX_ATTENTION=1`` restores vLLM's choice.
Verified by: tests/e2e/test_amx_worker.py (on an AMX CPU: the default run answers
Paris on ``vec``; the flagged run runs ``amx`` without SIGILL, our permission patch);
tests/test_cpu_attention_isa.py (the mapping, the flag, idempotence).
Remove when: a vLLM release's AMX attention gives the default model the same greedy
answer as ``vec`` (run the flagged e2e test and compare).
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.attention.backends.cpu_attn"

RECORD = PatchRecord(
    name="cpu_attention_isa",
    target=f"{TARGET_MODULE}._get_attn_isa",
    process=Process.WORKER,  # the KV cache is laid out and attention runs in the worker
    why="vLLM's bf16 AMX attention decodes wrong greedy answers on the AMX box; the vec kernels do not.",
    verified_by="tests/e2e/test_amx_worker.py (Paris on vec by default, amx runs when flagged); "
    "tests/test_cpu_attention_isa.py.",
    remove_when="vLLM's AMX attention gives the same greedy answer as vec on an AMX CPU.",
)

AMX = "amx"
REPLACEMENT = "vec"


def apply() -> str:
    from vllm_omni_edge.levers import amx_attention_enabled

    if amx_attention_enabled():
        return "VLLM_OMNI_EDGE_AMX_ATTENTION=1: vLLM picks the attention kernels"
    now = when_imported(TARGET_MODULE, _wrap)
    return f"bf16 attention runs {REPLACEMENT}, not {AMX}" + ("" if now else " (on import)")


def _wrap(module) -> None:
    def make(original):
        def _get_attn_isa(*args, **kwargs):
            isa = original(*args, **kwargs)
            return REPLACEMENT if isa == AMX else isa

        return _get_attn_isa

    wrap_method_once(module, "_get_attn_isa", make)  # a module attribute wraps like a method
