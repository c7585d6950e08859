"""vllm_omni_edge/omni/spoken_question.py without a server: topology, hooks, pipeline root."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml

from vllm_omni_edge.omni import spoken_question as sq


def _checkpoint(path, **files):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def test_pipeline_topology_whisper_then_text_model():
    pipeline = sq.pipeline_config()
    assert pipeline.model_type == "spoken_question" and not pipeline.get_validation_errors()
    asr, answer = pipeline.stages
    assert (asr.model_subdir, asr.input_sources, asr.final_output) == ("asr", (), False)
    assert (answer.model_subdir, answer.input_sources, answer.final_output) == ("answer", (0,), True)
    # The request's sampling fields go to the answer stage; Whisper keeps the YAML's.
    assert answer.owns_tokenizer and not asr.owns_tokenizer
    assert asr.prompt_transform_func.endswith(".check_spoken_question")
    assert answer.custom_process_input_func.endswith(".transcript_to_chat")
    assert pipeline.default_deploy_config_name == str(sq.STAGE_CONFIG)


def test_default_deploy_yaml_is_cpu_shaped():
    stages = {s["stage_id"]: s for s in yaml.safe_load(sq.STAGE_CONFIG.read_text())["stages"]}
    assert set(stages) == {0, 1}
    for stage in stages.values():
        assert stage["devices"] == "cpu" and stage["enforce_eager"] and stage["kv_cache_memory_bytes"] > 0
    assert stages[0]["max_num_batched_tokens"] >= 1500  # one Whisper encoder input per step
    assert stages[0]["default_sampling_params"]["temperature"] == 0.0


def test_registered_through_the_patch_when_the_registry_is_imported():
    from vllm_omni_edge.patches.base import apply_patch_module

    apply_patch_module("vllm_omni_edge.patches.frontend.spoken_question_pipeline")
    from vllm_omni.config.pipeline_registry import resolve_pipeline_config

    assert resolve_pipeline_config("spoken_question").stages[1].model_stage == "answer"


def _rendered(audio_items=1, **other):
    placeholders = {"audio": [object()] * audio_items} if audio_items else {}
    placeholders.update({k: [object()] * n for k, n in other.items()})
    return {"type": "multimodal", "prompt_token_ids": [50258], "mm_placeholders": placeholders}


def test_exactly_one_audio_part_passes_unchanged():
    prompt = _rendered()
    assert sq.check_spoken_question(prompt, []) is prompt
    raw = {"prompt": "", "multi_modal_data": {"audio": ("wave", 16000)}}
    assert sq.check_spoken_question(raw) is raw


@pytest.mark.parametrize("prompt, words", [
    (_rendered(0), "got 0"),
    (_rendered(2), "got 2"),
    (_rendered(1, image=1), "only audio input"),
    ("text", "one audio part"),
])
def test_anything_else_is_a_value_error(prompt, words):
    with pytest.raises(ValueError, match=words):
        sq.check_spoken_question(prompt)


def test_asr_template_writes_whispers_transcription_prompt():
    from jinja2 import Template

    template = Template(sq.ASR_CHAT_TEMPLATE)
    messages = [{"role": "user", "content": [{"type": "text", "text": "ignored"}]}]
    assert template.render(messages=messages) == "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
    assert "<|de|>" in template.render(messages=messages, language="de")


class FakeTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

    bos_token = None


def test_transcript_becomes_the_text_models_chat_prompt(monkeypatch):
    monkeypatch.setattr(sq, "_tokenizer", lambda path: FakeTokenizer())
    output = SimpleNamespace(request_id="r", outputs=[SimpleNamespace(text=" What is the capital of France?")])
    (prompt,) = sq.transcript_to_chat([output], None, False,
                                      target_model_config=SimpleNamespace(tokenizer="/tok", model="/m"))
    assert prompt == {"prompt": f"system:{sq.SYSTEM_PROMPT}|user:What is the capital of France?|assistant:"}


def test_pipeline_root_links_both_checkpoints(tmp_path):
    asr = _checkpoint(tmp_path / "whisper", **{"tokenizer.json": "{}"})
    answer = _checkpoint(tmp_path / "llm", **{"model.safetensors": "w"})
    root = sq.build_pipeline_dir(asr, answer, tmp_path / "out")
    assert json.loads((root / "config.json").read_text())["model_type"] == "spoken_question"
    assert (root / "asr" / "tokenizer.json").resolve() == (asr / "tokenizer.json").resolve()
    assert (root / "answer" / "model.safetensors").resolve() == (answer / "model.safetensors").resolve()
    assert (root / "asr" / "chat_template.jinja").read_text() == sq.ASR_CHAT_TEMPLATE
    assert sq.build_pipeline_dir(asr, answer, tmp_path / "out") == root  # the same pair, the same root
    with pytest.raises(FileNotFoundError, match="no config.json"):
        sq.build_pipeline_dir(tmp_path / "missing", answer, tmp_path / "out")


def test_plain_models_get_only_the_forward_arguments_they_name():
    from vllm_omni_edge.platforms.cpu.worker.runner_base import PlainModelKwargsMixin, forward_params

    class Plain:
        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
            ...

    class Omni:
        def forward(self, input_ids, positions, **kwargs):
            ...

    assert forward_params(Plain()) == {"input_ids", "positions", "intermediate_tensors", "inputs_embeds"}
    assert forward_params(Omni()) is None

    class Base:
        def _model_forward(self, **kwargs):
            return kwargs

    class Runner(PlainModelKwargsMixin, Base):
        def __init__(self, model):
            self.model = model

    extra = {"sampling_metadata": 1, "logits_index": 2}
    assert set(Runner(Plain())._model_forward(input_ids=1, positions=2, **extra)) == {
        "input_ids", "positions", "intermediate_tensors", "inputs_embeds"}
    assert set(Runner(Omni())._model_forward(input_ids=1, positions=2, **extra)) >= set(extra)
