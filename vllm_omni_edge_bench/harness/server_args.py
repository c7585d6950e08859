"""An arm's ``llm_kwargs`` as ``vllm serve`` flags, for passes that run the OpenAI server.

Only settings whose flag is known are converted; anything else is refused by
name. A kwarg silently dropped on the way to the server would leave the arm
measuring vLLM's default instead of its setting.
"""

from __future__ import annotations

import json
from typing import Any

# vLLM's arg_utils gives bool fields argparse.BooleanOptionalAction: --x and --no-x.
BOOL_FLAGS = (
    "enforce_eager",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "trust_remote_code",
)
VALUE_FLAGS = (
    "kv_cache_memory_bytes",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "quantization",
    "dtype",
    "block_size",
    "seed",
    "max_logprobs",
    "stream_interval",
)
JSON_FLAGS = ("compilation_config",)  # a dict on LLM(...), a JSON string on the command line
# The pass sets these itself; an arm must not.
RESERVED = ("port", "host", "served_model_name")


class UnmappableKwargs(ValueError):
    """llm_kwargs that have no known ``vllm serve`` flag."""


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def server_flags(llm_kwargs: dict[str, Any]) -> list[str]:
    """``vllm serve`` arguments for ``llm_kwargs``; raise UnmappableKwargs naming what cannot be mapped."""
    flags: list[str] = []
    problems: list[str] = []
    for key, value in llm_kwargs.items():
        if key in RESERVED:
            problems.append(f"{key} (set by the harness for server passes)")
        elif key in BOOL_FLAGS:
            if not isinstance(value, bool):
                problems.append(f"{key} (expects true or false, got {value!r})")
            else:
                flags.append(flag_name(key) if value else "--no-" + key.replace("_", "-"))
        elif key in VALUE_FLAGS:
            if value is None:
                continue  # vLLM's default, as LLM(key=None) would be
            if isinstance(value, (bool, dict, list)):
                problems.append(f"{key} (expects a scalar, got {value!r})")
            else:
                flags += [flag_name(key), str(value)]
        elif key in JSON_FLAGS:
            if not isinstance(value, dict):
                problems.append(f"{key} (expects a mapping, got {value!r})")
            else:
                flags += [flag_name(key), json.dumps(value, sort_keys=True)]
        else:
            problems.append(key)
    if problems:
        known = ", ".join(BOOL_FLAGS + VALUE_FLAGS + JSON_FLAGS)
        raise UnmappableKwargs(
            "llm_kwargs the server pass cannot pass to `vllm serve`: " + "; ".join(problems)
            + f" (known: {known})"
        )
    return flags
