"""Give Qwen2.5-Omni's model a default ``voice_type`` before its first talker request.

What: sets the class attribute ``Qwen2_5OmniForConditionalGeneration.voice_type =
"Chelsie"`` (the default of its ``forward(voice_type=...)``) when that module is imported.
Why: vLLM-Omni sets ``self.voice_type`` only inside the talker's ``forward`` ("temporal
hack", ``qwen2_5_omni.py`` ~L346), but ``thinker_to_talker_process`` reads it during
input preprocessing, before the first real forward. On GPU a profiling dummy forward runs
first and sets it; on CPU in eager mode vLLM runs no dummy forward
(``CPUModelRunner.warming_up_model`` returns at once), so the talker stage died with
"object has no attribute 'voice_type'" on its first request. The value is the voice the
first forward would have set (nothing passes another), so behaviour matches a GPU run.
Verified by: tests/omni/test_e2e_speech.py (the talker stage serves its first request on CPU).
Remove when: vLLM-Omni initialises ``voice_type`` in ``__init__``.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm_omni.model_executor.models.qwen2_5_omni.qwen2_5_omni"
DEFAULT_VOICE = "Chelsie"  # forward()'s default voice_type in vLLM-Omni 0.30.0

RECORD = PatchRecord(
    name="qwen2_5_omni_voice_type",
    kind=Kind.OMNI,
    target=f"{TARGET_MODULE}.Qwen2_5OmniForConditionalGeneration.voice_type",
    process=Process.WORKER,
    why="voice_type is set only by the talker's forward(), but read in preprocessing before it; "
    "on CPU (eager, no dummy profiling forward) the talker's first request failed.",
    verified_by="tests/omni/test_e2e_speech.py: the talker stage serves its first request on CPU.",
    remove_when="vLLM-Omni initialises voice_type in Qwen2_5OmniForConditionalGeneration.__init__.",
    vllm_versions=("0.30.0",),
    package="vllm-omni",
    upstream="none found",
)


def apply() -> str:
    now = when_imported(TARGET_MODULE, _set_default)
    return f"default voice_type {DEFAULT_VOICE!r}" + ("" if now else " (on import)")


def _set_default(module) -> None:
    cls = module.Qwen2_5OmniForConditionalGeneration
    if "voice_type" not in vars(cls):
        cls.voice_type = DEFAULT_VOICE
