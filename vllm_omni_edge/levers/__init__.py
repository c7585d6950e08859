"""The memory levers and their flags, in one place.

Each lever can be switched by an environment variable, so the harness can run it
as its own A/B (the variable reaches the engine core and worker processes, which
inherit the front end's environment).

| lever | flag | default | module |
|---|---|---|---|
| RoPE table sized to max_model_len | VLLM_OMNI_EDGE_ROPE_CAP=1/0 | 1 | rope_cap.py |
| KV budget when none is given | VLLM_OMNI_EDGE_KV_DEFAULT=need/vllm | need | kv_budget.py |
| oneDNN prepack of the input embedding | VLLM_OMNI_EDGE_EMBED_PREPACK=0/1 | 0 | patches/worker/embedding_prepack.py |

An explicit ``kv_cache_memory_bytes`` is always honoured; see kv_budget.py for
how it and ``VLLM_CPU_KVCACHE_SPACE`` are reconciled.
"""

from __future__ import annotations

import os

ROPE_CAP_ENV = "VLLM_OMNI_EDGE_ROPE_CAP"
KV_DEFAULT_ENV = "VLLM_OMNI_EDGE_KV_DEFAULT"
EMBED_PREPACK_ENV = "VLLM_OMNI_EDGE_EMBED_PREPACK"


class LeverFlagError(ValueError):
    """A lever's environment variable has a value we do not understand."""


def _choice(env: str, choices: tuple[str, ...], default: str) -> str:
    value = os.environ.get(env, "").strip().lower() or default
    if value not in choices:
        raise LeverFlagError(f"{env}={os.environ[env]!r}: expected one of {', '.join(choices)}")
    return value


def rope_cap_enabled() -> bool:
    return _choice(ROPE_CAP_ENV, ("1", "0"), "1") == "1"


def kv_default_mode() -> str:
    return _choice(KV_DEFAULT_ENV, ("need", "vllm"), "need")


def embed_prepack_enabled() -> bool:
    return _choice(EMBED_PREPACK_ENV, ("1", "0"), "0") == "1"
