"""Start vLLM's renderer tokenizer pool with one deep copy, not one per thread that may use it.

What: replaces ``maybe_make_thread_pool`` in ``vllm.renderers.hf`` (the name ``HfRenderer``
calls) with a wrapper that asks for one up-front copy instead of vLLM's
``renderer_num_workers + 1``. The pool itself is vLLM's: a thread that finds it empty
deep-copies the tokenizer and puts the copy back, so under concurrent use it still grows
to as many copies as threads used it at once; only copies nobody needed are not made.
Why: each copy is a ``copy.deepcopy`` of the Hugging Face tokenizer, made while the server
starts. Measured here (one copy, USS): SmolLM2 0.17 s and 2 MiB; Qwen2.5-Coder-1.5B
(151k-token vocabulary) 0.92 s and 107 MiB. vLLM makes two by default. A single user's
requests use them one after another (the renderer's one worker thread encodes; the
incremental detokenizer reads the Rust tokenizer directly), so the second copy is only
made when two threads render at once.
Flag: ``VLLM_OMNI_EDGE_TOKENIZER_POOL=vllm`` keeps vLLM's up-front copies (the A/B arm);
default ``lazy``.
Verified by: tests/test_tokenizer_pool.py (one copy up front; a second thread finding the pool
busy gets its own copy and the pool keeps it; same tokens as the unpooled tokenizer; the
flag); evidence ``tokenizer_pool`` (copies asked for and made up front) in the process record.
Remove when: vLLM builds the renderer's pool on demand (not as of 0.30.0).
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.renderers.hf"

RECORD = PatchRecord(
    name="tokenizer_pool",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.maybe_make_thread_pool (called by HfRenderer.__init__)",
    process=Process.FRONTEND,  # the renderer lives in the API server / LLM() process
    why="vLLM deep-copies the tokenizer renderer_num_workers + 1 times at start (Qwen-1.5B: "
    "0.92 s and 107 MiB each); the pool grows on demand anyway, so one copy up front does.",
    verified_by="tests/test_tokenizer_pool.py; evidence tokenizer_pool in the process record.",
    remove_when="vLLM builds the renderer tokenizer pool on demand.",
    upstream="none found",
)

UP_FRONT_COPIES = 1

# Copies made up front: UP_FRONT_COPIES (the lever) or None (vLLM's count; the flag's A/B arm).
up_front_limit: int | None = UP_FRONT_COPIES

# Pools built in this process: copies vLLM asked for, copies made up front (evidence).
pools: list[dict[str, int]] = []


def _wrap(module) -> None:
    def make(original):
        def maybe_make_thread_pool(tokenizer, copies: int = 1):
            made = copies if up_front_limit is None else min(copies, up_front_limit)
            pools.append({"asked": copies, "made_up_front": made})
            return original(tokenizer, made)

        return maybe_make_thread_pool

    wrap_method_once(module, "maybe_make_thread_pool", make)  # a module attribute, not a method


def record() -> list[dict[str, int]]:
    return list(pools)


def apply() -> str:
    from vllm_omni_edge.levers import lazy_tokenizer_pool

    global up_front_limit
    up_front_limit = UP_FRONT_COPIES if lazy_tokenizer_pool() else None
    now = when_imported(TARGET_MODULE, _wrap)  # also with the flag off: the evidence counts copies
    done = ("VLLM_OMNI_EDGE_TOKENIZER_POOL=vllm: vLLM's up-front tokenizer copies (counted)"
            if up_front_limit is None else f"renderer tokenizer pool starts with {UP_FRONT_COPIES} copy")
    return done + ("" if now else " (on import)")
