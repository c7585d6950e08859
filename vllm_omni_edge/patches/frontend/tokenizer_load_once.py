"""vLLM reads a tokenizer directory once per process: the same directory and options give the same tokenizer.

What: wraps ``vllm.tokenizers.hf.CachedHfTokenizer.from_pretrained`` (every Hugging Face tokenizer
vLLM loads, through ``get_tokenizer``, cached or not). The first load of a directory with given
options is kept; a later load of the same directory with the same options (``revision``,
``trust_remote_code``, ``download_dir``, ``truncation_side``, ...; the ``config`` object vLLM
hands over to spare a re-read is not an option) returns that tokenizer instead of reading the
files again. Loads with other options, positional arguments or a ``subfolder`` load as before.
Why: vLLM caches the tokenizer its renderer and processors use (``cached_get_tokenizer``), but
some callers load their own with the uncached ``get_tokenizer``: the transcription and the
translation endpoints of a speech server each read the tokenizer again at start and keep it
(a Rust tokenizer and vLLM's cached vocabulary dict each). vLLM's own
cache already hands one tokenizer object to many callers; this extends it to those loads. The
renderer copies the tokenizer before it changes anything on it.
Flag: ``VLLM_OMNI_EDGE_TOKENIZER_LOAD=each`` reads the files at every load, as vLLM does (the
A/B arm); default ``once``.
Verified by: tests/test_tokenizer_load_once.py (the same directory and options give the same
object; other options, a subfolder or positional arguments load anew; the flag; idempotent);
evidence ``tokenizer_loads`` (loads from files, loads answered from memory) in the process record;
the speech grid's PSS.
Remove when: vLLM's speech-to-text serving takes the tokenizer from the model config's cache.
"""

from __future__ import annotations

import threading

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_classmethod_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.tokenizers.hf"
MARKER = "__edge_tokenizer_load_once__"
NOT_AN_OPTION = ("config",)  # vLLM passes the config it already read; not a loading option

RECORD = PatchRecord(
    name="tokenizer_load_once",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.CachedHfTokenizer.from_pretrained",
    process=Process.FRONTEND,  # tokenizers live where requests are rendered: LLM(), the API server
    why="Callers of vLLM's uncached get_tokenizer (the transcription and translation endpoints) read "
    "the tokenizer files again and each keep a tokenizer beside the one vLLM caches.",
    verified_by="tests/test_tokenizer_load_once.py; evidence tokenizer_loads; the speech grid's PSS.",
    remove_when="vLLM's speech-to-text serving uses the model config's cached tokenizer.",
    upstream="none found",
)

_lock = threading.Lock()
_loaded: dict[tuple, object] = {}
counts = {"loaded": 0, "reused": 0}


def record() -> dict[str, int]:
    return dict(counts)


def load_key(path, args: tuple, kwargs: dict) -> tuple | None:
    """What identifies a load; None for a load that is not kept (positional args, a subfolder)."""
    if args or kwargs.get("subfolder"):
        return None
    options = []
    for name, value in sorted(kwargs.items()):
        if name in NOT_AN_OPTION:
            continue
        try:
            hash(value)
        except TypeError:
            value = repr(value)
        options.append((name, value))
    return (str(path), tuple(options))


def _wrap(module) -> None:
    def make(load):
        def from_pretrained(cls, path_or_repo_id, *args, **kwargs):
            key = load_key(path_or_repo_id, args, kwargs)
            if key is None:
                return load(cls, path_or_repo_id, *args, **kwargs)
            with _lock:
                if key in _loaded:
                    counts["reused"] += 1
                    return _loaded[key]
            tokenizer = load(cls, path_or_repo_id, *args, **kwargs)
            with _lock:
                counts["loaded"] += 1
                return _loaded.setdefault(key, tokenizer)

        return from_pretrained

    wrap_classmethod_once(module.CachedHfTokenizer, "from_pretrained", make, MARKER)


def apply() -> str:
    from vllm_omni_edge.levers import tokenizer_load_once

    if not tokenizer_load_once():
        return "VLLM_OMNI_EDGE_TOKENIZER_LOAD=each: vLLM reads the tokenizer files at every load"
    now = when_imported(TARGET_MODULE, _wrap)
    return "a tokenizer directory is read once per process and options" + ("" if now else " (on import)")
