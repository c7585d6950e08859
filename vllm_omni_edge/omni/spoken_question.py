"""A spoken question, answered in one request: Whisper (audio -> text), then a text LLM (text -> answer).

vLLM-Omni 0.30 takes a pipeline's topology from Python (a ``PipelineConfig`` in its
registry) and the per-stage knobs from a deploy YAML. This module is our topology,
registered under the model type ``spoken_question``
(``patches/frontend/spoken_question_pipeline.py`` calls vLLM-Omni's ``register_pipeline``
when its registry is imported), plus the two hooks that join the stages:

- stage 0, ``asr``: Whisper, an LLM_AR stage. vLLM-Omni's chat server renders every
  request with stage 0's renderer; for an encoder-decoder model that makes the rendered
  text the decoder prompt and the audio part the encoder input. So the Whisper directory
  carries a chat template that writes Whisper's transcription prompt
  (``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>``, the one vLLM's
  /v1/audio/transcriptions builds), and :func:`check_spoken_question` (the stage's
  ``prompt_transform_func``) only checks that the request carries exactly one audio part.
- stage 1, ``answer``: the text model (SmolLM2-135M or Qwen2.5-Coder-1.5B, cpu_int4).
  :func:`transcript_to_chat` (its input processor) takes stage 0's transcript and
  builds the text model's chat prompt with the model's own chat template: a short
  system instruction, then the transcribed question. It is the pipeline's
  "comprehension" stage, so a request's sampling fields (max_tokens, temperature) apply
  to the answer; Whisper transcribes greedily with the YAML's defaults.

The two checkpoints are separate directories; vLLM-Omni serves one "model" path, so
:func:`build_pipeline_dir` writes a pipeline root (a ``config.json`` naming the model
type, and ``asr/`` and ``answer/`` subdirectories of links to the checkpoints' files) and
each stage picks its subdirectory (``model_subdir``), as vLLM-Omni's own multi-checkpoint
pipelines (Audex, Ming-Image) do.

Serve: ``vllm-omni serve ROOT --omni`` (the deploy YAML is the pipeline's default,
``omni/stage_configs/spoken_question.yaml``), then POST /v1/chat/completions with an
``input_audio`` part.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from vllm_omni_edge.log import get_logger

MODEL_TYPE = "spoken_question"
ASR_SUBDIR = "asr"
ANSWER_SUBDIR = "answer"
STAGE_CONFIG = Path(__file__).resolve().parent / "stage_configs" / "spoken_question.yaml"
# Bump when the layout of a pipeline root changes: roots of another version are rebuilt.
LAYOUT_VERSION = 2

SYSTEM_PROMPT = "You are a helpful assistant. Answer the user's question in one sentence."

# The Whisper directory's chat template. vLLM-Omni renders every chat request with stage
# 0's renderer, which for Whisper (an encoder-decoder model) makes the rendered text the
# DECODER prompt and the request's audio the encoder input. So the template writes
# Whisper's transcription prompt, the one vLLM's /v1/audio/transcriptions builds
# (WhisperForConditionalGeneration.get_generation_prompt), and ignores the messages' text.
# ``chat_template_kwargs: {"language": "de"}`` in a request picks another language.
ASR_CHAT_TEMPLATE = (
    "<|startoftranscript|><|{{ language if language is defined and language else 'en' }}|>"
    "<|transcribe|><|notimestamps|>"
)

_PROC = __name__
logger = get_logger("spoken_question")


def pipeline_config():
    """The topology (vLLM-Omni ``PipelineConfig``); imported lazily with vLLM-Omni."""
    from vllm_omni.config.stage_config import PipelineConfig, StageExecutionType, StagePipelineConfig

    return PipelineConfig(
        model_type=MODEL_TYPE,
        # An absolute path: vLLM-Omni joins it onto its own deploy directory.
        default_deploy_config_name=str(STAGE_CONFIG),
        stages=(
            StagePipelineConfig(
                stage_id=0,
                model_stage="asr",  # vLLM-Omni's chat server treats an "asr" stage as taking audio
                execution_type=StageExecutionType.LLM_AR,
                input_sources=(),
                requires_multimodal_data=True,
                engine_output_type="text",
                model_subdir=ASR_SUBDIR,
                tokenizer_subdir=ASR_SUBDIR,
                prompt_transform_func=f"{_PROC}.check_spoken_question",
                sampling_constraints={"detokenize": True},
            ),
            StagePipelineConfig(
                stage_id=1,
                model_stage="answer",
                execution_type=StageExecutionType.LLM_AR,
                input_sources=(0,),
                final_output=True,
                final_output_type="text",
                # The "comprehension" stage: the request's sampling fields (max_tokens,
                # temperature, ...) apply to it; Whisper keeps the YAML's greedy defaults.
                owns_tokenizer=True,
                engine_output_type="text",
                model_subdir=ANSWER_SUBDIR,
                tokenizer_subdir=ANSWER_SUBDIR,
                custom_process_input_func=f"{_PROC}.transcript_to_chat",
                sampling_constraints={"detokenize": True},
            ),
        ),
    )


def register() -> None:
    """Add the pipeline to vLLM-Omni's registry (idempotent)."""
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES, register_pipeline

    if MODEL_TYPE not in OMNI_PIPELINES:
        register_pipeline(pipeline_config())


# --- stage 0: the chat request -> Whisper's prompt ---------------------------------------


def _audio_count(prompt: dict[str, Any]) -> tuple[int, list[str]]:
    """(audio items, other modalities) of a chat prompt, processed by the renderer or raw."""
    if prompt.get("type") == "multimodal":  # the renderer already ran Whisper's processor
        placeholders = prompt.get("mm_placeholders") or {}
    else:
        placeholders = prompt.get("multi_modal_data") or {}
    counts = {m: (len(v) if isinstance(v, list) else 1) for m, v in placeholders.items() if v}
    return counts.pop("audio", 0), sorted(counts)


def check_spoken_question(prompt: Any, sampling_params_list: Any = None) -> Any:
    """Stage 0's ``prompt_transform_func``: a chat request must carry exactly one audio part.

    The prompt arrives rendered: the ASR chat template wrote Whisper's decoder prompt,
    and the renderer ran Whisper's processor on the audio (the encoder input), so it is
    passed on unchanged. Anything else is a ValueError, which the server answers with a 400.
    """
    if not isinstance(prompt, dict):
        raise ValueError("spoken_question: send one chat request whose user message has one audio part")
    audio, others = _audio_count(prompt)
    if others:
        raise ValueError(f"spoken_question: only audio input is understood; got {', '.join(others)}")
    if audio != 1:
        raise ValueError(
            "spoken_question: the question must be exactly one audio part (input_audio or audio_url); "
            f"got {audio}")
    return prompt


# --- stage 1: the transcript -> the text model's chat prompt ----------------------------


@lru_cache(maxsize=4)
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def chat_messages(transcript: str, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": transcript.strip()}]


def chat_text(tokenizer, transcript: str) -> str:
    """The text model's chat prompt for one transcript, rendered by the model's own template.

    The answer stage tokenizes it with its own input processor, which adds the tokenizer's
    special tokens; a BOS the template already wrote is dropped here so it is not doubled.
    """
    text = tokenizer.apply_chat_template(chat_messages(transcript), add_generation_prompt=True, tokenize=False)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos) and tokenizer.encode("a", add_special_tokens=True)[:1] == [tokenizer.bos_token_id]:
        text = text[len(bos):]
    return text


def transcript_to_chat(source_outputs: list[Any], prompt: Any = None, requires_multimodal_data: bool = False,
                       *, target_model_config: Any = None) -> list[dict[str, str]]:
    """Stage 1's input processor: each transcript -> the text model's chat prompt (text).

    Text, not token ids: vLLM-Omni hands a token-id prompt to the next stage as it is, but
    runs a text prompt through that stage's own input processor, which gives the request
    the model's end-of-turn token (eos, generation_config) as a stop. With token ids the
    answer ran past ``<|im_end|>`` into an invented next turn.
    """
    if target_model_config is None:
        raise ValueError("spoken_question: the answer stage's model config was not passed")
    tokenizer = _tokenizer(str(getattr(target_model_config, "tokenizer", None) or target_model_config.model))
    prompts = []
    for output in source_outputs:
        transcript = output.outputs[0].text or ""
        logger.info("spoken_question: request %s transcript %r", getattr(output, "request_id", "?"), transcript)
        prompts.append({"prompt": chat_text(tokenizer, transcript)})
    return prompts


# --- the pipeline root -------------------------------------------------------------------


def _link_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for item in sorted(src.iterdir()):
        if item.is_file():
            os.symlink(item.resolve(), dst / item.name)


def build_pipeline_dir(asr_dir: str | Path, answer_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """A pipeline root vLLM-Omni serves: ``config.json`` (model type), ``asr/`` and ``answer/``.

    The subdirectories hold links to the checkpoints' files (no copies), and ``asr/``
    also the chat template stage 0's renderer needs. Content-addressed by the two
    checkpoint paths, so the same pair always gives the same root.
    """
    from vllm_omni_edge.atomic import atomic_directory

    asr, answer = Path(asr_dir).resolve(), Path(answer_dir).resolve()
    for label, path in (("Whisper", asr), ("text model", answer)):
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{label} checkpoint {path} has no config.json")
    if out_dir is None:
        from vllm_omni_edge.cache_paths import cache_root

        out_dir = cache_root() / "omni"
    key = hashlib.sha256(f"{LAYOUT_VERSION}\0{asr}\0{answer}".encode()).hexdigest()[:12]
    out = Path(out_dir) / f"spoken-question-{answer.name}-{key}"
    if (out / "config.json").is_file():
        return out
    with atomic_directory(out) as tmp:
        tmp = Path(tmp)
        _link_files(asr, tmp / ASR_SUBDIR)
        (tmp / ASR_SUBDIR / "chat_template.jinja").write_text(ASR_CHAT_TEMPLATE)
        _link_files(answer, tmp / ANSWER_SUBDIR)
        (tmp / "config.json").write_text(json.dumps({
            "model_type": MODEL_TYPE,
            "asr": str(asr),
            "answer": str(answer),
            "layout_version": LAYOUT_VERSION,
        }, indent=2) + "\n")
    return out
