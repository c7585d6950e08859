"""Record what the CPU worker really allocated, once its KV cache exists.

What: wraps ``CPUWorker.compile_or_warm_up_model`` (the last start-up step, after
``initialize_from_config`` allocated the KV cache) to write the worker evidence
of ``vllm_omni_edge/evidence.py`` when ``VLLM_OMNI_EDGE_EVIDENCE_DIR`` is set.
Why: the harness must prove a number came from the intended code path (KV bytes,
RoPE length, weight bytes, compiled or eager), read in the process that holds the
model, not the front end.
Verified by: tests/test_patches.py (evidence from the worker process matches the
requested KV budget) and the harness's invalid-pass test.
Remove when: never upstream; this is our instrumentation. Re-check the hook point
when moving off vLLM 0.30.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.worker.cpu_worker"

RECORD = PatchRecord(
    name="evidence_recorder",
    kind=Kind.LEVER,
    target="vllm.v1.worker.cpu_worker.CPUWorker.compile_or_warm_up_model",
    process=Process.WORKER,
    why="The harness needs the worker's own account of what it allocated.",
    verified_by="tests/test_patches.py reads worker evidence from a real worker process.",
    remove_when="Our instrumentation; re-check the hook on each vLLM upgrade.",
    upstream="none found",
)


def apply() -> str:
    from vllm_omni_edge.evidence import evidence_dir

    # Instrumentation only when asked.
    if evidence_dir() is None:
        return "no evidence directory requested; not wrapped"
    now = when_imported(TARGET_MODULE, _wrap)
    _follow_graph_args()
    _follow_stack_step_inputs()
    return "CPUWorker.compile_or_warm_up_model writes evidence" + ("" if now else " (on import)")


def _graph_args_to_evidence(counts: dict[str, int]) -> None:
    from vllm_omni_edge.evidence import update_worker_evidence

    update_worker_evidence(compiled_graph_args=counts)


def _follow_graph_args() -> None:
    """Compiled forwards get their argument plans on the first requests, after the worker's record."""
    from vllm_omni_edge.patches.worker import compiled_graph_args

    if _graph_args_to_evidence not in compiled_graph_args.listeners:
        compiled_graph_args.listeners.append(_graph_args_to_evidence)


def _stack_step_inputs_to_evidence(summary: dict) -> None:
    from vllm_omni_edge.evidence import update_worker_evidence

    update_worker_evidence(stack_step_inputs=summary)


def _follow_stack_step_inputs() -> None:
    """Steady decode steps come after the worker's record: the first one updates it."""
    from vllm_omni_edge.patches.worker import stack_step_inputs

    if _stack_step_inputs_to_evidence not in stack_step_inputs.listeners:
        stack_step_inputs.listeners.append(_stack_step_inputs_to_evidence)


def _wrap(module) -> None:
    def make(original):
        def compile_or_warm_up_model(self):
            result = original(self)
            from vllm_omni_edge.evidence import write_worker_evidence

            write_worker_evidence(self)
            return result

        return compile_or_warm_up_model

    wrap_method_once(module.CPUWorker, "compile_or_warm_up_model", make)
