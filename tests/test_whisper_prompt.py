"""patches/frontend/whisper_prompt.py: a transcription prompt goes first, after <|startofprev|>,
with no start token put in front of it; an empty verbose_json output parses to no segment."""

from __future__ import annotations

import re
import types

import numpy as np
import pytest

from vllm_omni_edge.patches.frontend import whisper_prompt as patch

TASK = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
EOS, SOT, PREV, TS0 = 50257, 50258, 50361, 50364  # whisper-base's <|endoftext|>, <|startoftranscript|>,
# <|startofprev|>, <|0.00|>


class _WordTokenizer:
    """One token per word with its leading space; decode joins them back."""

    def encode(self, text, add_special_tokens=True):
        return re.findall(r" ?\S+", text)

    def decode(self, ids, skip_special_tokens=False):
        return "".join(ids)


def _unwrapped(function):
    """vLLM's own function, also when the plugin already patched it in this process."""
    return getattr(function, "__wrapped__", function)


@pytest.fixture
def whisper_cls(monkeypatch):
    """vLLM's Whisper class, wrapped twice (idempotent) on a subclass so vLLM's own stays as it is."""
    import vllm.tokenizers
    from vllm.model_executor.models.whisper import WhisperForConditionalGeneration

    stock = _unwrapped(WhisperForConditionalGeneration.get_generation_prompt.__func__)
    cls = type("Whisper", (WhisperForConditionalGeneration,), {"get_generation_prompt": classmethod(stock)})
    for _ in range(2):
        patch._wrap_prompt(cls)
    assert cls.get_generation_prompt.__func__.__wrapped__ is stock
    monkeypatch.setattr(vllm.tokenizers, "cached_tokenizer_from_config", lambda model_config: model_config.tokenizer)
    return cls


def _decoder_text(cls, prompt, tokenizer=None, max_model_len=448):
    from vllm.config.speech_to_text import SpeechToTextConfig, SpeechToTextParams

    model_config = types.SimpleNamespace(max_model_len=max_model_len, tokenizer=tokenizer or _WordTokenizer())
    params = SpeechToTextParams(audio=np.zeros(16000, np.float32), stt_config=SpeechToTextConfig(),
                                model_config=model_config, language="en", request_prompt=prompt)
    result = cls.get_generation_prompt(params)
    assert result["encoder_prompt"]["multi_modal_data"]["audio"][0] is params.audio
    assert params.request_prompt == prompt  # the caller's parameters are not changed
    return result["decoder_prompt"]["prompt"]


def test_the_prompt_follows_startofprev_with_one_space(whisper_cls):
    assert _decoder_text(whisper_cls, "An office memo.") == "<|startofprev|> An office memo." + TASK
    assert _decoder_text(whisper_cls, "  An office memo. \n") == "<|startofprev|> An office memo." + TASK
    assert _decoder_text(whisper_cls, "") == TASK
    assert _decoder_text(whisper_cls, "  ") == TASK


def test_a_long_prompt_keeps_its_last_tokens(whisper_cls):
    words = [f"w{i}" for i in range(600)]
    text = _decoder_text(whisper_cls, " ".join(words))
    kept = text.removeprefix("<|startofprev|>").removesuffix(TASK)
    assert kept == " " + " ".join(words[-(448 // 2 - 1):])  # half the decoder less one, as OpenAI's Whisper
    kept = _decoder_text(whisper_cls, " ".join(words), max_model_len=100).removeprefix("<|startofprev|>")
    assert kept.removesuffix(TASK).split() == words[-(100 // 2 - 1):]


def _whisper_base_tokenizer():
    from vllm_omni_edge.models.default_model import WHISPER_BASE, model_dir

    path = model_dir(WHISPER_BASE)
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"whisper-base is not pulled ({path}); vllm-omni-edge models pull whisper-base")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture
def engine_inputs(monkeypatch):
    """vllm.inputs.engine with the decoder-start wrapper on (twice: idempotent), undone after the test."""
    from vllm.inputs import engine

    stock = _unwrapped(engine._prepare_decoder_input_ids_for_generation)
    monkeypatch.setattr(engine, "_prepare_decoder_input_ids_for_generation", stock)
    for _ in range(2):
        patch._wrap_decoder_start(engine)
    assert engine._prepare_decoder_input_ids_for_generation.__wrapped__ is stock
    return engine


def _engine_decoder_ids(engine, ids):
    """The decoder tokens vLLM's renderer hands the engine for a decoder prompt of ``ids``."""
    built = engine.build_enc_dec_input(engine.tokens_input([]), engine.tokens_input(list(ids)), SOT)
    return built["decoder_prompt"]["prompt_token_ids"]


def test_a_decoder_prompt_holding_its_start_token_is_kept(engine_inputs):
    prompt = [PREV, 1107, 3398, SOT, 50259, 50359, 50363]
    assert engine_inputs._prepare_decoder_input_ids_for_generation.__wrapped__(prompt, SOT)[:2] == [SOT, PREV]
    assert _engine_decoder_ids(engine_inputs, prompt) == prompt
    assert _engine_decoder_ids(engine_inputs, [SOT, 50259]) == [SOT, 50259]
    assert _engine_decoder_ids(engine_inputs, [50259, 50359]) == [SOT, 50259, 50359]  # vLLM's rule otherwise
    assert _engine_decoder_ids(engine_inputs, []) == [SOT]


def test_the_tokens_are_transformers_prompt_ids_then_vllms(whisper_cls, engine_inputs):
    tokenizer = _whisper_base_tokenizer()
    text = _decoder_text(whisper_cls, "An office memo.", tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)  # as vLLM's renderer tokenizes Whisper prompts
    task = tokenizer.encode(TASK, add_special_tokens=False)
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("<|startofprev|>", "<|startoftranscript|>")] == [PREV, SOT]
    assert _engine_decoder_ids(engine_inputs, ids) == list(tokenizer.get_prompt_ids("An office memo.")) + task


def test_vllm_alone_splits_its_prev_marker_into_text():
    """What the patch is for: vLLM's own prompt names a token Whisper does not have."""
    from vllm.config.speech_to_text import SpeechToTextConfig, SpeechToTextParams
    from vllm.model_executor.models.whisper import WhisperForConditionalGeneration

    original = _unwrapped(WhisperForConditionalGeneration.get_generation_prompt.__func__)
    params = SpeechToTextParams(audio=np.zeros(16000, np.float32), stt_config=SpeechToTextConfig(),
                                model_config=None, language="en", request_prompt="An office memo.")
    assert original(WhisperForConditionalGeneration, params)["decoder_prompt"]["prompt"] == \
        "<|prev|>An office memo." + TASK


class _SegmentTokenizer:
    eos_token_id = EOS

    def encode(self, text, add_special_tokens=True):
        assert text == "<|0.00|>"
        return [TS0]

    def decode(self, ids):
        return " " + " ".join(f"t{i}" for i in ids)


def _segments(method, tokens):
    from vllm.entrypoints.speech_to_text.transcription.protocol import TranscriptionSegment
    from vllm.logprobs import Logprob

    serving = types.SimpleNamespace(tokenizer=_SegmentTokenizer())
    log_probs = [{t: Logprob(logprob=-0.5)} for t in tokens]
    return method(serving, tokens=tuple(tokens), log_probs=log_probs,
                  request=types.SimpleNamespace(temperature=0.0), segment_class=TranscriptionSegment, start_time=0)


@pytest.fixture
def serving_cls():
    from vllm.entrypoints.speech_to_text.base.serving import SpeechToTextBaseServing

    stock = _unwrapped(SpeechToTextBaseServing._get_verbose_segments)
    cls = type("Serving", (SpeechToTextBaseServing,), {"_get_verbose_segments": stock})
    for _ in range(2):
        patch._wrap_segments(cls)
    assert cls._get_verbose_segments.__wrapped__ is stock
    return cls


@pytest.mark.parametrize("tokens", [(), (EOS,)])
def test_an_empty_output_is_no_segment(serving_cls, tokens):
    with pytest.raises(IndexError):  # vLLM alone: "tuple index out of range", a 500
        _segments(serving_cls._get_verbose_segments.__wrapped__, tokens)
    assert _segments(serving_cls._get_verbose_segments, tokens) == []


def test_an_output_with_timestamps_is_still_parsed_by_vllm(serving_cls):
    [segment] = _segments(serving_cls._get_verbose_segments, (2555, 917, 13, TS0 + 175, EOS))
    assert (segment.start, segment.end, segment.tokens) == (0.0, 3.5, [2555, 917, 13])
    assert segment.text == " t2555 t917 t13"
