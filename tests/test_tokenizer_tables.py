"""tokenizer_tables: vLLM's tokenizers drop transformers' Python vocabulary/merges, and still save."""

from __future__ import annotations

import copy
import inspect
import json

import pytest

from vllm_omni_edge.patches.frontend import tokenizer_tables as patch

TEXT = "low lower lowest newer"


def _bpe_tokenizer(cls_name="Qwen2Tokenizer"):
    """A tokenizer of a class that keeps Python tables (Qwen2, Whisper) on a tiny BPE vocabulary."""
    import transformers

    letters = sorted(set("lowernstĠ"))
    vocab = {c: i for i, c in enumerate(letters)}
    merges = [("l", "o"), ("lo", "w"), ("e", "r"), ("Ġ", "low"), ("n", "e"), ("ne", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    return getattr(transformers, cls_name)(vocab=dict(vocab), merges=list(merges)), vocab, merges


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(patch, "counts", {"tokenizers": 0, "vocab_entries": 0, "merges": 0, "vocabs_shared": 0})
    monkeypatch.setattr(patch, "_vocab_owners", [])


def test_tables_are_dropped_and_the_tokens_stay(fresh):
    tokenizer, vocab, merges = _bpe_tokenizer()
    before = tokenizer(TEXT)["input_ids"]
    assert tokenizer._vocab == vocab and tokenizer._merges == merges
    assert patch.drop_tables(tokenizer)
    assert tokenizer._vocab is None and tokenizer._merges is None
    assert tokenizer(TEXT)["input_ids"] == before
    assert tokenizer.decode(before) == tokenizer.backend_tokenizer.decode(before)
    assert tokenizer.get_vocab()["low"] == vocab["low"]
    assert patch.record() == {"tokenizers": 1, "vocab_entries": len(vocab), "merges": len(merges), "vocabs_shared": 0}
    assert not patch.drop_tables(tokenizer)  # nothing left to drop
    assert copy.deepcopy(tokenizer)._vocab is None  # the renderer pool's copies carry none


def test_a_dropped_tokenizer_saves_the_tables_it_was_built_from(fresh, tmp_path):
    from transformers import AutoTokenizer

    tokenizer, vocab, merges = _bpe_tokenizer("WhisperTokenizer")  # its save_vocabulary reads the tables
    patch.drop_tables(tokenizer)
    files = tokenizer.save_vocabulary(str(tmp_path))
    assert {"merges.txt", "vocab.json"} <= {p.rsplit("/", 1)[-1] for p in files}
    assert json.loads((tmp_path / "vocab.json").read_text()) == vocab
    saved_merges = (tmp_path / "merges.txt").read_text().splitlines()
    assert [tuple(line.split(" ")) for line in saved_merges if not line.startswith("#")] == merges
    tokenizer.save_pretrained(str(tmp_path / "whole"))
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path / "whole"))
    assert reloaded(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]


def test_tokenizers_without_tables_are_untouched(fresh):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    assert not patch.drop_tables(plain)
    assert patch.record()["tokenizers"] == 0


def test_vllms_cached_tokenizer_goes_through_the_drop(fresh):
    from types import SimpleNamespace

    from vllm.tokenizers import hf

    module = SimpleNamespace(get_cached_tokenizer=inspect.unwrap(hf.get_cached_tokenizer))
    patch._wrap(module)
    patch._wrap(module)  # idempotent
    assert not getattr(module.get_cached_tokenizer.__wrapped__, patch.MARKER, False)
    tokenizer, _, _ = _bpe_tokenizer()
    ids = tokenizer(TEXT)["input_ids"]
    cached = module.get_cached_tokenizer(tokenizer)
    assert cached._vocab is None and tokenizer._vocab is None
    assert cached(TEXT)["input_ids"] == ids
    assert patch.record()["tokenizers"] == 1


def _unwrapped_get_cached_tokenizer():
    from vllm.tokenizers import hf

    return inspect.unwrap(hf.get_cached_tokenizer)  # under the plugin's wrappers, if applied


def test_copies_of_a_cached_tokenizer_share_one_vocabulary_dict(fresh, monkeypatch):
    from vllm.tokenizers import hf

    monkeypatch.setattr(hf, "get_cached_tokenizer", _unwrapped_get_cached_tokenizer())
    patch._wrap(hf)  # as the plugin does: copies rebuild through the module's function
    tokenizer, vocab, _ = _bpe_tokenizer()
    cached = hf.get_cached_tokenizer(tokenizer)
    shallow, deep = copy.copy(cached), copy.deepcopy(cached)  # what the renderer and its pool make
    assert shallow.get_vocab() is cached.get_vocab() and deep.get_vocab() is cached.get_vocab()
    assert cached.get_vocab() == {**vocab, **{t: i for t, i in cached.get_added_vocab().items()}}
    assert deep(TEXT)["input_ids"] == cached(TEXT)["input_ids"]
    assert patch.record()["vocabs_shared"] == 2
    # A tokenizer of another vocabulary keeps its own dict.
    other, _, _ = _bpe_tokenizer()
    other.add_tokens(["zzz"])
    assert hf.get_cached_tokenizer(other).get_vocab() is not cached.get_vocab()
    assert patch.record()["vocabs_shared"] == 2


def test_without_the_patch_each_copy_builds_its_own_dict(fresh, monkeypatch):
    from vllm.tokenizers import hf

    monkeypatch.setattr(hf, "get_cached_tokenizer", _unwrapped_get_cached_tokenizer())
    tokenizer, _, _ = _bpe_tokenizer()
    cached = hf.get_cached_tokenizer(tokenizer)
    assert copy.copy(cached).get_vocab() is not cached.get_vocab()  # the control for the test above


def test_a_dead_tokenizer_does_not_keep_its_vocabulary(fresh, monkeypatch):
    import gc
    import weakref

    from vllm.tokenizers import hf

    monkeypatch.setattr(hf, "get_cached_tokenizer", _unwrapped_get_cached_tokenizer())
    patch._wrap(hf)
    tokenizer, _, _ = _bpe_tokenizer()
    cached = hf.get_cached_tokenizer(tokenizer)
    owner = weakref.ref(type(cached))
    del cached, tokenizer
    gc.collect()
    assert owner() is None
    second, _, _ = _bpe_tokenizer()
    hf.get_cached_tokenizer(second)
    assert patch.record()["vocabs_shared"] == 0 and len(patch._vocab_owners) == 1


def test_the_flag_keeps_them(monkeypatch):
    called = []
    monkeypatch.setattr(patch, "when_imported", lambda *a: called.append(a) or True)
    monkeypatch.setenv("VLLM_OMNI_EDGE_TOKENIZER_TABLES", "keep")
    assert "keep" in patch.apply() and called == []
    monkeypatch.setenv("VLLM_OMNI_EDGE_TOKENIZER_TABLES", "drop")
    assert "drop" in patch.apply() and [name for name, _ in called] == [patch.TARGET_MODULE]


def test_the_evidence_carries_the_counts(monkeypatch):
    from vllm_omni_edge import evidence

    monkeypatch.setattr(patch, "counts", {"tokenizers": 2, "vocab_entries": 10, "merges": 5})
    assert evidence._tokenizer_tables() == {"tokenizers": 2, "vocab_entries": 10, "merges": 5}
