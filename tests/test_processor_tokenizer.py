"""processor_tokenizer: the HF processors vLLM builds share one tokenizer per model directory."""

from __future__ import annotations


import pytest

from vllm_omni_edge.patches.frontend import processor_tokenizer as patch


def _save_processor(path):
    """A processor directory as a Whisper checkpoint has one: feature extractor and tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, WhisperFeatureExtractor, WhisperProcessor

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "edge": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=8),
                     tokenizer=tokenizer).save_pretrained(str(path))
    return str(path)


@pytest.fixture
def loads(monkeypatch, tokenizer_file_reads):
    """The patch installed (twice: idempotent) on fresh state, with tokenizer file reads counted."""
    import transformers.processing_utils as processing_utils
    from vllm.tokenizers import hf

    monkeypatch.setattr(patch, "_shared", {})
    monkeypatch.setattr(patch, "counts", {"loaded": 0, "passed_in": 0, "reused": 0})
    for _ in range(2):
        patch._wrap(processing_utils)
        patch._wrap_vllm(hf)
    return tokenizer_file_reads


def _processor(path, **kwargs):
    from vllm.transformers_utils.processor import get_processor

    return get_processor(path, **kwargs)


def _ours_in_chain(function) -> int:
    """How many of the wrappers around ``function`` (``__wrapped__`` chain) this patch made.

    Other patches may wrap the same method on top (tokenizer_load_once wraps ``from_pretrained``);
    ``functools.wraps`` copies the marker onto their wrappers, so count this module's code.
    """
    count = 0
    while function is not None:
        count += function.__code__.co_filename == patch.__file__
        function = getattr(function, "__wrapped__", None)
    return count


def test_the_patch_is_installed_once():
    import transformers.processing_utils as processing_utils
    from vllm.tokenizers import hf
    from vllm_omni_edge.patches.frontend import tokenizer_load_once

    for _ in range(2):
        patch._wrap(processing_utils)
        patch._wrap_vllm(hf)
    method = processing_utils.ProcessorMixin.__dict__[patch.METHOD].__func__
    assert getattr(method, patch.MARKER) and _ours_in_chain(method) == 1
    tokenizer_load_once._wrap(hf)  # another patch on the same classmethod, as the plugin stacks them
    patch._wrap_vllm(hf)
    loader = hf.CachedHfTokenizer.__dict__["from_pretrained"].__func__
    assert getattr(loader, patch.MARKER) and _ours_in_chain(loader) == 1


def test_processors_of_one_directory_read_its_tokenizer_once(loads, tmp_path):
    path = _save_processor(tmp_path / "model")
    first, second = _processor(path), _processor(path)
    assert first is not second
    assert second.tokenizer is first.tokenizer
    assert loads == [path]
    assert patch.record() == {"loaded": 1, "passed_in": 0, "reused": 1}
    assert first.tokenizer("hello edge")["input_ids"] == [1, 2]


def test_a_tokenizer_passed_in_is_used_without_reading_the_files(loads, tmp_path):
    path = _save_processor(tmp_path / "model")
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(path)
    loads.clear()
    given = _processor(path, tokenizer=own)
    later = _processor(path)  # built without one (vLLM's dynamic-kwargs step): gets the same
    assert given.tokenizer is own and later.tokenizer is own
    assert loads == []
    assert patch.record() == {"loaded": 0, "passed_in": 1, "reused": 1}


def test_vllms_own_tokenizer_is_the_one_processors_share(loads, tmp_path):
    from vllm.tokenizers.hf import CachedHfTokenizer

    path = _save_processor(tmp_path / "model")
    vllm_tokenizer = CachedHfTokenizer.from_pretrained(path, revision=None)
    processor = _processor(path)  # vLLM's processor loader passes revision "main"
    assert processor.tokenizer is vllm_tokenizer
    assert loads == [path]  # vLLM's read only


def test_other_directories_and_sub_tokenizers_load_their_own(loads, tmp_path):
    a, b = _save_processor(tmp_path / "a"), _save_processor(tmp_path / "b")
    assert _processor(a).tokenizer is not _processor(b).tokenizer
    assert loads == [a, b]
    import transformers.processing_utils as processing_utils

    shared = patch._shared[(a, "", "main")]
    secondary = processing_utils.ProcessorMixin._load_tokenizer_from_pretrained("decoder_tokenizer", a)
    assert secondary is not shared and loads[2:]  # read from the files (transformers' fallback: the root)


def test_the_flag_turns_it_off(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_PROCESSOR_TOKENIZER", "0")
    called = []
    monkeypatch.setattr(patch, "when_imported", lambda *a: called.append(a) or True)
    assert "transformers loads" in patch.apply()
    assert called == []
    monkeypatch.setenv("VLLM_OMNI_EDGE_PROCESSOR_TOKENIZER", "1")
    assert "share" in patch.apply()
    assert [name for name, _ in called] == [patch.TARGET_MODULE, patch.VLLM_TOKENIZERS]


def test_the_evidence_carries_the_counts(monkeypatch):
    from vllm_omni_edge import evidence

    monkeypatch.setattr(patch, "counts", {"loaded": 1, "passed_in": 2, "reused": 3})
    assert evidence._processor_tokenizers() == {"loaded": 1, "passed_in": 2, "reused": 3}


