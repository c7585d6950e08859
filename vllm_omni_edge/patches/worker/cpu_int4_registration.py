"""Register the ``cpu_int4`` quantization method with vLLM in every process.

What: imports ``vllm_omni_edge.quantization.config``, whose
``@register_quantization_config("cpu_int4")`` adds the method through vLLM's
public registry and lists our linear method for weight_loader_v2.
Why: the front end must know the name before it validates ``--quantization`` or
a checkpoint's ``quant_method``; workers need the same classes when they
unpickle the config and build layers. Not a monkey-patch: public API only.
Verified by: tests/quantization/test_vllm_layers.py (registration, idempotence) and
tests/quantization/test_e2e_cpu_int4.py (a cpu_int4 checkpoint answers through
``vllm.LLM`` with workers in spawned processes).
Remove when: never while the plugin ships cpu_int4; it is the registration itself.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process

RECORD = PatchRecord(
    name="cpu_int4_registration",
    kind=Kind.LEVER,
    target="vllm.model_executor.layers.quantization.register_quantization_config('cpu_int4')",
    process=Process.WORKER,
    why="vLLM only knows quantization methods registered in the current process; the front "
    "end validates the name and spawned workers build the layers.",
    verified_by="tests/quantization/test_vllm_layers.py; tests/quantization/test_e2e_cpu_int4.py "
    "loads a cpu_int4 checkpoint through vllm.LLM.",
    remove_when="Never while cpu_int4 ships: this is the registration, through public API.",
    upstream="none found",
)


def apply() -> str:
    from vllm_omni_edge.quantization import register_cpu_int4

    return register_cpu_int4()
