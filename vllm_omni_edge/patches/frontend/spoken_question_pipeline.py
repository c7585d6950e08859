"""Register our ``spoken_question`` pipeline (Whisper -> text model) in vLLM-Omni's registry.

What: calls vLLM-Omni's public ``register_pipeline`` with
``vllm_omni_edge.omni.spoken_question.pipeline_config()`` when
``vllm_omni.config.pipeline_registry`` is imported. Nothing of vLLM-Omni is replaced.
Why: vLLM-Omni resolves a served model's ``model_type`` against ``OMNI_PIPELINES``, which
holds only its own pipelines. Its ``vllm_omni.general_plugins`` entry-point group runs
too late for the API server (the pipeline is resolved before any ``OmniEngineArgs``
exists), and our vLLM general plugin runs in every process before that, so this is the
hook. Lazy, so a process that never imports the registry pays nothing.
Verified by: tests/omni/test_spoken_question.py (registration) and
tests/omni/test_e2e_spoken_question.py (the server resolves the pipeline root to it).
Remove when: never as a workaround; it is how the pipeline is installed. It would move to
an entry point if vLLM-Omni loaded pipeline plugins before resolving the model.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm_omni.config.pipeline_registry"

RECORD = PatchRecord(
    name="spoken_question_pipeline",
    kind=Kind.OMNI,
    target=f"{TARGET_MODULE}.OMNI_PIPELINES['spoken_question']",
    process=Process.FRONTEND,
    why="vLLM-Omni resolves pipelines from its own registry only; our Whisper -> text model "
    "pipeline is added with its public register_pipeline().",
    verified_by="tests/omni/test_spoken_question.py; tests/omni/test_e2e_spoken_question.py.",
    remove_when="vLLM-Omni loads pipeline plugins (entry points) before it resolves the model.",
    vllm_versions=("0.30.0",),
    package="vllm-omni",
    upstream="none found",
)


def apply() -> str:
    now = when_imported(TARGET_MODULE, _register)
    return "pipeline spoken_question registered" + ("" if now else " (on import)")


def _register(_module) -> None:
    from vllm_omni_edge.omni.spoken_question import register

    register()
