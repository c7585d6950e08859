"""A shallow copy of a vLLM cached tokenizer reuses the cache vLLM built for that tokenizer.

What: wraps ``vllm.tokenizers.hf.get_cached_tokenizer``. vLLM's ``CachedTokenizer`` copies itself
through ``__reduce__``, i.e. ``get_cached_tokenizer(tokenizer)`` on the same underlying tokenizer
object, and that recomputes what it caches: the special ids and tokens, the vocabulary dict, the
length and the longest token. Called again for a tokenizer object it has already cached, whose
added tokens and special tokens are still those it was cached with (what can change a loaded
tokenizer's vocabulary or special ids), the wrapper returns a new shallow copy of the tokenizer
with the class vLLM built the first time (closures over the same values): the object vLLM would
build, without building it again. Anything else, a deep copy included (a new underlying
tokenizer), goes to vLLM's function.
Why: the server's start makes two such copies of the tokenizer it loaded (``HfRenderer.__init__``
and ``maybe_make_thread_pool``), each a full ``get_vocab()`` and scan of the vocabulary, on the
start path of ``vllm serve`` and ``LLM()``: for a large vocabulary such as Qwen2.5's, a visible
part of the start (docs/edge/what-changes.md).
Flag: ``VLLM_OMNI_EDGE_TOKENIZER_COPIES=rebuild`` recomputes at every copy, as vLLM does (the A/B
arm); default ``reuse``.
Verified by: tests/test_tokenizer_copies.py (a copy reuses the cache and is a new object with the
same values; a tokenizer given a new token or special token is cached anew; a deep copy is
rebuilt; the same token ids as vLLM's copy; idempotent; the flag); evidence ``tokenizer_copies``
(caches built, copies that reused one) in the process record.
Remove when: vLLM's ``CachedTokenizer`` copies without recomputing its cache.
"""

from __future__ import annotations

import copy
import threading
import weakref

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.tokenizers.hf"
MARKER = "__edge_tokenizer_copies__"

RECORD = PatchRecord(
    name="tokenizer_copies",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.get_cached_tokenizer (CachedTokenizer.__reduce__ copies through it)",
    process=Process.FRONTEND,  # tokenizers live where requests are rendered: LLM(), the API server
    why="Each copy of a vLLM cached tokenizer recomputes the cache of the same tokenizer object "
    "(vocabulary dict, special ids, length); the server's start makes two, on its start path.",
    verified_by="tests/test_tokenizer_copies.py; evidence tokenizer_copies in the process record.",
    remove_when="vLLM's CachedTokenizer copies without recomputing its cache.",
    upstream="none found",
)

_lock = threading.Lock()
# id(tokenizer) -> (weak references to it and to the class vLLM built for it, its state when
# cached). Both weak: the class's closures hold the tokenizer, so a strong one would keep both.
_cached: dict[int, tuple[weakref.ref, weakref.ref, tuple]] = {}
counts = {"built": 0, "reused": 0}


def record() -> dict[str, int]:
    return dict(counts)


def state(tokenizer) -> tuple:
    """What vLLM's cache depends on that can change after a tokenizer is loaded."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return (type(tokenizer),
            tuple(sorted((index, str(token)) for index, token in added.items())),
            tuple(tokenizer.all_special_ids), tuple(tokenizer.all_special_tokens))


def _reusable(tokenizer) -> type | None:
    entry = _cached.get(id(tokenizer))
    if entry is None or entry[0]() is not tokenizer or entry[2] != state(tokenizer):
        return None
    return entry[1]()


def _remember(tokenizer, cached) -> None:
    try:
        refs = weakref.ref(tokenizer), weakref.ref(type(cached))
    except TypeError:  # a tokenizer class without weak references: nothing kept
        return
    key = id(tokenizer)
    _cached[key] = (*refs, state(tokenizer))
    weakref.finalize(tokenizer, _cached.pop, key, None)


def _wrap(module) -> None:
    def make(original):
        def get_cached_tokenizer(tokenizer, *args, **kwargs):
            if not args and not kwargs:
                with _lock:
                    cls = _reusable(tokenizer)
                if cls is not None:
                    reused = copy.copy(tokenizer)  # what vLLM's function starts from
                    reused.__class__ = cls
                    counts["reused"] += 1
                    return reused
            cached = original(tokenizer, *args, **kwargs)
            with _lock:
                _remember(tokenizer, cached)
                counts["built"] += 1
            return cached

        return get_cached_tokenizer

    # A module attribute, not a method; its own marker beside tokenizer_tables' wrapper below it.
    wrap_method_once(module, "get_cached_tokenizer", make, marker=MARKER)


def apply() -> str:
    from vllm_omni_edge.levers import tokenizer_copies_reused

    if not tokenizer_copies_reused():
        return "VLLM_OMNI_EDGE_TOKENIZER_COPIES=rebuild: each copy of a cached tokenizer rebuilds its cache"
    now = when_imported(TARGET_MODULE, _wrap)
    return "copies of a cached tokenizer reuse its cache" + ("" if now else " (on import)")
