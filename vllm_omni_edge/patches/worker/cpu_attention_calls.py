"""Cut the Python work around each CPU attention call of a decoder layer.

What: wraps ``CPUAttentionBackendImpl.do_kv_cache_update`` and ``.forward`` (vLLM's CPU
attention backend). For decoder self-attention they do what vLLM does, with three
per-call costs gone: the key/value cache views (``view`` + ``chunk`` of the layer's KV
tensor) are made once per KV tensor and kept on the layer; the ``_C`` ops are called
through their resolved overload, not through ``vllm._custom_ops``' keyword wrappers and
the overload packet; ``query``/``output`` are sliced only when the batch was padded.
Encoder attention, fused output quantization and warm-up (no metadata) go to vLLM's
own code unchanged.
One call (``VLLM_OMNI_EDGE_ATTENTION_ONE_CALL``, default on): ``CPUAttentionBackend`` also
declares ``forward_includes_kv_cache_update``, so vLLM's Attention layer traces one custom
op per layer (``unified_attention_with_output``), not two, and ``forward`` writes the new
keys and values (``attn_metadata.slot_mapping``, unpadded then) before attending: the same
write, one Python custom op dispatch less per layer and step. Layers sharing another's KV
cache and steps without keys write nothing, as vLLM's separate update did.
Decode (``VLLM_OMNI_EDGE_DECODE_ATTENTION``, default on): when every query of the batch is one
token and the layer is plain causal self-attention on vLLM's ``vec``/``vec16`` cache layout or
its ``amx`` layout (bf16 on AMX CPUs) (no ALiBi, soft cap, sinks or fp8 KV; head size a multiple
of 16, of 32 for ``amx``), one call of our
``edge_cpu::decode_attention`` (``quantization/kernels/csrc/decode_attention.cpp``) writes the
keys and values and attends: vLLM's tiled op carries a fixed cost per call that a one-token
query does not need, and its KV write is a second call. Prefill and mixed batches keep vLLM's op.
Why: vLLM's compiled model calls these two Python custom ops once per layer per step (the
graph cannot hold them). py-spy, SmolLM2-135M one process: the two paths took 15.7 % of a step, their
native kernels ~4 %. Micro-benchmark on this box (busy): view + chunk 9.8 us, the
keyword wrapper 17.0 vs 13.5 us through the overload, a slice 2.6 us. Measured end to
end (``2026-12-01-cpp-wrapper-default``, 5 interleaved passes, one process, with inductor's C++
wrapper, an experiment since removed):
SmolLM2 decode 1.25x (1.19-1.37) with the trimmed calls, far more than these per-call
costs add up to; the grid measures it, the profile does not explain all of it.
Flags: ``VLLM_OMNI_EDGE_ATTENTION_CALLS=0`` keeps vLLM's code (the A/B arm);
``VLLM_OMNI_EDGE_ATTENTION_ONE_CALL=0`` keeps the separate KV update op;
``VLLM_OMNI_EDGE_DECODE_ATTENTION=0`` keeps vLLM's attention op for decode batches.
Verified by: tests/test_cpu_attention_calls.py (same cache writes and outputs as vLLM's
code on random paged batches, views reused and renewed with a new KV tensor, fallbacks,
idempotent; one call: same cache and output as vLLM's two calls, padded and not, and the
backend's flag set; decode: the op against vLLM's ops over dtypes, GQA shapes, windows and
paged batches, and which batches take it); decode A/B grids, named in the RECORD's ``verified_by``.
Remove when: vLLM's CPU attention backend caches its cache views and calls its ops
without the keyword wrappers (or the attention moves into the compiled graph); the decode op
when vLLM's CPU attention op has a one-token path without its per-call fixed cost.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.attention.backends.cpu_attn"

RECORD = PatchRecord(
    name="cpu_attention_calls",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.CPUAttentionBackendImpl.do_kv_cache_update / .forward, "
    "CPUAttentionBackend.forward_includes_kv_cache_update",
    process=Process.WORKER,
    why="Per layer and step, vLLM's CPU attention remakes its KV cache views and calls its ops "
    "through keyword wrappers: Python work on the decode step's critical path.",
    verified_by="tests/test_cpu_attention_calls.py (same writes and outputs as vLLM's code); "
    "results/2026-12-01-cpp-wrapper-default/grid.yaml, results/2026-12-01-attention-calls-default/grid.yaml; "
    "the decode op: tests/test_decode_attention.py, results/2026-12-06-step-ab-decode-attention-*.",
    remove_when="vLLM's CPU attention backend caches its cache views and calls its ops directly.",
    upstream="none found",
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


# Layouts our decode op reads: vLLM's CPU cache with the key half dim-major, and its AMX layout
# (bfloat16 pairs; checked in the tests).
DECODE_ISAS = ("vec", "vec16", "amx")
# On the layer: whether our decode op can serve it (constant for a layer once its ISA is set).
_DECODE_ATTR = "_edge_decode_attention"


def decode_op():
    """Our decode attention op, or None when the kernel library is not built or not loadable here."""
    from vllm_omni_edge.quantization.kernels import native

    return native.edge_cpu_op("decode_attention")


def _serves(impl, layer, query) -> bool:
    ok = getattr(layer, _DECODE_ATTR, None)
    if ok is None:
        ok = (getattr(layer, "isa", None) in DECODE_ISAS and impl.kv_cache_dtype == "auto"
              and impl.alibi_slopes is None and not impl.logits_soft_cap and impl.sinks is None
              and impl.head_size % (32 if layer.isa == "amx" else 16) == 0 and query.dim() == 3)
        setattr(layer, _DECODE_ATTR, ok)
    return ok


def _make_forward(encoder_types, writes_kv: bool, decode=None):
    import torch

    attention = torch.ops._C.cpu_attention_with_kv_cache.default
    reshape_and_cache = torch.ops._C.cpu_attn_reshape_and_cache.default

    def make(original):
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                    output_scale=None, output_block_scale=None):
            if (attn_metadata is None or output_scale is not None or output_block_scale is not None
                    or self.attn_type in encoder_types):
                return original(self, layer, query, key, value, kv_cache, attn_metadata, output,
                                output_scale, output_block_scale)
            tokens = attn_metadata.num_actual_tokens
            writes = (writes_kv and key is not None and value is not None
                      and self.kv_sharing_target_layer_name is None)
            if (decode is not None and attn_metadata.max_query_len == 1 and attn_metadata.causal is True
                    and attn_metadata.dynamic_causal is None and tokens == attn_metadata.seq_lens.shape[0]
                    and _serves(self, layer, query)):
                # One token a request: write and attend in one call of our op.
                decode(query, key, value, kv_cache, output, attn_metadata.slot_mapping,
                       attn_metadata.block_table, attn_metadata.seq_lens, self.scale, self.sliding_window,
                       writes, layer.isa == "amx")
                return output
            key_cache, value_cache = kv_cache_views(layer, kv_cache)
            if writes:
                # What vLLM's separate unified_kv_cache_update did; the slot mapping is unpadded here.
                slots = attn_metadata.slot_mapping
                rows = slots.shape[0]
                reshape_and_cache(key if key.shape[0] == rows else key[:rows],
                                  value if value.shape[0] == rows else value[:rows],
                                  key_cache, value_cache, slots, layer.isa,
                                  layer._k_scale_float, layer._v_scale_float, self.kv_cache_dtype)
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


def one_call_in_force() -> bool:
    """Whether each decoder layer's KV write happens inside its attention call (one op, not two)."""
    import sys

    module = sys.modules.get(TARGET_MODULE)
    return in_force() and module is not None and module.CPUAttentionBackend.forward_includes_kv_cache_update


def decode_in_force() -> bool:
    """Whether one-token batches in this process attend through our decode op."""
    import sys

    module = sys.modules.get(TARGET_MODULE)
    return in_force() and getattr(module.CPUAttentionBackendImpl.forward, "__edge_decode__", False)


def forward_without_decode(module):
    """The trimmed forward with the decode op left out (a step-by-step A/B's off arm)."""
    import functools

    encoder_types = (module.AttentionType.ENCODER_ONLY, module.AttentionType.ENCODER)
    writes_kv = bool(module.CPUAttentionBackend.forward_includes_kv_cache_update)
    original = module.CPUAttentionBackendImpl.forward.__wrapped__
    return functools.wraps(original)(_make_forward(encoder_types, writes_kv, None)(original))


def _wrap(module, writes_kv: bool = False, decode=None) -> None:
    encoder_types = (module.AttentionType.ENCODER_ONLY, module.AttentionType.ENCODER)
    impl = module.CPUAttentionBackendImpl
    wrap_method_once(impl, "do_kv_cache_update", _make_kv_update(encoder_types))
    if wrap_method_once(impl, "forward", _make_forward(encoder_types, writes_kv, decode)):
        impl.forward.__edge_decode__ = decode is not None
        if writes_kv:
            # Read by vLLM's Attention.forward when dynamo traces it: no unified_kv_cache_update
            # op in the graph; and by the model runner: slot mappings unpadded.
            module.CPUAttentionBackend.forward_includes_kv_cache_update = True


def apply() -> str:
    from vllm_omni_edge.levers import attention_calls_enabled, attention_one_call_enabled, decode_attention_enabled

    if not attention_calls_enabled():
        return "vLLM's CPU attention calls kept (flag)"
    writes_kv = attention_one_call_enabled()
    decode = decode_op() if decode_attention_enabled() else None
    now = when_imported(TARGET_MODULE, lambda module: _wrap(module, writes_kv, decode))
    return ("CPU attention calls trimmed" + (", KV written in the attention call" if writes_kv else "")
            + (", decode through edge_cpu::decode_attention" if decode is not None else "")
            + ("" if now else " (on import)"))
