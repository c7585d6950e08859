"""Cut rotary cos/sin tables to max_model_len once the model is built.

What: wraps ``CPUModelRunner.load_model`` to call
``vllm_omni_edge.levers.rope_cap.cap_rotary_tables(model, max_model_len)``.
Why: vLLM sizes every ``cos_sin_cache`` by ``max_position_embeddings`` (measured:
8,192 rows in the worker for SmolLM2 with max_model_len=512); positions never
reach beyond max_model_len, so the rest is resident and never read.
Flag: ``VLLM_OMNI_EDGE_ROPE_CAP=0`` keeps vLLM's tables (the lever's A/B arm).
Verified by: tests/test_levers.py (every rotary variant the supported models use:
rows below the cap equal the uncapped table bit for bit) and the worker evidence
(``rope[].rows == max_model_len``) in tests/e2e/test_memory_levers.py.
Remove when: vLLM sizes rotary caches by max_model_len (not as of 0.30.0).
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.worker.cpu_model_runner"

RECORD = PatchRecord(
    name="rope_cap",
    kind=Kind.LEVER,
    target="vllm.v1.worker.cpu_model_runner.CPUModelRunner.load_model",
    process=Process.WORKER,
    why="RoPE tables are built for max_position_embeddings; rows past max_model_len are never read.",
    verified_by="tests/test_levers.py (bit-for-bit rows per variant); worker evidence rope rows.",
    remove_when="vLLM builds rotary caches for max_model_len.",
    upstream="none found",
)


def apply() -> str:
    from vllm_omni_edge.levers import rope_cap_enabled

    if not rope_cap_enabled():
        return "VLLM_OMNI_EDGE_ROPE_CAP=0: vLLM's full-length tables kept"
    now = when_imported(TARGET_MODULE, _wrap_load_model)
    return "CPUModelRunner.load_model caps RoPE tables" + ("" if now else " (on import)")


def _wrap_load_model(module) -> None:
    def make(original):
        def load_model(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            from vllm_omni_edge.levers.rope_cap import cap_rotary_tables
            from vllm_omni_edge.log import get_logger

            cut = cap_rotary_tables(self.model, self.model_config.max_model_len)
            if cut:
                get_logger("rope_cap").info(
                    "RoPE tables cut to max_model_len=%d rows: %s (%.1f MiB freed)",
                    self.model_config.max_model_len,
                    ", ".join(f"{c['class']}.{c['buffer']} {c['rows_before']}" for c in cut),
                    sum(c["bytes_freed"] for c in cut) / (1 << 20),
                )
            return result

        return load_model

    wrap_method_once(module.CPUModelRunner, "load_model", make)
