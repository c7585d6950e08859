"""tokenizer_pool: vLLM's renderer pool starts with one tokenizer copy and grows on demand."""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace

import pytest

from vllm_omni_edge.patches.frontend import tokenizer_pool as patch


def _tokenizer(cls=None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "edge": 2, "box": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return (cls or PreTrainedTokenizerFast)(tokenizer_object=backend, unk_token="[UNK]")


@pytest.fixture
def pooled(monkeypatch):
    """vLLM's own maybe_make_thread_pool behind our wrapper, with deep copies counted."""
    from vllm.tokenizers import hf

    monkeypatch.setattr(patch, "pools", [])
    module = SimpleNamespace(maybe_make_thread_pool=hf.maybe_make_thread_pool)
    patch._wrap(module)
    patch._wrap(module)  # idempotent
    from transformers import TokenizersBackend

    copies = []
    deepcopy = copy.deepcopy

    def counted(obj, *args, **kwargs):
        if isinstance(obj, TokenizersBackend):  # a whole tokenizer, not one of its parts
            copies.append(type(obj).__name__)
        return deepcopy(obj, *args, **kwargs)

    monkeypatch.setattr(hf.copy, "deepcopy", counted)
    return SimpleNamespace(make=module.maybe_make_thread_pool, copies=copies)


def test_one_copy_up_front_and_the_same_tokens(pooled):
    from transformers import TokenizersBackend

    plain = _tokenizer()
    assert isinstance(plain, TokenizersBackend)  # what vLLM pools
    tok = pooled.make(_tokenizer(), 2)  # vLLM's default: renderer_num_workers + 1
    assert len(pooled.copies) == 1
    assert patch.record() == [{"asked": 2, "made_up_front": 1}]
    assert tok.encode("hello edge box") == plain.encode("hello edge box")
    assert tok.decode([1, 2, 3]) == plain.decode([1, 2, 3])
    assert len(pooled.copies) == 1  # one user at a time: no more copies


def test_a_thread_finding_the_pool_busy_gets_its_own_copy(pooled):
    from transformers import PreTrainedTokenizerFast

    both_inside = threading.Barrier(2, timeout=30)

    class Slow(PreTrainedTokenizerFast):
        def encode(self, *args, **kwargs):
            both_inside.wait()  # both threads hold a copy at once
            return super().encode(*args, **kwargs)

    tok = pooled.make(_tokenizer(Slow), 2)
    results = []
    threads = [threading.Thread(target=lambda: results.append(tok.encode("edge box"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [[2, 3], [2, 3]]
    assert len(pooled.copies) == 2  # the second copy was made when it was needed
    assert tok.decode([2]) == "edge"  # later lone calls take a kept copy: no new one
    assert len(pooled.copies) == 2


def test_fewer_asked_for_is_left_alone(pooled):
    pooled.make(_tokenizer(), 1)
    assert len(pooled.copies) == 1
    assert patch.record() == [{"asked": 1, "made_up_front": 1}]


def test_the_flag_keeps_vllms_copies_and_still_counts_them(pooled, monkeypatch):
    from vllm_omni_edge.levers import LeverFlagError

    monkeypatch.setattr(patch, "up_front_limit", patch.UP_FRONT_COPIES)
    monkeypatch.setenv("VLLM_OMNI_EDGE_TOKENIZER_POOL", "vllm")
    assert "vLLM's up-front" in patch.apply()
    pooled.make(_tokenizer(), 2)
    assert len(pooled.copies) == 2
    assert patch.record() == [{"asked": 2, "made_up_front": 2}]
    monkeypatch.setenv("VLLM_OMNI_EDGE_TOKENIZER_POOL", "none")
    with pytest.raises(LeverFlagError, match="VLLM_OMNI_EDGE_TOKENIZER_POOL"):
        patch.apply()


def test_the_renderer_calls_the_name_we_replace():
    import inspect

    from vllm.renderers import hf

    assert "maybe_make_thread_pool(" in inspect.getsource(hf.HfRenderer.__init__)
