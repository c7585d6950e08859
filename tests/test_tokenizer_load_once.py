"""tokenizer_load_once: vLLM reads a tokenizer directory once per process and set of options."""

from __future__ import annotations

import pytest

from vllm_omni_edge.patches.frontend import tokenizer_load_once as patch


def _save_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "edge": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(str(path))
    return str(path)


@pytest.fixture
def reads(monkeypatch, tokenizer_file_reads):
    """The patch installed (twice: idempotent) on fresh state, with tokenizer file reads counted."""
    from vllm.tokenizers import hf

    monkeypatch.setattr(patch, "_loaded", {})
    monkeypatch.setattr(patch, "counts", {"loaded": 0, "reused": 0})
    monkeypatch.setattr(hf.CachedHfTokenizer, "from_pretrained", hf.CachedHfTokenizer.__dict__["from_pretrained"])
    for _ in range(2):
        patch._wrap(hf)
    return tokenizer_file_reads


def test_the_same_directory_and_options_give_the_same_tokenizer(reads, tmp_path):
    from vllm.tokenizers.registry import get_tokenizer

    path = _save_tokenizer(tmp_path / "tok")
    first = get_tokenizer(path)  # vLLM's uncached loader, as the speech endpoints call it
    second = get_tokenizer(path)
    assert second is first and reads == [path]
    assert first("hello edge")["input_ids"] == [1, 2]
    assert patch.record() == {"loaded": 1, "reused": 1}


def test_other_options_or_directories_load_anew(reads, tmp_path):
    from vllm.tokenizers.registry import get_tokenizer

    a, b = _save_tokenizer(tmp_path / "a"), _save_tokenizer(tmp_path / "b")
    left = get_tokenizer(a, truncation_side="left")
    assert get_tokenizer(a, truncation_side="right") is not left
    assert get_tokenizer(b) is not left
    assert get_tokenizer(a, truncation_side="left") is left
    assert reads == [a, a, b]


def test_without_the_patch_every_load_reads_the_files(tmp_path, monkeypatch, tokenizer_file_reads):
    from vllm.tokenizers import hf
    from vllm.tokenizers.registry import get_tokenizer

    method = hf.CachedHfTokenizer.__dict__["from_pretrained"]
    unwrapped = getattr(method.__func__, "__wrapped__", method.__func__)
    monkeypatch.setattr(hf.CachedHfTokenizer, "from_pretrained", classmethod(unwrapped))
    path = _save_tokenizer(tmp_path / "tok")
    assert get_tokenizer(path) is not get_tokenizer(path) and len(tokenizer_file_reads) == 2  # the control


def test_what_identifies_a_load():
    assert patch.load_key("/m", (), {"revision": None, "config": object()}) == ("/m", (("revision", None),))
    assert patch.load_key("/m", ("x",), {}) is None
    assert patch.load_key("/m", (), {"subfolder": "tok"}) is None
    assert patch.load_key("/m", (), {"extra": {"a": 1}}) == ("/m", (("extra", "{'a': 1}"),))


def test_the_flag_reads_every_time(monkeypatch):
    called = []
    monkeypatch.setattr(patch, "when_imported", lambda *a: called.append(a) or True)
    monkeypatch.setenv("VLLM_OMNI_EDGE_TOKENIZER_LOAD", "each")
    assert "each" in patch.apply() and called == []
    monkeypatch.setenv("VLLM_OMNI_EDGE_TOKENIZER_LOAD", "once")
    assert "once" in patch.apply() and [name for name, _ in called] == [patch.TARGET_MODULE]


def test_the_evidence_carries_the_counts(monkeypatch):
    from vllm_omni_edge import evidence

    monkeypatch.setattr(patch, "counts", {"loaded": 1, "reused": 2})
    assert evidence._tokenizer_loads() == {"loaded": 1, "reused": 2}
