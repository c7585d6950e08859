"""The levers (memory and speed): what each lever's flag decides.

Each lever can be switched by an environment variable, so the harness can run it
as its own A/B (the variable reaches the engine core and worker processes, which
inherit the front end's environment). The flags, with their values, defaults and the
modules that act on them, are declared in ``vllm_omni_edge/envs.py`` and listed in
docs/edge/flags.md (generated from it); the functions here turn them into the decisions
the patches ask for.

An explicit ``kv_cache_memory_bytes`` is always honoured; see kv_budget.py for
how it and ``VLLM_CPU_KVCACHE_SPACE`` are reconciled.
"""

from __future__ import annotations

import os

from vllm_omni_edge import envs

ROPE_CAP_ENV = "VLLM_OMNI_EDGE_ROPE_CAP"
KV_DEFAULT_ENV = "VLLM_OMNI_EDGE_KV_DEFAULT"
EMBED_PREPACK_ENV = "VLLM_OMNI_EDGE_EMBED_PREPACK"
INT4_LOAD_ENV = "VLLM_OMNI_EDGE_INT4_LOAD"
INT4_LAYOUTS_ENV = "VLLM_OMNI_EDGE_INT4_LAYOUTS"
INT4_PREFILL_ENV = "VLLM_OMNI_EDGE_INT4_PREFILL"
INT4_PREFILL_GEMM_ENV = "VLLM_OMNI_EDGE_INT4_PREFILL_GEMM"
INT4_GROUP_CODES_ENV = "VLLM_OMNI_EDGE_INT4_GROUP_CODES"
SINGLE_PROCESS_ENV = "VLLM_OMNI_EDGE_SINGLE_PROCESS"
HEAP_TRIM_ENV = "VLLM_OMNI_EDGE_HEAP_TRIM"
IDLE_TRIM_ENV = "VLLM_OMNI_EDGE_IDLE_TRIM"
CODE_PAGES_ENV = "VLLM_OMNI_EDGE_CODE_PAGES"
CHECKPOINT_READ_ENV = "VLLM_OMNI_EDGE_CHECKPOINT_READ"
SHM_SPIN_ENV = "VLLM_OMNI_EDGE_SHM_SPIN_S"
STREAM_CHUNK_ENV = "VLLM_OMNI_EDGE_STREAM_CHUNK_MS"
COMPILE_WARMUP_ENV = "VLLM_OMNI_EDGE_COMPILE_WARMUP"
EAGER_SAMPLER_ENV = "VLLM_OMNI_EDGE_EAGER_SAMPLER"
ATTENTION_CALLS_ENV = "VLLM_OMNI_EDGE_ATTENTION_CALLS"
GRAPH_ARGS_ENV = "VLLM_OMNI_EDGE_GRAPH_ARGS"
SLOT_MAPPING_CALL_ENV = "VLLM_OMNI_EDGE_SLOT_MAPPING_CALL"
SAMPLER_ARGMAX_ENV = "VLLM_OMNI_EDGE_SAMPLER_ARGMAX"
FUSED_MLP_ENV = "VLLM_OMNI_EDGE_FUSED_MLP"
ATTENTION_ONE_CALL_ENV = "VLLM_OMNI_EDGE_ATTENTION_ONE_CALL"
DECODE_ATTENTION_ENV = "VLLM_OMNI_EDGE_DECODE_ATTENTION"
DECODER_STACK_ENV = "VLLM_OMNI_EDGE_DECODER_STACK"
STACK_STEP_INPUTS_ENV = "VLLM_OMNI_EDGE_STACK_STEP_INPUTS"
STARTUP_GC_ENV = "VLLM_OMNI_EDGE_STARTUP_GC"
IMPORT_GC_ENV = "VLLM_OMNI_EDGE_IMPORT_GC"
INDUCTOR_DEFERRED_ENV = "VLLM_OMNI_EDGE_INDUCTOR_DEFERRED"
COMPILE_ENV = "VLLM_OMNI_EDGE_COMPILE"
# On a ModelConfig that compile_choice made eager for the decoder stack: why (decoder_stack, evidence).
EAGER_FOR_STACK_ATTR = "_edge_eager_for_stack"
ISA_PROBE_MEMO_ENV = "VLLM_OMNI_EDGE_ISA_PROBE_MEMO"
TORCH_KEY_MEMO_ENV = "VLLM_OMNI_EDGE_TORCH_KEY_MEMO"
TOKENIZER_POOL_ENV = "VLLM_OMNI_EDGE_TOKENIZER_POOL"
PROCESSOR_TOKENIZER_ENV = "VLLM_OMNI_EDGE_PROCESSOR_TOKENIZER"
TOKENIZER_TABLES_ENV = "VLLM_OMNI_EDGE_TOKENIZER_TABLES"
TOKENIZER_LOAD_ENV = "VLLM_OMNI_EDGE_TOKENIZER_LOAD"
TOKENIZER_COPIES_ENV = "VLLM_OMNI_EDGE_TOKENIZER_COPIES"
WEIGHTS_CHECK_ENV = "VLLM_OMNI_EDGE_WEIGHTS_CHECK"
PCH_MEMO_ENV = "VLLM_OMNI_EDGE_PCH_MEMO"
KV_RESIDENT_ENV = "VLLM_OMNI_EDGE_KV_RESIDENT"
LAZY_IMPORTS_ENV = "VLLM_OMNI_EDGE_LAZY_IMPORTS"
IMPORT_MEMO_ENV = "VLLM_OMNI_EDGE_IMPORT_MEMO"


LeverFlagError = envs.FlagError


def rope_cap_enabled() -> bool:
    return envs.get(ROPE_CAP_ENV)


def kv_default_mode() -> str:
    return envs.get(KV_DEFAULT_ENV)


def kv_resident_as_used() -> bool:
    return envs.get(KV_RESIDENT_ENV) == "used"


def short_compile_warmup() -> bool:
    return envs.get(COMPILE_WARMUP_ENV) == "short"


def weights_check_always() -> bool:
    """Hash a cpu_int4 checkpoint's weights every start, not once per file version."""
    return envs.get(WEIGHTS_CHECK_ENV) == "always"


def pch_memo_enabled() -> bool:
    return envs.get(PCH_MEMO_ENV)


def isa_probe_memo_enabled() -> bool:
    return envs.get(ISA_PROBE_MEMO_ENV)


def torch_key_memo_enabled() -> bool:
    return envs.get(TORCH_KEY_MEMO_ENV)


def lazy_tokenizer_pool() -> bool:
    return envs.get(TOKENIZER_POOL_ENV) == "lazy"


def processor_tokenizer_shared() -> bool:
    return envs.get(PROCESSOR_TOKENIZER_ENV)


def tokenizer_tables_dropped() -> bool:
    return envs.get(TOKENIZER_TABLES_ENV) == "drop"


def tokenizer_load_once() -> bool:
    return envs.get(TOKENIZER_LOAD_ENV) == "once"


def tokenizer_copies_reused() -> bool:
    return envs.get(TOKENIZER_COPIES_ENV) == "reuse"


def eager_sampler_enabled() -> bool:
    return envs.get(EAGER_SAMPLER_ENV)


def attention_calls_enabled() -> bool:
    return envs.get(ATTENTION_CALLS_ENV)


def attention_one_call_enabled() -> bool:
    """The KV write moves into the attention call; only with the trimmed calls (ATTENTION_CALLS=1)."""
    return attention_calls_enabled() and envs.get(ATTENTION_ONE_CALL_ENV)


def decode_attention_enabled() -> bool:
    """Batches of one-token queries attend through our decode op; only with the trimmed calls."""
    return attention_calls_enabled() and envs.get(DECODE_ATTENTION_ENV)


def decoder_stack_enabled() -> bool:
    """Decode steps of the models it runs go through our C++ decoder stack; only with the decode op."""
    return decode_attention_enabled() and envs.get(DECODER_STACK_ENV)


def stack_step_inputs_enabled() -> bool:
    """Steady decode steps on the decoder stack take their inputs from the batch; only with the stack."""
    return decoder_stack_enabled() and envs.get(STACK_STEP_INPUTS_ENV)


def fused_mlp_enabled() -> bool:
    return envs.get(FUSED_MLP_ENV)


def startup_gc_mode() -> str:
    """``pause``: no automatic collection while serve starts; ``young``: only the youngest
    generation is collected automatically; ``off``: CPython's collection throughout."""
    # "1" keeps its meaning from before young existed (pause).
    value = envs.get(STARTUP_GC_ENV)
    return {"1": "pause", "0": "off"}.get(value, value)


def startup_gc_enabled() -> bool:
    return startup_gc_mode() != "off"


def import_gc_enabled() -> bool:
    """Collection held back while vLLM's package and LLM module import (with the start-up lever on)."""
    return envs.get(IMPORT_GC_ENV)


def inductor_deferred_enabled() -> bool:
    """Inductor's compiler modules imported when a model compiles, not when vllm imports."""
    return envs.get(INDUCTOR_DEFERRED_ENV)


def compile_mode() -> str:
    """auto (eager where the decoder stack runs decode), on (compiled) or off (eager)."""
    return envs.get(COMPILE_ENV)


def embed_prepack_enabled() -> bool:
    return envs.get(EMBED_PREPACK_ENV)


def int4_layerwise_load() -> bool:
    return envs.get(INT4_LOAD_ENV) == "layerwise"


def int4_dense_prefill_copy() -> bool:
    return envs.get(INT4_LAYOUTS_ENV) == "two"


def int4_group_codes() -> bool:
    """``8bit``: the rows16 kernel keeps each group's scale and offset as one-byte codes under
    per-superblock factors (quantization/group_codes.py); ``bf16``: as stored (the A/B arm)."""
    return envs.get(INT4_GROUP_CODES_ENV) == "8bit"


def int4_prefill_gemm() -> str:
    """``auto``: the rows16 bf16 prefill path on the op's AMX tiles where AMX BF16 is usable;
    ``onednn``: on oneDNN's matmul everywhere (the A/B arm)."""
    return envs.get(INT4_PREFILL_GEMM_ENV)


def int4_prefill_mode() -> str:
    """``auto``: rows16 prefill on the bf16 GEMM where the CPU has AMX; ``bf16``: on any CPU;
    ``w4a8``: prefill on the W4A8 tiles, as decode (the A/B arm)."""
    return envs.get(INT4_PREFILL_ENV)


def lazy_imports_enabled() -> bool:
    return envs.get(LAZY_IMPORTS_ENV)


def import_memo_enabled() -> bool:
    return envs.get(IMPORT_MEMO_ENV)


def heap_trim_enabled() -> bool:
    return envs.get(HEAP_TRIM_ENV)


def idle_trim_enabled() -> bool:
    return envs.get(IDLE_TRIM_ENV)


def graph_args_enabled() -> bool:
    return envs.get(GRAPH_ARGS_ENV)


def slot_mapping_call_enabled() -> bool:
    return envs.get(SLOT_MAPPING_CALL_ENV)


def sampler_argmax_enabled() -> bool:
    return envs.get(SAMPLER_ARGMAX_ENV)


def code_pages_drop_enabled() -> bool:
    return envs.get(CODE_PAGES_ENV)


def checkpoint_read_mode() -> str:
    return envs.get(CHECKPOINT_READ_ENV)


def shm_spin_seconds() -> float:
    return envs.get(SHM_SPIN_ENV)


def stream_chunk_s() -> float:
    """Seconds a streamed request's chunks are at least apart (0: every step's tokens, vLLM's)."""
    return envs.get(STREAM_CHUNK_ENV) / 1000.0


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
    multiprocessing variable (the configuration may still need vLLM's layout: llm_in_process)."""
    return os.environ.get(VLLM_MULTIPROCESSING_ENV, "").strip() == ""


def single_process_enabled() -> bool:
    """The one-process server layout: on unless set to 0, or vLLM's layout was asked for
    (``VLLM_ENABLE_V1_MULTIPROCESSING=1``)."""
    if not envs.is_set(SINGLE_PROCESS_ENV):
        return not vllm_layout_requested()
    return envs.get(SINGLE_PROCESS_ENV)


def single_process_asked() -> bool:
    """The user asked for the one-process server by name (``--single-process`` or the flag =1)."""
    return envs.is_set(SINGLE_PROCESS_ENV) and envs.get(SINGLE_PROCESS_ENV)
