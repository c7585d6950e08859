"""vLLM's tokenizers drop the Python copy of their vocabulary and merges, and share one cached vocabulary.

What: wraps ``vllm.tokenizers.hf.get_cached_tokenizer`` (every Hugging Face tokenizer vLLM serves
with passes through it, and the renderer pool's deep copies are rebuilt through it). Before vLLM
caches the tokenizer, the ``_vocab`` dict and ``_merges`` list that many transformers 5 tokenizer
classes (Qwen2, Whisper, GPT-2, Llama, ...) keep after building their Rust ``tokenizers`` backend
are set to None. Encoding and decoding read the Rust backend only; in transformers 5 no method of
a class whose tables are a vocabulary dict and a merges list reads them after ``__init__`` except
Whisper's ``save_vocabulary``. ``save_vocabulary`` is wrapped to rebuild them from the backend's
own serialisation first, so a saved tokenizer writes the same files. Only with transformers 5.
Second, the vocabulary dict vLLM's ``CachedTokenizer`` builds (``get_vocab()``, kept for the
tokenizer's life) is shared: when a new one equals the dict of a cached tokenizer still alive in
the process, the new tokenizer's ``get_vocab`` returns that dict and the new one is freed.
Why: the tables are a second copy of the vocabulary in Python objects, kept only for saving, and
vLLM holds two tokenizers (its own and the renderer pool's deep copy) per server; for a large
vocabulary such as Qwen2.5's they are a sizeable part of the server's heap. ``get_cached_tokenizer``
runs again for every copy of a cached tokenizer (its ``__reduce__`` rebuilds it): the renderer's
copy, the pool's shallow and deep copies each built their own dict of the same vocabulary.
Flag: ``VLLM_OMNI_EDGE_TOKENIZER_TABLES=keep`` keeps them and every cached tokenizer's own
vocabulary dict (the A/B arm); default ``drop``.
Verified by: tests/test_tokenizer_tables.py (tables dropped, the same token ids and text, a
deep copy carries none, ``save_pretrained`` writes the vocabulary and merges the tokenizer was
built from, tokenizers without tables untouched, idempotent, the flag; copies of a cached
tokenizer share one vocabulary dict, a different vocabulary keeps its own); evidence
``tokenizer_tables`` (tokenizers and vocabulary entries dropped, vocabularies shared) in the
process record.
Remove when: transformers' tokenizers stop keeping Python tables beside the Rust backend.
"""

from __future__ import annotations

import json
import threading
import weakref

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.tokenizers.hf"
MARKER = "__edge_tokenizer_tables__"

RECORD = PatchRecord(
    name="tokenizer_tables",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.get_cached_tokenizer; the tokenizer classes' save_vocabulary",
    process=Process.FRONTEND,  # tokenizers live where requests are rendered: LLM(), the API server
    why="transformers 5 BPE tokenizers keep a Python copy of vocabulary and merges beside the Rust "
    "backend, only for save_vocabulary; vLLM holds two tokenizers per server, and each copy of a "
    "cached tokenizer builds its own vocabulary dict.",
    verified_by="tests/test_tokenizer_tables.py; evidence tokenizer_tables in the process record.",
    remove_when="transformers' tokenizers stop keeping Python vocabulary/merges tables.",
    upstream="none found",
)

_lock = threading.Lock()
counts = {"tokenizers": 0, "vocab_entries": 0, "merges": 0, "vocabs_shared": 0}
# The classes of cached tokenizers whose vocabulary dict others may share (weakly held: a
# class dies with its last tokenizer, and its dict with it).
_vocab_owners: list[weakref.ref] = []


def record() -> dict[str, int]:
    return dict(counts)


def _has_tables(tokenizer) -> bool:
    return (isinstance(getattr(tokenizer, "_vocab", None), dict)
            and isinstance(getattr(tokenizer, "_merges", None), list)
            and getattr(tokenizer, "_tokenizer", None) is not None)


def drop_tables(tokenizer) -> bool:
    """Set the Python vocabulary and merges of ``tokenizer`` to None; True if it had them."""
    if not _has_tables(tokenizer):
        return False
    _wrap_save(type(tokenizer))
    with _lock:
        counts["tokenizers"] += 1
        counts["vocab_entries"] += len(tokenizer._vocab)
        counts["merges"] += len(tokenizer._merges)
    tokenizer._vocab = None
    tokenizer._merges = None
    return True


def restore_tables(tokenizer) -> None:
    """Rebuild dropped tables from the Rust backend's serialisation (what they were built into)."""
    if tokenizer._vocab is not None and tokenizer._merges is not None:
        return
    model = json.loads(tokenizer._tokenizer.to_str())["model"]
    tokenizer._vocab = dict(model.get("vocab", {}))
    tokenizer._merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]


def _vocab_cell(cached_cls):
    """The closure cell of vLLM's ``CachedTokenizer.get_vocab`` that holds its dict, or None."""
    get_vocab = cached_cls.__dict__.get("get_vocab")
    cells = [c for c in (getattr(get_vocab, "__closure__", None) or ()) if isinstance(c.cell_contents, dict)]
    return cells[0] if len(cells) == 1 else None


def share_vocab(cached) -> bool:
    """Point ``cached``'s ``get_vocab`` at an equal dict of a live cached tokenizer; True if it did."""
    cell = _vocab_cell(type(cached))
    if cell is None:
        return False
    vocab = cell.cell_contents
    with _lock:
        owners = [(ref, ref()) for ref in _vocab_owners]  # each dereferenced once: GC may run between
        _vocab_owners[:] = [ref for ref, owner in owners if owner is not None]
        known = {}  # the distinct dicts the live owners hold, each compared once
        for _, owner in owners:
            owner_cell = _vocab_cell(owner) if owner is not None else None
            if owner_cell is not None:
                known.setdefault(id(owner_cell.cell_contents), owner_cell.cell_contents)
        for other in known.values():
            if other is not vocab and len(other) == len(vocab) and other == vocab:
                cell.cell_contents = other
                counts["vocabs_shared"] += 1
                return True
        _vocab_owners.append(weakref.ref(type(cached)))
    return False


def _wrap_save(cls) -> None:
    for owner in cls.__mro__:  # the class that defines save_vocabulary
        original = owner.__dict__.get("save_vocabulary")
        if original is None:
            continue
        if getattr(original, MARKER, False):
            return

        def save_vocabulary(self, *args, _original=original, **kwargs):
            if getattr(self, "_vocab", 0) is None or getattr(self, "_merges", 0) is None:
                restore_tables(self)
            return _original(self, *args, **kwargs)

        setattr(save_vocabulary, MARKER, True)
        save_vocabulary.__wrapped__ = original
        setattr(owner, "save_vocabulary", save_vocabulary)
        return


def _wrap(module) -> None:
    original = module.get_cached_tokenizer
    if getattr(original, MARKER, False):
        return

    def get_cached_tokenizer(tokenizer, *args, **kwargs):
        drop_tables(tokenizer)
        cached = original(tokenizer, *args, **kwargs)
        share_vocab(cached)
        return cached

    setattr(get_cached_tokenizer, MARKER, True)
    get_cached_tokenizer.__wrapped__ = original
    module.get_cached_tokenizer = get_cached_tokenizer


def apply() -> str:
    from vllm_omni_edge.levers import tokenizer_tables_dropped

    if not tokenizer_tables_dropped():
        return "VLLM_OMNI_EDGE_TOKENIZER_TABLES=keep: tokenizers keep their Python vocabulary and merges"
    import transformers

    if not transformers.__version__.startswith("5."):
        return f"transformers {transformers.__version__}: tables kept (written for transformers 5)"
    now = when_imported(TARGET_MODULE, _wrap)
    return ("tokenizers drop their Python vocabulary and merges; cached tokenizers share one vocabulary dict"
            + ("" if now else " (on import)"))
