"""The levers (memory and speed) and their flags, in one place.

Each lever can be switched by an environment variable, so the harness can run it
as its own A/B (the variable reaches the engine core and worker processes, which
inherit the front end's environment).

| lever | flag | default | module |
|---|---|---|---|
| RoPE table sized to max_model_len | VLLM_OMNI_EDGE_ROPE_CAP=1/0 | 1 | rope_cap.py |
| KV budget when none is given | VLLM_OMNI_EDGE_KV_DEFAULT=need/vllm | need | kv_budget.py |
| KV cache pages resident as blocks are first written (zero pages from a fresh mapping), or vLLM's buffer zero-filled at start | VLLM_OMNI_EDGE_KV_RESIDENT=used/all | used | patches/worker/kv_resident_as_used.py |
| oneDNN prepack of the input embedding | VLLM_OMNI_EDGE_EMBED_PREPACK=0/1 | 0 | patches/worker/embedding_prepack.py |
| cpu_int4 online quantization: per layer as loaded, or after the whole bf16 model | VLLM_OMNI_EDGE_INT4_LOAD=layerwise/whole | layerwise | quantization/linear.py |
| cpu_int4 weight layouts: packed only, or packed + a dense copy for prefill | VLLM_OMNI_EDGE_INT4_LAYOUTS=one/two | one | quantization/kernels/base.py (any kernel) |
| cpu_int4 rows16 prefill (calls of 32 rows or more): a bf16 GEMM (oneDNN) on blocks dequantized from the 4-bit layout where the CPU has AMX (auto), on any CPU (bf16), or the W4A8 tiles as decode (w4a8) | VLLM_OMNI_EDGE_INT4_PREFILL=auto/bf16/w4a8 | auto | quantization/kernels/avx2_w4a8.py (csrc: rows16_bf16_mm) |
| heap freed while loading returned to the OS (glibc malloc_trim) | VLLM_OMNI_EDGE_HEAP_TRIM=1/0 | 1 | patches/worker/heap_trim.py |
| process layout: model in its own worker process, or in the engine core | VLLM_OMNI_EDGE_WORKER_IN_ENGINE=0/1 | 0 | patches/frontend/worker_in_engine_core.py |
| process layout of the server: engine core and model on a thread of the API server (one process), or vLLM's three (also chosen when the configuration needs it) | VLLM_OMNI_EDGE_SINGLE_PROCESS=1/0 | 1 | patches/frontend/single_process.py |
| process layout of `LLM()`: engine and model in the calling process, or vLLM's (also chosen for tensor/pipeline/data parallel) | VLLM_ENABLE_V1_MULTIPROCESSING unset / 1 (vLLM's own variable) | in-process | patches/frontend/llm_in_process.py |
| seconds a shm queue reader spins after a read before it blocks (vLLM: 1) | VLLM_OMNI_EDGE_SHM_SPIN_S=seconds | 0 | patches/worker/shm_reader_wait.py |
| warm-up of a compiled model: 16 tokens, or vLLM's max_num_batched_tokens | VLLM_OMNI_EDGE_COMPILE_WARMUP=short/full | short | patches/worker/compile_warmup_tokens.py |
| random sampling (temperature > 0) on CPU: eager draw, or vLLM's inductor-compiled one | VLLM_OMNI_EDGE_EAGER_SAMPLER=1/0 | 1 | patches/worker/cpu_random_sample.py |
| vLLM-Omni's general plugin in `vllm-omni-edge serve`: left out for a model it does not register, or loaded | VLLM_PLUGINS unset / set by you | left out | cli/plugin_selection.py |
| compiled model's wrapper: inductor's generated Python, or its C++ wrapper | VLLM_OMNI_EDGE_CPP_WRAPPER=0/1 | 0 | patches/frontend/inductor_cpp_wrapper.py |
| CPU attention calls of a decoder layer: cache views kept, ops called directly; or vLLM's | VLLM_OMNI_EDGE_ATTENTION_CALLS=1/0 | 1 | patches/worker/cpu_attention_calls.py |
| a decoder layer's KV write inside its attention call (one custom op, not two); or vLLM's separate update | VLLM_OMNI_EDGE_ATTENTION_ONE_CALL=1/0 | 1 | patches/worker/cpu_attention_calls.py |
| gated SiLU MLP as one op when both linears run avx512_w4a8_rows16; or vLLM's three calls | VLLM_OMNI_EDGE_FUSED_MLP=1/0 | 1 | patches/worker/fused_silu_mlp.py |
| garbage collection while `serve` or an engine core (`LLM()` in one process, vLLM's engine-core child) starts: youngest generation only, frozen before the load (young); paused, one full collection before the load (pause or 1); CPython's throughout (0) | VLLM_OMNI_EDGE_STARTUP_GC=young/pause/1/0 | young | levers/startup_gc.py, patches/frontend/startup_gc.py, patches/frontend/engine_start_gc.py |
| inductor's per-ISA load probes (a child Python each) remembered across starts; or run every start | VLLM_OMNI_EDGE_ISA_PROBE_MEMO=1/0 | 1 | patches/worker/isa_probe_memo.py |
| the path of inductor's precompiled C++ header remembered across starts; or preprocessed every start | VLLM_OMNI_EDGE_PCH_MEMO=1/0 | 1 | patches/worker/precompiled_header_memo.py |
| a cpu_int4 checkpoint's SHA-256 check: once per file version (size, mtime, ctime, inode), or every start | VLLM_OMNI_EDGE_WEIGHTS_CHECK=once/always | once | quantization/manifest.py |
| packages a CPU text model never runs (PyAV, OpenCV, scipy.signal, scipy.optimize) imported on first use, and triton hidden when torch is a CPU-only build; or imported as vLLM does | VLLM_OMNI_EDGE_LAZY_IMPORTS=1/0 | 1 | patches/common/lazy_imports.py |
| vLLM's renderer tokenizer pool: one deep copy up front, more only when threads use it at once; or vLLM's renderer_num_workers + 1 up front | VLLM_OMNI_EDGE_TOKENIZER_POOL=lazy/vllm | lazy | patches/frontend/tokenizer_pool.py |

An explicit ``kv_cache_memory_bytes`` is always honoured; see kv_budget.py for
how it and ``VLLM_CPU_KVCACHE_SPACE`` are reconciled.
"""

from __future__ import annotations

import os

ROPE_CAP_ENV = "VLLM_OMNI_EDGE_ROPE_CAP"
KV_DEFAULT_ENV = "VLLM_OMNI_EDGE_KV_DEFAULT"
EMBED_PREPACK_ENV = "VLLM_OMNI_EDGE_EMBED_PREPACK"
INT4_LOAD_ENV = "VLLM_OMNI_EDGE_INT4_LOAD"
INT4_LAYOUTS_ENV = "VLLM_OMNI_EDGE_INT4_LAYOUTS"
INT4_PREFILL_ENV = "VLLM_OMNI_EDGE_INT4_PREFILL"
WORKER_IN_ENGINE_ENV = "VLLM_OMNI_EDGE_WORKER_IN_ENGINE"
SINGLE_PROCESS_ENV = "VLLM_OMNI_EDGE_SINGLE_PROCESS"
HEAP_TRIM_ENV = "VLLM_OMNI_EDGE_HEAP_TRIM"
SHM_SPIN_ENV = "VLLM_OMNI_EDGE_SHM_SPIN_S"
COMPILE_WARMUP_ENV = "VLLM_OMNI_EDGE_COMPILE_WARMUP"
EAGER_SAMPLER_ENV = "VLLM_OMNI_EDGE_EAGER_SAMPLER"
CPP_WRAPPER_ENV = "VLLM_OMNI_EDGE_CPP_WRAPPER"
ATTENTION_CALLS_ENV = "VLLM_OMNI_EDGE_ATTENTION_CALLS"
FUSED_MLP_ENV = "VLLM_OMNI_EDGE_FUSED_MLP"
ATTENTION_ONE_CALL_ENV = "VLLM_OMNI_EDGE_ATTENTION_ONE_CALL"
STARTUP_GC_ENV = "VLLM_OMNI_EDGE_STARTUP_GC"
ISA_PROBE_MEMO_ENV = "VLLM_OMNI_EDGE_ISA_PROBE_MEMO"
TOKENIZER_POOL_ENV = "VLLM_OMNI_EDGE_TOKENIZER_POOL"
WEIGHTS_CHECK_ENV = "VLLM_OMNI_EDGE_WEIGHTS_CHECK"
PCH_MEMO_ENV = "VLLM_OMNI_EDGE_PCH_MEMO"
KV_RESIDENT_ENV = "VLLM_OMNI_EDGE_KV_RESIDENT"
LAZY_IMPORTS_ENV = "VLLM_OMNI_EDGE_LAZY_IMPORTS"


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


def kv_resident_as_used() -> bool:
    return _choice(KV_RESIDENT_ENV, ("used", "all"), "used") == "used"


def short_compile_warmup() -> bool:
    return _choice(COMPILE_WARMUP_ENV, ("short", "full"), "short") == "short"


def weights_check_always() -> bool:
    """Hash a cpu_int4 checkpoint's weights every start, not once per file version."""
    return _choice(WEIGHTS_CHECK_ENV, ("once", "always"), "once") == "always"


def pch_memo_enabled() -> bool:
    return _choice(PCH_MEMO_ENV, ("1", "0"), "1") == "1"


def isa_probe_memo_enabled() -> bool:
    return _choice(ISA_PROBE_MEMO_ENV, ("1", "0"), "1") == "1"


def lazy_tokenizer_pool() -> bool:
    return _choice(TOKENIZER_POOL_ENV, ("lazy", "vllm"), "lazy") == "lazy"


def eager_sampler_enabled() -> bool:
    return _choice(EAGER_SAMPLER_ENV, ("1", "0"), "1") == "1"


def cpp_wrapper_enabled() -> bool:
    # Off by default: no decode gain measured (cpp-wrapper-default, cpp-wrapper-qwen).
    return _choice(CPP_WRAPPER_ENV, ("0", "1"), "0") == "1"


def attention_calls_enabled() -> bool:
    return _choice(ATTENTION_CALLS_ENV, ("1", "0"), "1") == "1"


def attention_one_call_enabled() -> bool:
    """The KV write moves into the attention call; only with the trimmed calls (ATTENTION_CALLS=1)."""
    return attention_calls_enabled() and _choice(ATTENTION_ONE_CALL_ENV, ("1", "0"), "1") == "1"


def fused_mlp_enabled() -> bool:
    return _choice(FUSED_MLP_ENV, ("1", "0"), "1") == "1"


def startup_gc_mode() -> str:
    """``pause``: no automatic collection while serve starts; ``young``: only the youngest
    generation is collected automatically; ``off``: CPython's collection throughout."""
    # "1" keeps its meaning from before young existed (pause); young is the default since
    # start-up-young-gc-default (0.85x start to first token on SmolLM2, 1.00x on Qwen, PSS 1.003x).
    value = _choice(STARTUP_GC_ENV, ("young", "1", "pause", "0"), "young")
    return {"1": "pause", "0": "off"}.get(value, value)


def startup_gc_enabled() -> bool:
    return startup_gc_mode() != "off"


def embed_prepack_enabled() -> bool:
    return _choice(EMBED_PREPACK_ENV, ("1", "0"), "0") == "1"


def int4_layerwise_load() -> bool:
    return _choice(INT4_LOAD_ENV, ("layerwise", "whole"), "layerwise") == "layerwise"


def int4_dense_prefill_copy() -> bool:
    return _choice(INT4_LAYOUTS_ENV, ("one", "two"), "one") == "two"


def int4_prefill_mode() -> str:
    """``auto``: rows16 prefill on the bf16 GEMM where the CPU has AMX; ``bf16``: on any CPU;
    ``w4a8``: prefill on the W4A8 tiles, as decode (the A/B arm)."""
    return _choice(INT4_PREFILL_ENV, ("auto", "bf16", "w4a8"), "auto")


def lazy_imports_enabled() -> bool:
    return _choice(LAZY_IMPORTS_ENV, ("1", "0"), "1") == "1"


def heap_trim_enabled() -> bool:
    return _choice(HEAP_TRIM_ENV, ("1", "0"), "1") == "1"


def shm_spin_seconds() -> float:
    text = os.environ.get(SHM_SPIN_ENV, "").strip() or "0"
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise LeverFlagError(f"{SHM_SPIN_ENV}={text!r}: expected seconds, a number >= 0 (vLLM's own value is 1)")
    return seconds


def worker_in_engine_enabled() -> bool:
    return _choice(WORKER_IN_ENGINE_ENV, ("0", "1"), "0") == "1"


VLLM_MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def in_process_engine() -> bool:
    """The user set vLLM's own ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (vLLM reads it as an int):
    ``LLM()`` runs its engine core in the calling process."""
    return os.environ.get(VLLM_MULTIPROCESSING_ENV, "").strip() == "0"


def vllm_layout_requested() -> bool:
    """The user set ``VLLM_ENABLE_V1_MULTIPROCESSING=1``: vLLM's own process layout, for
    ``LLM()`` and the server alike."""
    return os.environ.get(VLLM_MULTIPROCESSING_ENV, "").strip() == "1"


def llm_in_process_default() -> bool:
    """``LLM()`` runs its engine and model in the calling process unless the user set vLLM's
    multiprocessing variable or asked for the two-process layout (the configuration may still
    need vLLM's layout: llm_in_process)."""
    return os.environ.get(VLLM_MULTIPROCESSING_ENV, "").strip() == "" and not worker_in_engine_enabled()


def single_process_enabled() -> bool:
    """The one-process server layout: on unless set to 0, or another layout was asked for
    (the two-process layout, or vLLM's by ``VLLM_ENABLE_V1_MULTIPROCESSING=1``)."""
    raw = os.environ.get(SINGLE_PROCESS_ENV, "").strip()
    if raw == "":
        return not (worker_in_engine_enabled() or vllm_layout_requested())
    enabled = _choice(SINGLE_PROCESS_ENV, ("0", "1"), "1") == "1"
    if enabled and worker_in_engine_enabled():
        raise LeverFlagError(
            f"{SINGLE_PROCESS_ENV}=1 and {WORKER_IN_ENGINE_ENV}=1 ask for two different process "
            "layouts (one process vs. two); set only one of them")
    return enabled


def single_process_asked() -> bool:
    """The user asked for the one-process server by name (``--single-process`` or the flag =1)."""
    return os.environ.get(SINGLE_PROCESS_ENV, "").strip() == "1"
