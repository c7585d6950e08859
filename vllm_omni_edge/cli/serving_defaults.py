"""Edge defaults for ``vllm serve`` and ``vllm-omni-edge serve``, and the one line that states them.

vLLM sizes a server for a GPU: the model's whole context times the OpenAI server's default
``max_num_seqs``, which on CPU becomes the capped need-sized KV cache and a compile for
batches of the whole context. On an edge box one or two clients talk to the model; these defaults keep a long context and two concurrent
streams, so the need-sized KV cache (``levers/kv_budget.py``) stays near what the demo's
measured one-process layout holds. The user's own flags always win.
"""

from __future__ import annotations

EDGE_MAX_MODEL_LEN = 4096
EDGE_MAX_NUM_SEQS = 2
# vLLM derives the context limit from the smallest of these config keys (ModelConfig).
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "max_sequence_length", "max_seq_length", "seq_len", "model_max_length")


def has_option(args: list[str], option: str) -> bool:
    return any(a == option or a.startswith(option + "=") for a in args)


def model_context_limit(model: str) -> int | None:
    """The smallest context length a local HF checkpoint's config declares, or None."""
    from vllm_omni_edge.levers.compile_choice import read_config

    config = read_config(model)
    if config is None:
        return None
    sections = [config] + [config[k] for k in ("text_config", "llm_config") if isinstance(config.get(k), dict)]
    found = [s[k] for s in sections for k in _LENGTH_KEYS if isinstance(s.get(k), int) and s[k] > 0]
    return min(found) if found else None


def compile_said(args: list[str], model: str | None) -> str:
    """Compiled or eager, as ``compile_choice`` will decide it for these arguments."""
    from vllm_omni_edge.levers import compile_choice, compile_mode

    if has_option(args, "--enforce-eager"):
        return "eager (yours)"
    chose = any(has_option(args, o) for o in ("--compilation-config", "-cc", "--optimization-level")) \
        or any(a.startswith("-O") for a in args)
    decision = compile_choice.decide(compile_mode(), model or "", option_value(args, "--quantization"),
                                     user_chose=chose)
    if decision.eager:
        return decision.reason
    return ("compiled" + ("" if chose else f" ({decision.reason.removeprefix('compiled: ')})")
            + ": a machine's first start compiles, about a minute on 2 cores; later starts load it; "
            "--enforce-eager skips")


def option_value(args: list[str], option: str) -> str | None:
    """The last value given for ``--option value`` or ``--option=value`` (argparse's rule)."""
    value = None
    for i, a in enumerate(args):
        if a.startswith(option + "="):
            value = a.split("=", 1)[1]
        elif a == option and i + 1 < len(args):
            value = args[i + 1]
    return value


def with_serving_defaults(args: list[str], model: str | None) -> tuple[list[str], str]:
    """``args`` with the edge defaults the user did not set, and the line that states them."""
    args = list(args)
    said = []
    if has_option(args, "--max-model-len"):
        said.append("max_model_len yours")
    else:
        limit = model_context_limit(model) if model else None
        if limit is not None and limit > EDGE_MAX_MODEL_LEN:
            args += ["--max-model-len", str(EDGE_MAX_MODEL_LEN)]
            said.append(f"max_model_len {EDGE_MAX_MODEL_LEN} (the model allows {limit})")
        else:
            said.append("max_model_len the model's" + (f" ({limit})" if limit else ""))
    if has_option(args, "--max-num-seqs"):
        said.append("max_num_seqs yours")
    else:
        args += ["--max-num-seqs", str(EDGE_MAX_NUM_SEQS)]
        said.append(f"max_num_seqs {EDGE_MAX_NUM_SEQS}")
    said.append("KV cache " + ("yours" if has_option(args, "--kv-cache-memory-bytes") else "sized from need"))
    if has_option(args, "--stream-interval"):
        said.append("stream interval yours")
    else:
        from vllm_omni_edge.levers import stream_chunk_s

        chunk_ms = stream_chunk_s() * 1000
        said.append(f"streamed chunks at least {chunk_ms:g} ms apart" if chunk_ms > 0
                    else "a streamed chunk per step")
    said.append(compile_said(args, model))
    return args, "serving defaults: " + ", ".join(said) + "; flags you give win"


def named_model(args: list[str]) -> str | None:
    if args and not args[0].startswith("-"):
        return args[0]
    for i, a in enumerate(args):
        if a.startswith("--model="):
            return a.split("=", 1)[1]
        if a == "--model" and i + 1 < len(args):
            return args[i + 1]
    return None


def serving_defaults(args: list[str], program: str) -> tuple[list[str], str]:
    """``vllm serve`` arguments with the edge defaults, and the one line that states them
    (layout included); print it once the start can go ahead."""
    from vllm_omni_edge.levers import single_process_enabled

    args, line = with_serving_defaults(args, named_model(args))
    if has_option(args, "--stream-interval"):
        from vllm_omni_edge import envs
        from vllm_omni_edge.levers import STREAM_CHUNK_ENV

        envs.set_env(STREAM_CHUNK_ENV, 0)  # the user's token count, not our time bound
    layout = ("one process (--multi-process for vLLM's three)" if single_process_enabled()
              else "vLLM's three processes")
    return args, f"{program}: {line}; {layout}"
