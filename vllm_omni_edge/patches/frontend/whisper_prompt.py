"""A transcription ``prompt`` reaches Whisper as the previous text it was trained on.

What: wraps ``WhisperForConditionalGeneration.get_generation_prompt``: vLLM builds the decoder
prompt without the request's prompt, and the prompt is put in front as OpenAI's Whisper lays it
out: ``<|startofprev|>``, one space, the prompt stripped, then vLLM's
``<|startoftranscript|><|lang|><|task|>...``; a prompt longer than half the decoder's
``max_model_len`` keeps its last tokens (as OpenAI's ``transcribe`` and faster-whisper do).
Wraps ``vllm.inputs.engine._prepare_decoder_input_ids_for_generation`` so that a decoder prompt
already holding the decoder start token is left as it is (transformers' Whisper generation does
not put a second start token in front of the previous text).
Wraps ``SpeechToTextBaseServing._get_verbose_segments`` so that an output with no token before
the end of text gives no segment instead of raising.
Why: vLLM writes ``<|prev|>``, which is not a Whisper token: the tokenizer splits it into text
tokens (``<``, ``|``, ``pre``, ``v``, ``|``, ``>``) glued to the prompt, and the decoder reads
them as speech already transcribed and stops after a few words or loops. With ``response_format=verbose_json`` the same prompt
made the model end at once, and vLLM's segment parser indexes the last two tokens of
``(<|0.00|>,) + output``: an empty output raised "tuple index out of range", a 500. With the
right token the decoder prompt still did not start with ``<|startoftranscript|>``, so vLLM put
one in front of ``<|startofprev|>``, a layout Whisper never saw: longer prompts still cut the
transcript short. A prompt longer than the decoder's positions was refused (a 400).
Verified by: tests/test_whisper_prompt.py (the decoder prompt's tokens are transformers'
``get_prompt_ids`` followed by vLLM's own, with no start token put in front; the cut; an empty
output parses to no segment); tests/e2e/test_whisper_serve.py (``prompt`` with json and
verbose_json, and a long prompt).
Remove when: vLLM's Whisper prompt uses ``<|startofprev|>`` (vLLM issue 53206), vLLM keeps a
decoder prompt that holds its start token, and its segment parser accepts an empty output.
"""

from __future__ import annotations

import dataclasses

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_classmethod_once, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

WHISPER = "vllm.model_executor.models.whisper"
SERVING = "vllm.entrypoints.speech_to_text.base.serving"
ENGINE_INPUTS = "vllm.inputs.engine"
START_OF_PREV = "<|startofprev|>"

RECORD = PatchRecord(
    name="whisper_prompt",
    kind=Kind.FIX,
    target="vllm.model_executor.models.whisper.WhisperForConditionalGeneration.get_generation_prompt; "
    "vllm.inputs.engine._prepare_decoder_input_ids_for_generation; "
    "vllm.entrypoints.speech_to_text.base.serving.SpeechToTextBaseServing._get_verbose_segments",
    process=Process.FRONTEND,
    why="vLLM puts a transcription prompt after '<|prev|>', not a Whisper token (it becomes text), and "
    "puts <|startoftranscript|> in front of it, so Whisper stops after a few words; with verbose_json "
    "it ended at once and the segment parser raised IndexError (a 500).",
    verified_by="tests/test_whisper_prompt.py; tests/e2e/test_whisper_serve.py "
    "(prompt with json and verbose_json, a long prompt).",
    remove_when="vLLM's Whisper prompt uses <|startofprev|> with no start token before it, and its "
    "segment parser accepts an empty output.",
    upstream="https://github.com/vllm-project/vllm/issues/53206",
)


def previous_text(prompt: str, tokenizer, max_tokens: int) -> str:
    """The decoder text a request prompt becomes: ``<|startofprev|>`` and at most its last
    ``max_tokens`` tokens, led by one space; "" for an empty prompt."""
    text = " " + prompt.strip()
    if text == " ":
        return ""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) > max_tokens:
        text = tokenizer.decode(ids[-max_tokens:])
    return START_OF_PREV + text


def apply() -> str:
    when_imported(WHISPER, lambda m: _wrap_prompt(m.WhisperForConditionalGeneration))
    when_imported(SERVING, lambda m: _wrap_segments(m.SpeechToTextBaseServing))
    when_imported(ENGINE_INPUTS, _wrap_decoder_start)
    return "Whisper transcription prompts go first, after <|startofprev|>; an empty verbose_json output has no segment"


def _wrap_prompt(model_cls) -> None:
    def make(original):
        def get_generation_prompt(cls, stt_params):
            result = original(cls, dataclasses.replace(stt_params, request_prompt=""))
            if stt_params.request_prompt:
                from vllm.tokenizers import cached_tokenizer_from_config

                model_config = stt_params.model_config
                prefix = previous_text(stt_params.request_prompt, cached_tokenizer_from_config(model_config),
                                       model_config.max_model_len // 2 - 1)
                result["decoder_prompt"]["prompt"] = prefix + result["decoder_prompt"]["prompt"]
            return result

        return get_generation_prompt

    wrap_classmethod_once(model_cls, "get_generation_prompt", make)


def _wrap_segments(serving_cls) -> None:
    def make_wrapper(original):
        def wrapper(self, tokens, *args, **kwargs):
            if not tokens or tuple(tokens) == (self.tokenizer.eos_token_id,):
                return []
            return original(self, tokens, *args, **kwargs)

        return wrapper

    wrap_method_once(serving_cls, "_get_verbose_segments", make_wrapper)


def _wrap_decoder_start(module) -> None:
    original = module._prepare_decoder_input_ids_for_generation
    if getattr(original, "__edge_wrapped__", False):
        return

    def prepare(decoder_input_ids, decoder_start_token_id):
        if decoder_start_token_id in decoder_input_ids:
            return decoder_input_ids
        return original(decoder_input_ids, decoder_start_token_id)

    prepare.__edge_wrapped__ = True
    prepare.__wrapped__ = original
    module._prepare_decoder_input_ids_for_generation = prepare
