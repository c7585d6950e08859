"""Every change we make to vLLM / vLLM-Omni, one module each, applied per process.

The lists below are the whole catalogue; each module declares its own record
(see ``base.py``). ``docs/edge/patches.md`` is generated from them.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import PatchOutcome, apply_patch_module, outcomes

# Applied by the vllm.general_plugins entry point, in every vLLM process (front end,
# engine core, workers). Front-end patches shape the environment the children
# inherit; worker patches must be redone in each spawned interpreter.
PLUGIN_PATCHES: tuple[str, ...] = (
    "vllm_omni_edge.patches.frontend.env_validation",
    "vllm_omni_edge.patches.frontend.reserved_cores",
    "vllm_omni_edge.patches.frontend.kv_budget",
    "vllm_omni_edge.patches.frontend.compile_choice",
    "vllm_omni_edge.patches.frontend.fp16_as_float32",
    "vllm_omni_edge.patches.frontend.encoder_batched_tokens",
    "vllm_omni_edge.patches.frontend.transcription_text_format",
    "vllm_omni_edge.patches.frontend.whisper_prompt",
    "vllm_omni_edge.patches.worker.kv_default_exact",
    "vllm_omni_edge.patches.worker.kv_resident_as_used",
    "vllm_omni_edge.patches.frontend.single_process",
    "vllm_omni_edge.patches.frontend.stream_chunk_time",
    "vllm_omni_edge.patches.frontend.llm_in_process",
    "vllm_omni_edge.patches.frontend.omni_plugin_by_model",
    "vllm_omni_edge.patches.frontend.engine_start_gc",
    "vllm_omni_edge.patches.worker.cpu_int4_registration",
    "vllm_omni_edge.patches.worker.whisper_int4_vocab",
    "vllm_omni_edge.patches.worker.amx_tile_permission",
    "vllm_omni_edge.patches.worker.compile_cache_load",
    "vllm_omni_edge.patches.worker.compile_cache_key",
    "vllm_omni_edge.patches.worker.isa_probe_memo",
    "vllm_omni_edge.patches.worker.torch_key_memo",
    "vllm_omni_edge.patches.worker.precompiled_header_memo",
    "vllm_omni_edge.patches.worker.compile_warmup_tokens",
    "vllm_omni_edge.patches.worker.compile_progress",
    "vllm_omni_edge.patches.worker.cpu_random_sample",
    "vllm_omni_edge.patches.worker.sampler_argmax",
    "vllm_omni_edge.patches.worker.seeded_prompt_chunk",
    "vllm_omni_edge.patches.worker.cpu_attention_calls",
    "vllm_omni_edge.patches.worker.fused_silu_mlp",
    "vllm_omni_edge.patches.worker.compiled_graph_args",
    "vllm_omni_edge.patches.worker.slot_mapping_call",
    "vllm_omni_edge.patches.worker.decoder_stack",
    "vllm_omni_edge.patches.worker.stack_step_inputs",
    "vllm_omni_edge.patches.worker.engine_core_parent_watch",
    "vllm_omni_edge.patches.worker.rope_cap",
    "vllm_omni_edge.patches.worker.embedding_prepack",
    "vllm_omni_edge.patches.worker.checkpoint_read_per_tensor",
    "vllm_omni_edge.patches.worker.heap_trim",
    "vllm_omni_edge.patches.worker.idle_trim",
    "vllm_omni_edge.patches.worker.startup_code_pages",
    "vllm_omni_edge.patches.worker.shm_reader_wait",
    "vllm_omni_edge.patches.worker.front_end_thread_count",
    "vllm_omni_edge.patches.common.torchaudio_fallback",
    "vllm_omni_edge.patches.common.torchvision_native_ops",
    "vllm_omni_edge.patches.common.lazy_imports",
    "vllm_omni_edge.patches.common.transformers_import_memo",
    "vllm_omni_edge.patches.common.import_gc",
    "vllm_omni_edge.patches.common.inductor_fallback_deferred",
    "vllm_omni_edge.patches.common.import_compile_lazy",
    "vllm_omni_edge.patches.worker.qwen2_5_omni_voice_type",
    "vllm_omni_edge.patches.frontend.diffusion_chat_modalities",
    "vllm_omni_edge.patches.frontend.spoken_question_pipeline",
    "vllm_omni_edge.patches.frontend.image_size_multiple",
    "vllm_omni_edge.patches.frontend.chat_template_probe",
    "vllm_omni_edge.patches.frontend.tokenizer_pool",
    "vllm_omni_edge.patches.frontend.processor_tokenizer",
    "vllm_omni_edge.patches.frontend.tokenizer_tables",
    "vllm_omni_edge.patches.frontend.tokenizer_copies",  # after tokenizer_tables: wraps its wrapper
    "vllm_omni_edge.patches.frontend.tokenizer_load_once",
    "vllm_omni_edge.patches.worker.evidence_recorder",
    # Also a CLI patch; here too so `python -m vllm.entrypoints...` servers get it.
    "vllm_omni_edge.patches.frontend.api_key_all_routes",
)

# Applied by our console scripts before vLLM's CLI is imported: the CLI crashes,
# or imports torchaudio, before vLLM loads general plugins.
CLI_PATCHES: tuple[str, ...] = (
    "vllm_omni_edge.patches.frontend.cli_version_lookup",
    "vllm_omni_edge.patches.common.torchaudio_fallback",
    "vllm_omni_edge.patches.common.torchvision_native_ops",
    "vllm_omni_edge.patches.common.lazy_imports",
    "vllm_omni_edge.patches.common.transformers_import_memo",
    "vllm_omni_edge.patches.frontend.api_key_all_routes",
    "vllm_omni_edge.patches.frontend.engine_death_exit",
    "vllm_omni_edge.patches.frontend.startup_gc",
    "vllm_omni_edge.patches.frontend.omni_plugin_by_model",
)

ALL_PATCHES: tuple[str, ...] = tuple(dict.fromkeys(PLUGIN_PATCHES + CLI_PATCHES))


def apply_plugin_patches() -> dict[str, PatchOutcome]:
    for module in PLUGIN_PATCHES:
        apply_patch_module(module)
    return outcomes()


def apply_cli_patches() -> dict[str, PatchOutcome]:
    for module in CLI_PATCHES:
        apply_patch_module(module)
    return outcomes()
