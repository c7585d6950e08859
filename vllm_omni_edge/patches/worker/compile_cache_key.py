"""Key vLLM's saved compiled model on our settings too, so one never loads into another.

What: wraps ``vllm.compilation.caching.aot_compile_hash_factors`` (vLLM's AOT compile
cache key: its env vars, its config, the model) and appends one factor: the resolved
value of each of our levers that changes what the graph holds (RoPE table size, the
embedding's prepacked copy, the second int4 layout, the fused MLP op, the KV write inside
the attention call), the cpu_int4 kernel each kind of layer got here
(``quantization.evidence.kernel_counts()``, known by then: the key is computed at the first
forward, after the weights were processed). Our code itself needs no factor:
vLLM checks the source files dynamo traced (our kernels' ``apply``) when it loads.
Why: the compiled graph holds the parameters our kernels registered (tinygemm's
``scales_and_zeros``, W4A8's stored triple, a dense prefill copy...). vLLM's key does not
see our kernel choice or flags, so a model compiled on ``int4pack`` was loaded for a start
forced to another kernel and the first forward died: ``KeyError: 'scales_and_zeros'``
(2026-12-01, SmolLM2 cpu_int4, one process). With this factor each choice gets its own
cache directory; an unchanged start still loads its own.
Verified by: tests/test_compile_cache_key.py (the factor follows the kernels and the graph-shaping
levers, not other flags; its place in vLLM's key; idempotent); compiled grid arms assert ``compile_cache.aot_loaded`` with two kernels
sharing one cache root (the run is named in the RECORD's ``verified_by``).
Remove when: vLLM lets a quantization method add to the compile cache key (or hashes the
model's parameter names), so a kernel switch is a different key upstream.
"""

from __future__ import annotations

import json

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.compilation.caching"

RECORD = PatchRecord(
    name="compile_cache_key",
    kind=Kind.FIX,
    target=f"{TARGET_MODULE}.aot_compile_hash_factors",
    process=Process.WORKER,
    why="vLLM's compile cache key ignores our kernel choice and flags: an artifact compiled on "
    "one cpu_int4 kernel was loaded for another and the first forward raised KeyError.",
    verified_by="tests/test_compile_cache_key.py; results/2026-12-01-w4a8-vnni-qwen/grid.yaml (aot_loaded per kernel).",
    remove_when="vLLM lets a quantization method extend the compile cache key.",
    upstream="none found",
)

# The factor this process added last (None: no compiled model was keyed here); evidence.
last_factor: str | None = None


def edge_factor() -> str:
    """What of ours shapes the compiled graph, as one stable string."""
    from vllm_omni_edge import levers
    from vllm_omni_edge.quantization.evidence import kernel_counts

    # Resolved values, not raw variables: "unset" and the default are one key, and flags
    # that never reach the graph (evidence directory, process layout, ...) are none of it.
    # The kernel and layout choices are also in the counts: a routed choice has no flag.
    return json.dumps(
        {
            "rope_cap": levers.rope_cap_enabled(),
            "embed_prepack": levers.embed_prepack_enabled(),
            "int4_dense_prefill_copy": levers.int4_dense_prefill_copy(),
            "fused_mlp": levers.fused_mlp_enabled(),
            "attention_one_call": levers.attention_one_call_enabled(),
            "cpu_int4_kernels": dict(sorted(kernel_counts().items())),
        },
        sort_keys=True,
    )


def _wrap(module) -> None:
    def make(original):
        def aot_compile_hash_factors(vllm_config):
            global last_factor
            last_factor = edge_factor()
            return [*original(vllm_config), last_factor]

        return aot_compile_hash_factors

    wrap_method_once(module, "aot_compile_hash_factors", make)


def apply() -> str:
    now = when_imported(TARGET_MODULE, _wrap)
    return "compile cache keyed on our kernels and flags" + ("" if now else " (on import)")
