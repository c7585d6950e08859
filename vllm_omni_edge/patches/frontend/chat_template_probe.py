"""Skip the processor chat-template probe for a model directory that holds no processor.

What: wraps ``vllm.renderers.hf._try_get_processor_chat_template`` (the "2nd priority"
chat template: the one of the model's ``AutoProcessor``). For a local directory that
cannot define a processor, it returns None without loading one; anything else goes
to vLLM's code. "Cannot" follows transformers' own ``AutoProcessor.from_pretrained``
(5.x): no ``processor_config.json``, ``preprocessor_config.json`` or
``video_preprocessor_config.json``; no ``processor_class`` and no ``AutoProcessor`` in
the ``auto_map`` of ``tokenizer_config.json`` or ``config.json``; a ``model_type``
without a processor class (``PROCESSOR_MAPPING_NAMES``). Then AutoProcessor can only
return a tokenizer, and vLLM drops anything that is not a ``ProcessorMixin``.
Why: for a text model the probe loads the whole tokenizer a second time just to
throw it away: 0.57 s of a busy-box `serve` start for SmolLM2's 49k vocabulary (py-spy),
in the server's chat-template warm-up, before the server is ready.
Verified by: tests/test_chat_template_probe.py (the default model's directory: skipped,
and vLLM's probe answers None too; each file or field that can define a processor
sends it to vLLM; a hub name goes to vLLM).
Remove when: vLLM looks for processor files before loading an AutoProcessor.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.renderers.hf"
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
NAMING_FILES = ("tokenizer_config.json", "config.json")

RECORD = PatchRecord(
    name="chat_template_probe",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}._try_get_processor_chat_template",
    process=Process.FRONTEND,
    why="vLLM loads the model's AutoProcessor for its chat template; for a text model that is a "
    "second full tokenizer load, thrown away (0.57 s of a busy-box start).",
    verified_by="tests/test_chat_template_probe.py",
    remove_when="vLLM checks for processor files before loading an AutoProcessor.",
    upstream="none found",
)


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@functools.lru_cache(maxsize=16)
def cannot_hold_processor(name_or_path: str) -> bool:
    """True only for a local directory from which AutoProcessor can build no processor."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    directory = Path(name_or_path)
    if not directory.is_dir() or any((directory / name).exists() for name in PROCESSOR_FILES):
        return False
    configs = {name: _json(directory / name) for name in NAMING_FILES}
    for config in configs.values():
        auto_map = config.get("auto_map")
        if config.get("processor_class") or (isinstance(auto_map, dict) and "AutoProcessor" in auto_map):
            return False
    return configs["config.json"].get("model_type") not in PROCESSOR_MAPPING_NAMES


def wrap_probe(original):
    def _try_get_processor_chat_template(tokenizer, *args, **kwargs):
        if cannot_hold_processor(str(tokenizer.name_or_path)):
            return None
        return original(tokenizer, *args, **kwargs)

    return _try_get_processor_chat_template


def _wrap(module) -> None:
    wrap_method_once(module, "_try_get_processor_chat_template", wrap_probe)


def apply() -> str:
    now = when_imported(TARGET_MODULE, _wrap)
    return "no AutoProcessor load for a model directory without a processor" + ("" if now else " (on import)")
