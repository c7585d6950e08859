"""tokenizer_copies: a shallow copy of a vLLM cached tokenizer reuses the cache built for it."""

from __future__ import annotations

import copy
import inspect

import pytest

from vllm_omni_edge.patches.frontend import tokenizer_copies as patch

TEXT = "low lower lowest newer"


def _bpe_tokenizer():
    import transformers

    letters = sorted(set("lowernstĠ"))
    vocab = {c: i for i, c in enumerate(letters)}
    merges = [("l", "o"), ("lo", "w"), ("e", "r"), ("Ġ", "low"), ("n", "e"), ("ne", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    return transformers.Qwen2Tokenizer(vocab=dict(vocab), merges=list(merges))


@pytest.fixture
def hf(monkeypatch):
    """vLLM's module with vLLM's own function under our wrapper only (as the plugin wraps it)."""
    from vllm.tokenizers import hf

    monkeypatch.setattr(hf, "get_cached_tokenizer", inspect.unwrap(hf.get_cached_tokenizer))
    monkeypatch.setattr(patch, "_cached", {})
    monkeypatch.setattr(patch, "counts", {"built": 0, "reused": 0})
    patch._wrap(hf)
    return hf


def test_a_shallow_copy_reuses_the_cache_and_is_a_new_object(hf):
    tokenizer = _bpe_tokenizer()
    cached = hf.get_cached_tokenizer(tokenizer)
    shallow = copy.copy(cached)  # CachedTokenizer.__reduce__ -> get_cached_tokenizer(tokenizer)
    assert shallow is not cached and type(shallow) is type(cached)
    assert shallow.get_vocab() is cached.get_vocab()
    assert len(shallow) == len(cached) and shallow.max_token_id == cached.max_token_id
    assert shallow.all_special_ids == cached.all_special_ids
    assert shallow(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    shallow.truncation_side = "left"  # the copy's own attributes, as vLLM's copy has
    assert cached.truncation_side == "right"
    assert patch.record() == {"built": 1, "reused": 1}


def test_the_reused_copy_equals_what_vllm_builds(hf):
    tokenizer = _bpe_tokenizer()
    cached = hf.get_cached_tokenizer(tokenizer)
    reused = copy.copy(cached)
    built = inspect.unwrap(hf.get_cached_tokenizer)(tokenizer)
    for name in ("all_special_ids", "all_special_tokens", "max_token_id", "max_chars_per_token", "is_fast"):
        assert getattr(reused, name) == getattr(built, name), name
    assert reused.get_vocab() == built.get_vocab() and len(reused) == len(built)
    assert vars(reused).keys() == vars(built).keys()


def test_a_new_token_or_special_token_is_cached_anew(hf):
    tokenizer = _bpe_tokenizer()
    cached = hf.get_cached_tokenizer(tokenizer)
    tokenizer.add_tokens(["zzz"])
    grown = copy.copy(cached)
    assert type(grown) is not type(cached) and "zzz" in grown.get_vocab() and len(grown) == len(cached) + 1
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    padded = copy.copy(grown)
    assert tokenizer.pad_token_id in padded.all_special_ids
    assert tokenizer.pad_token_id not in grown.all_special_ids
    assert patch.record() == {"built": 3, "reused": 0}


def test_a_deep_copy_is_built_by_vllm(hf):
    tokenizer = _bpe_tokenizer()
    cached = hf.get_cached_tokenizer(tokenizer)
    deep = copy.deepcopy(cached)  # a new underlying tokenizer: nothing to reuse
    assert type(deep) is not type(cached)
    assert deep(TEXT)["input_ids"] == cached(TEXT)["input_ids"]
    assert patch.record() == {"built": 2, "reused": 0}


def test_a_dead_tokenizer_leaves_nothing_behind(hf):
    import gc

    tokenizer = _bpe_tokenizer()
    hf.get_cached_tokenizer(tokenizer)
    assert len(patch._cached) == 1
    del tokenizer
    gc.collect()
    assert patch._cached == {}


def test_the_renderer_start_builds_once(hf):
    """HfRenderer's copy and its pool's copies (vLLM's maybe_make_thread_pool) of one loaded tokenizer."""
    from vllm_omni_edge.patches.frontend import tokenizer_pool

    cached = hf.get_cached_tokenizer(_bpe_tokenizer())
    renderer_copy = copy.copy(cached)
    inspect.unwrap(hf.maybe_make_thread_pool)(renderer_copy, tokenizer_pool.UP_FRONT_COPIES)
    assert renderer_copy(TEXT)["input_ids"] == cached(TEXT)["input_ids"]
    # the renderer's and the pool's shallow copies reused; the pool's deep copy built anew
    assert patch.record() == {"built": 2, "reused": 2}


def test_idempotent():
    from types import SimpleNamespace

    def original(tokenizer):
        return tokenizer

    module = SimpleNamespace(get_cached_tokenizer=original)
    patch._wrap(module)
    wrapped = module.get_cached_tokenizer
    patch._wrap(module)
    assert module.get_cached_tokenizer is wrapped and wrapped.__wrapped__ is original


def test_the_flag_rebuilds(monkeypatch):
    called = []
    monkeypatch.setattr(patch, "when_imported", lambda *a: called.append(a) or True)
    monkeypatch.setenv("VLLM_OMNI_EDGE_TOKENIZER_COPIES", "rebuild")
    assert "rebuild" in patch.apply() and called == []
    monkeypatch.setenv("VLLM_OMNI_EDGE_TOKENIZER_COPIES", "reuse")
    assert "reuse" in patch.apply() and [name for name, _ in called] == [patch.TARGET_MODULE]


def test_the_evidence_carries_the_counts(monkeypatch):
    from vllm_omni_edge import evidence

    monkeypatch.setattr(patch, "counts", {"built": 1, "reused": 2})
    assert evidence._tokenizer_copies() == {"built": 1, "reused": 2}
