"""What a vLLM process really did, written where the harness can read it.

When ``VLLM_OMNI_EDGE_EVIDENCE_DIR`` is set, every vLLM process that loads our
plugin writes ``process-<pid>.json`` (role and patch outcomes), and the model
worker writes ``worker-<pid>.json`` once its KV cache exists: KV bytes and
blocks actually allocated, RoPE cache rows and bytes, weight bytes by dtype, and
whether AMX tiles and compilation were in use. The harness checks these against
what each arm asked for, so a setting that never reached the worker is caught.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from collections import defaultdict
from pathlib import Path

from vllm_omni_edge import envs
from vllm_omni_edge.atomic import atomic_write_bytes
from vllm_omni_edge.levers import EAGER_FOR_STACK_ATTR, startup_gc
from vllm_omni_edge.log import get_logger

EVIDENCE_ENV = "VLLM_OMNI_EDGE_EVIDENCE_DIR"
logger = get_logger("evidence")


def evidence_dir() -> Path | None:
    return envs.get(EVIDENCE_ENV)


def process_role() -> str:
    """'frontend' for the process the user started, else the spawned child's name."""
    if multiprocessing.parent_process() is None:
        return "frontend"
    return multiprocessing.current_process().name


def _write(name: str, record: dict) -> Path | None:
    out = evidence_dir()
    if out is None:
        return None
    path = out / name
    atomic_write_bytes(path, json.dumps(record, indent=2, sort_keys=True, default=str).encode())
    return path


def write_process_record() -> Path | None:
    from vllm_omni_edge.patches.base import outcomes

    return _write(
        f"process-{os.getpid()}.json",
        {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "role": process_role(),
            "patches": {name: o.status for name, o in outcomes().items()},
            "patch_details": {name: o.detail for name, o in outcomes().items()},
            "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_CPU", "OMP_", "GOMP_"))},
            "shm_reader_busy_loop_s": _shm_reader_busy_loop_s(),
            "startup_gc": startup_gc.record(),
            "tokenizer_pool": _tokenizer_pool(),
            "processor_tokenizers": _processor_tokenizers(),
            "tokenizer_tables": _tokenizer_tables(),
            "tokenizer_copies": _tokenizer_copies(),
            "tokenizer_loads": _tokenizer_loads(),
            "weights_check": _weights_check(),
        },
    )


def _weights_check() -> dict[str, int]:
    """cpu_int4 checkpoint files this process hashed or found unchanged (quantization/manifest.py)."""
    from vllm_omni_edge.quantization import manifest

    return manifest.checks()


def _tokenizer_pool() -> list[dict[str, int]]:
    """vLLM's renderer tokenizer pools in this process: copies asked for, made up front."""
    from vllm_omni_edge.patches.frontend import tokenizer_pool

    return tokenizer_pool.record()


def _processor_tokenizers() -> dict[str, int]:
    """Tokenizers HF processors in this process loaded from files, were passed, or reused."""
    from vllm_omni_edge.patches.frontend import processor_tokenizer

    return processor_tokenizer.record()


def _tokenizer_loads() -> dict[str, int]:
    from vllm_omni_edge.patches.frontend import tokenizer_load_once

    return tokenizer_load_once.record()


def _tokenizer_tables() -> dict[str, int]:
    """Tokenizers in this process that dropped their Python vocabulary and merges, and their sizes."""
    from vllm_omni_edge.patches.frontend import tokenizer_tables

    return tokenizer_tables.record()


def _transformers_import_memo() -> dict[str, dict[str, int]]:
    from vllm_omni_edge.patches.common import transformers_import_memo

    return transformers_import_memo.record()


def _tokenizer_copies() -> dict[str, int]:
    """Caches vLLM built for tokenizers in this process, and copies that reused one."""
    from vllm_omni_edge.patches.frontend import tokenizer_copies

    return tokenizer_copies.record()


def _rows16_bf16_prefill_rows() -> int | None:
    module = sys.modules.get("vllm_omni_edge.quantization.kernels.w4a8_avx512")
    return module.configured_prefill_rows() if module is not None else None


def _rows16_bf16_prefill_gemm() -> str | None:
    module = sys.modules.get("vllm_omni_edge.quantization.kernels.w4a8_avx512")
    return module.configured_prefill_gemm() if module is not None else None


def _rows16_bf16_prefill_onednn_from_rows() -> int | None:
    module = sys.modules.get("vllm_omni_edge.quantization.kernels.w4a8_avx512")
    return module.configured_onednn_from_rows() if module is not None else None


def _rows16_bf16_prefill_onednn_weights() -> str | None:
    module = sys.modules.get("vllm_omni_edge.quantization.kernels.w4a8_avx512")
    return module.onednn_weight_layout() if module is not None else None


def _compile_warmup_tokens() -> int | None:
    """Tokens of the compiled warm-up's dummy forward in this process (None: no warm-up ran)."""
    from vllm_omni_edge.patches.worker import compile_warmup_tokens

    return compile_warmup_tokens.last_warmup_tokens


def _compile_cache_counts() -> dict:
    from vllm.compilation.counter import compilation_counter

    from vllm_omni_edge.patches.worker import compile_cache_key

    return {"aot_compiled": compilation_counter.num_aot_compiles,
            "aot_loaded": compilation_counter.num_aot_artifacts_loaded,
            # What of ours the cache key carried (patches/worker/compile_cache_key.py).
            "edge_key": compile_cache_key.last_factor}


def _unique_storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def collect_worker_evidence(worker) -> dict:
    import torch
    import vllm
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    from vllm_omni_edge.cpu_features import cpu_flags

    runner = worker.model_runner
    model = runner.get_model()
    kv_caches = list(getattr(runner, "kv_caches", []) or [])
    kv_config = getattr(runner, "kv_cache_config", None)

    rope = []
    seen_rope: set[int] = set()
    for module in model.modules():
        cache = getattr(module, "cos_sin_cache", None)
        if isinstance(cache, torch.Tensor) and id(module) not in seen_rope:
            seen_rope.add(id(module))
            rope.append(
                {
                    "class": type(module).__name__,
                    "max_position": int(getattr(module, "max_position_embeddings", -1)),
                    "rows": int(cache.shape[0]),
                    "bytes": int(cache.numel() * cache.element_size()),
                    "dtype": str(cache.dtype).removeprefix("torch."),
                }
            )

    weights: dict[str, int] = defaultdict(int)
    for tensor in _unique_tensors(model):
        weights[str(tensor.dtype).removeprefix("torch.")] += tensor.untyped_storage().nbytes()

    # vLLM's CPU GEMM dispatch leaves ``cpu_linear`` on each layer it prepacked for.
    embeddings_prepacked = sorted(
        name for name, m in model.named_modules()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
        and hasattr(m, "cpu_linear")
    )

    # An unquantized head (tied or not) prepacked for oneDNN holds that copy beside its weight.
    heads_prepacked = sorted(
        name for name, m in model.named_modules() if isinstance(m, ParallelLMHead) and hasattr(m, "cpu_linear")
    )

    # CPU_ATTN stamps the ISA it chose (amx / vec / vec16 ...) on each attention layer.
    attention_isa = sorted({str(m.isa) for m in model.modules() if hasattr(m, "isa")})

    compilation = worker.vllm_config.compilation_config
    return {
        "pid": os.getpid(),
        "role": process_role(),
        "kv_cache_bytes": _unique_storage_bytes(kv_caches),
        # KV buffer bytes mapped as zero pages, resident as written (patches/worker/kv_resident_as_used.py).
        "kv_cache_mapped_bytes": _kv_cache_mapped_bytes(),
        "kv_num_blocks": int(kv_config.num_blocks) if kv_config is not None else None,
        "kv_cache_memory_bytes_requested": worker.cache_config.kv_cache_memory_bytes,
        "max_model_len": worker.model_config.max_model_len,
        "rope": rope,
        "weights_bytes_by_dtype": dict(weights),
        "weights_bytes_by_class": _weights_by_class(
            model, (VocabParallelEmbedding,), (ParallelLMHead,)),
        "heap_trim": _heap_trim(),
        "checkpoint_read": _checkpoint_read(),
        "heap_trim_after_warmup": _heap_trim("last_warmup_trim"),
        # Clean library code pages unmapped after warm-up (patches/worker/startup_code_pages.py).
        "startup_code_pages": _startup_code_pages(),
        **_rms_norm_dispatch(model),
        "shm_reader_busy_loop_s": _shm_reader_busy_loop_s(),
        # One value an arm can expect: the longest spin; None with no shm queue (model in the engine core).
        "shm_reader_spin_s": max(_shm_reader_busy_loop_s(), default=None),
        "embeddings_prepacked": len(embeddings_prepacked),
        "embeddings_prepacked_names": embeddings_prepacked,
        "heads_prepacked_names": heads_prepacked,
        "quantization": worker.model_config.quantization,
        "cpu_int4_kernels": _cpu_int4_kernel_counts(),
        "cpu_int4_routing": _cpu_int4_routing(),
        "cpu_int4_other_layers": _cpu_int4_other_layers(),
        # vLLM-Omni stage workers: which stage of the pipeline this worker runs.
        "omni_stage": getattr(worker.model_config, "model_stage", None),
        "omni_stage_id": getattr(worker.model_config, "stage_id", None),
        # vLLM-Omni's package in this process (patches/frontend/omni_plugin_by_model.py).
        "vllm_omni_imported": "vllm_omni" in sys.modules,
        "amx_tiles": "amx_tile" in cpu_flags(),
        "attention_isa": attention_isa,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_version": torch.__version__,
        "vllm_version": vllm.__version__,
        "compiled": int(compilation.mode) != 0,
        "compilation_mode": str(compilation.mode),
        # Why the plugin made this engine eager (patches/frontend/compile_choice.py), or None.
        "compile_choice": getattr(worker.model_config, EAGER_FOR_STACK_ATTR, None),
        # Whether this start compiled the model or loaded vLLM's saved artifact (compile_cache_load).
        "compile_cache": _compile_cache_counts(),
        # Inductor's ISA load probes this process answered from the memo or ran (isa_probe_memo).
        "isa_probes": _isa_probes(),
        # Inductor's torch_key taken from the memo or hashed by torch (torch_key_memo).
        "torch_key": _torch_key(),
        # Inductor's precompiled-header path from the memo, or preprocessed (precompiled_header_memo).
        "precompiled_headers": _precompiled_headers(),
        "attention_calls_trimmed": _attention_calls_trimmed(),
        # KV write inside the attention call: one custom op per layer, not two.
        "attention_one_call": _attention_one_call(),
        # One-token batches attend through our decode op, not vLLM's attention op.
        "decode_attention": _decode_attention(),
        # Decode steps through our C++ decoder stack, or why not (patches/worker/decoder_stack.py).
        "decoder_stack": _decoder_stack(runner),
        # Steady decode steps prepared from the batch for the stack (patches/worker/stack_step_inputs.py).
        "stack_step_inputs": _stack_step_inputs(runner),
        # Compiled forwards' argument patterns called with a kept list (patches/worker/compiled_graph_args.py).
        "compiled_graph_args": _compiled_graph_args(),
        # MLPs whose forward is the one fused op (patches/worker/fused_silu_mlp.py).
        "fused_silu_mlps": _fused_silu_mlps(model),
        # From which row count the rows16 ops prefill on the bf16 GEMM (0 never, None no rows16 layer).
        "rows16_bf16_prefill_rows": _rows16_bf16_prefill_rows(),
        # Its GEMM: amx_tiles or onednn (None: the path is off or no rows16 layer).
        "rows16_bf16_prefill_gemm": _rows16_bf16_prefill_gemm(),
        # With the AMX tiles, from which row count calls run on oneDNN instead (None otherwise).
        "rows16_bf16_prefill_onednn_from_rows": _rows16_bf16_prefill_onednn_from_rows(),
        # oneDNN's weight blocks: packed (dequantized into its own layout) or plain (at::mm).
        "rows16_bf16_prefill_onednn_weights": _rows16_bf16_prefill_onednn_weights(),
        "compile_warmup_tokens": _compile_warmup_tokens(),
        # Automatic collection paused in this process while the server starts (levers/startup_gc.py).
        "startup_gc": startup_gc.record(),
        # vLLM's renderer tokenizer pools built in this process (patches/frontend/tokenizer_pool.py).
        "tokenizer_pool": _tokenizer_pool(),
        # Tokenizers vLLM's HF processors loaded or shared (patches/frontend/processor_tokenizer.py).
        "processor_tokenizers": _processor_tokenizers(),
        # Tokenizers whose Python vocabulary/merges were dropped (patches/frontend/tokenizer_tables.py).
        "tokenizer_tables": _tokenizer_tables(),
        # transformers' import scans answered from the memos or computed (patches/common/transformers_import_memo.py).
        "transformers_import_memo": _transformers_import_memo(),
        # Caches built for tokenizers, and copies that reused one (patches/frontend/tokenizer_copies.py).
        "tokenizer_copies": _tokenizer_copies(),
        # Tokenizer loads read from files or answered from memory (patches/frontend/tokenizer_load_once.py).
        "tokenizer_loads": _tokenizer_loads(),
        "weights_check": _weights_check(),
        "torch_threads": torch.get_num_threads(),
        # vLLM binds one OpenMP thread per core through GOMP_CPU_AFFINITY; the
        # main thread's own affinity is just the first of them.
        "omp_cpu_binding": os.environ.get("GOMP_CPU_AFFINITY"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "lever_flags": envs.snapshot(),
    }


def _kv_cache_mapped_bytes() -> int:
    from vllm_omni_edge.patches.worker import kv_resident_as_used

    return kv_resident_as_used.mapped_bytes


def _attention_calls_trimmed() -> bool:
    from vllm_omni_edge.patches.worker.cpu_attention_calls import in_force

    return in_force()


def _attention_one_call() -> bool:
    from vllm_omni_edge.patches.worker.cpu_attention_calls import one_call_in_force

    return one_call_in_force()


def _decode_attention() -> bool:
    from vllm_omni_edge.patches.worker.cpu_attention_calls import decode_in_force

    return decode_in_force()


def _decoder_stack(runner) -> dict:
    from vllm_omni_edge.patches.worker.decoder_stack import summary

    return summary(runner, make=True)


def _stack_step_inputs(runner) -> dict:
    from vllm_omni_edge.patches.worker.stack_step_inputs import summary

    return summary(runner)


def _compiled_graph_args() -> dict[str, int]:
    from vllm_omni_edge.patches.worker.compiled_graph_args import summary

    return summary()


def _fused_silu_mlps(model) -> int:
    from vllm_omni_edge.patches.worker.fused_silu_mlp import fused_mlp_count

    return fused_mlp_count(model)


# How long each shm queue reader made in this process spins before it blocks (shm_reader_wait).
_SHM_READERS_BUSY_LOOP_S: list[float] = []


def note_shm_reader(busy_loop_s: float) -> None:
    """A shm queue reader was made here: keep its setting and rewrite the process record."""
    _SHM_READERS_BUSY_LOOP_S.append(busy_loop_s)
    write_process_record()


def _shm_reader_busy_loop_s() -> list[float]:
    return list(_SHM_READERS_BUSY_LOOP_S)


def _rms_norm_dispatch(model) -> dict:
    """Which vLLM IR impl this process's dispatch picks for the model's own RMSNorm
    arguments (dtype, epsilon, contiguous rows)."""
    import torch
    from vllm import ir
    from vllm.model_executor.layers.layernorm import RMSNorm

    norm = next((m for m in model.modules() if isinstance(m, RMSNorm)), None)
    selected: dict[str, str | None] = {"rms_norm_impl": None, "fused_add_rms_norm_impl": None}
    if norm is not None:
        weight = norm.weight.data if norm.has_weight else None
        dtype = weight.dtype if weight is not None else torch.get_default_dtype()
        x = torch.zeros(1, norm.hidden_size, dtype=dtype)
        eps, var = norm.variance_epsilon, norm.variance_size_override
        selected["rms_norm_impl"] = ir.ops.rms_norm.dispatch(x, weight, eps, var).provider
        selected["fused_add_rms_norm_impl"] = ir.ops.fused_add_rms_norm.dispatch(
            x, torch.zeros_like(x), weight, eps, var).provider
    return {
        **selected,
        "rms_norm_priority": ir.ops.rms_norm.get_priority(),
    }


def _isa_probes() -> dict[str, int]:
    from vllm_omni_edge.patches.worker import isa_probe_memo

    return dict(isa_probe_memo.counts)


def _torch_key() -> dict[str, int]:
    from vllm_omni_edge.patches.worker import torch_key_memo

    return dict(torch_key_memo.counts)


def _precompiled_headers() -> dict[str, int]:
    from vllm_omni_edge.patches.worker import precompiled_header_memo

    return dict(precompiled_header_memo.counts)


def _heap_trim(which: str = "last_trim") -> dict | None:
    """What the post-load (or post-warm-up) heap trim returned in this process (None if it did not run)."""
    from vllm_omni_edge.patches.worker import heap_trim

    return getattr(heap_trim, which)


def _startup_code_pages() -> dict | None:
    from vllm_omni_edge.patches.worker import startup_code_pages

    return startup_code_pages.last_drop


def _checkpoint_read() -> dict:
    """How this process read safetensors checkpoints (patches/worker/checkpoint_read_per_tensor.py)."""
    from vllm_omni_edge.patches.worker import checkpoint_read_per_tensor

    return dict(checkpoint_read_per_tensor.stats)


def _cpu_int4_kernel_counts() -> dict[str, int]:
    """Layers per cpu_int4 kernel in this process (empty when cpu_int4 is not in use)."""
    from vllm_omni_edge.quantization.evidence import kernel_counts

    counts = kernel_counts()
    return counts if len(counts) > 2 else {}  # more than the two totals: layers exist


def _cpu_int4_other_layers() -> list[dict]:
    """cpu_int4 layers left unquantized or on the dequant fallback, and why."""
    from vllm_omni_edge.quantization.evidence import layer_choices

    keys = ("prefix", "kind", "kernel", "reason", "in_features", "out_features")
    return [{k: c[k] for k in keys} for c in layer_choices() if c["kernel"] in ("dequant", "unquantized")]


def _cpu_int4_routing() -> dict | None:
    """The router's decision for this CPU (None when cpu_int4 is not in use)."""
    if not _cpu_int4_kernel_counts():
        return None
    from vllm_omni_edge.routing.weight_path import decision_for_this_cpu

    return decision_for_this_cpu().as_dict()


def _unique_tensors(model):
    """Parameters and buffers, each storage counted once (tied weights share one)."""
    seen: set[int] = set()
    for tensor in list(model.parameters()) + list(model.buffers()):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen or tensor.device.type == "meta":
            continue
        seen.add(ptr)
        yield tensor


def weight_class(module_name: str, module, embedding_types: tuple, head_types: tuple) -> str:
    """What a parameter's owner is, for the memory breakdown: embedding, head, linear or other."""
    if isinstance(module, head_types) or module_name.endswith("lm_head"):
        return "head"
    if isinstance(module, embedding_types):
        return "embedding"
    if hasattr(module, "quant_method") or module_name.rsplit(".", 1)[-1].endswith("proj"):
        return "linear"
    return "other"


def _weights_by_class(model, embedding_types: tuple, head_types: tuple) -> dict[str, int]:
    """Bytes of parameters and buffers by the class of the module that owns them, each storage
    once (a head tied to the embedding is counted where it is met first, the embedding)."""
    by_class: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    for name, module in model.named_modules():
        kind = weight_class(name, module, embedding_types, head_types)
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or tensor.device.type == "meta":
                continue
            seen.add(storage.data_ptr())
            by_class[kind] += storage.nbytes()
    return dict(by_class)


def update_worker_evidence(**fields) -> Path | None:
    """Rewrite fields of this process's worker record, if it wrote one (a start-up step that
    finishes after the worker's record, e.g. the engine core's freeze)."""
    out = evidence_dir()
    path = out / f"worker-{os.getpid()}.json" if out is not None else None
    if path is None or not path.is_file():
        return None
    record = json.loads(path.read_text())
    record.update(fields)
    return _write(path.name, record)


def write_worker_evidence(worker) -> Path | None:
    record = collect_worker_evidence(worker)
    logger.info(
        "vllm-omni-edge worker evidence: kv_cache_bytes=%d blocks=%s rope_rows=%s compiled=%s",
        record["kv_cache_bytes"],
        record["kv_num_blocks"],
        [r["rows"] for r in record["rope"]],
        record["compiled"],
    )
    return _write(f"worker-{os.getpid()}.json", record)
