"""Cut the Python work around each CPU attention call of a decoder layer.

What: wraps ``CPUAttentionBackendImpl.do_kv_cache_update`` and ``.forward`` (vLLM's CPU
attention backend). For decoder self-attention they do what vLLM does, with three
per-call costs gone: the key/value cache views (``view`` + ``chunk`` of the layer's KV
tensor) are made once per KV tensor and kept on the layer; the ``_C`` ops are called
through their resolved overload, not through ``vllm._custom_ops``' keyword wrappers and
the overload packet; ``query``/``output`` are sliced only when the batch was padded.
Encoder attention, fused output quantization and warm-up (no metadata) go to vLLM's
own code unchanged.
Why: vLLM's compiled model calls these two Python custom ops once per layer per step (the
graph cannot hold them); with inductor's C++ wrapper they are most of the Python left in a
decode step. py-spy, SmolLM2-135M one process: the two paths took 15.7 % of a step, their
native kernels ~4 %. Micro-benchmark on this box (busy): view + chunk 9.8 us, the
keyword wrapper 17.0 vs 13.5 us through the overload, a slice 2.6 us. Measured end to
end (``2026-12-01-cpp-wrapper-default``, 5 interleaved passes, one process, C++ wrapper):
SmolLM2 decode 1.25x (1.19-1.37) with the trimmed calls, far more than these per-call
costs add up to; the grid measures it, the profile does not explain all of it.
Flag: ``VLLM_OMNI_EDGE_ATTENTION_CALLS=0`` keeps vLLM's code (the A/B arm).
Verified by: tests/test_cpu_attention_calls.py (same cache writes and outputs as vLLM's
code on random paged batches, views reused and renewed with a new KV tensor, fallbacks,
idempotent); decode in ``grids/cpp-wrapper-default.yaml`` (A/B) and
``grids/attention-calls-default.yaml``.
Remove when: vLLM's CPU attention backend caches its cache views and calls its ops
without the keyword wrappers (or the attention moves into the compiled graph).
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.attention.backends.cpu_attn"

RECORD = PatchRecord(
    name="cpu_attention_calls",
    target=f"{TARGET_MODULE}.CPUAttentionBackendImpl.do_kv_cache_update / .forward",
    process=Process.WORKER,
    why="Per layer and step, vLLM's CPU attention remakes its KV cache views and calls its ops "
    "through keyword wrappers: with the C++ wrapper that Python is most of what remains of a "
    "decode step outside the kernels.",
    verified_by="tests/test_cpu_attention_calls.py (same writes and outputs as vLLM's code); "
    "grids/cpp-wrapper-default.yaml, grids/attention-calls-default.yaml.",
    remove_when="vLLM's CPU attention backend caches its cache views and calls its ops directly.",
)

# On the layer: (the KV tensor the views were made from, key view, value view).
_VIEWS_ATTR = "_edge_kv_cache_views"


def kv_cache_views(layer, kv_cache):
    """vLLM's ``[blocks, kv_heads, block_size, 2 * head]`` cache as key and value views, made once."""
    cached = getattr(layer, _VIEWS_ATTR, None)
    if cached is not None and cached[0] is kv_cache:
        return cached[1], cached[2]
    num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
    key_cache, value_cache = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1)).chunk(2, dim=2)
    setattr(layer, _VIEWS_ATTR, (kv_cache, key_cache, value_cache))
    return key_cache, value_cache


def _make_kv_update(encoder_types):
    import torch

    reshape_and_cache = torch.ops._C.cpu_attn_reshape_and_cache.default

    def make(original):
        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            if self.attn_type in encoder_types:
                return original(self, layer, key, value, kv_cache, slot_mapping)
            key_cache, value_cache = kv_cache_views(layer, kv_cache)
            reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, layer.isa,
                              layer._k_scale_float, layer._v_scale_float, self.kv_cache_dtype)

        return do_kv_cache_update

    return make


def _make_forward(encoder_types):
    import torch

    attention = torch.ops._C.cpu_attention_with_kv_cache.default

    def make(original):
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                    output_scale=None, output_block_scale=None):
            if (attn_metadata is None or output_scale is not None or output_block_scale is not None
                    or self.attn_type in encoder_types):
                return original(self, layer, query, key, value, kv_cache, attn_metadata, output,
                                output_scale, output_block_scale)
            tokens = attn_metadata.num_actual_tokens
            key_cache, value_cache = kv_cache_views(layer, kv_cache)
            attention(
                query if query.shape[0] == tokens else query[:tokens],
                key_cache, value_cache,
                output if output.shape[0] == tokens else output[:tokens],
                attn_metadata.query_start_loc, attn_metadata.seq_lens, self.scale, attn_metadata.causal,
                self.alibi_slopes, self.sliding_window, attn_metadata.block_table, self.logits_soft_cap,
                attn_metadata.scheduler_metadata, self.sinks, attn_metadata.dynamic_causal,
                layer._k_scale_float, layer._v_scale_float, self.kv_cache_dtype,
            )
            return output

        return forward

    return make


def in_force() -> bool:
    """Whether vLLM's CPU attention backend in this process runs the trimmed calls."""
    import sys

    module = sys.modules.get(TARGET_MODULE)
    return module is not None and getattr(module.CPUAttentionBackendImpl.forward, "__edge_wrapped__", False)


def _wrap(module) -> None:
    encoder_types = (module.AttentionType.ENCODER_ONLY, module.AttentionType.ENCODER)
    impl = module.CPUAttentionBackendImpl
    wrap_method_once(impl, "do_kv_cache_update", _make_kv_update(encoder_types))
    wrap_method_once(impl, "forward", _make_forward(encoder_types))


def apply() -> str:
    from vllm_omni_edge.levers import attention_calls_enabled

    if not attention_calls_enabled():
        return "vLLM's CPU attention calls kept (flag)"
    now = when_imported(TARGET_MODULE, _wrap)
    return "CPU attention calls trimmed" + ("" if now else " (on import)")
