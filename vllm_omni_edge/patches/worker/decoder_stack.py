"""Run a decode step's decoder layers in one call of our C++ ``DecoderStack``.

What: wraps ``GPUModelRunner._model_forward`` (the CPU runner inherits it). When every query
of the step is one token and the model is one this stack can run, the step embeds its tokens
(a cpu_int4 int8 input embedding with one op call, ``embedding_lookup``; any other through the
model's ``embed_input_ids``) and calls ``edge_cpu.DecoderStack.forward`` (``quantization/kernels/csrc/decoder_stack.cpp``)
instead of vLLM's compiled forward: per layer RMSNorm with the residual add, the QKV linear
(and its bias), the rotary embedding, our decode attention op, the output linear, the second
norm, gate/up, SiLU-and-multiply and down, then the final norm; the same ops the compiled graph
calls for the linears and the attention, the elementwise steps in C++ with vLLM's native
roundings. Prefill, mixed batches, warm-up (no metadata) and any model it cannot run take vLLM's
forward unchanged.
The stack is made on the first decode step after the KV caches are bound (``plan``), from the
model's own parameters and caches (no copies), and made again if the KV cache or the weights
are replaced. It runs a model when: the language model is vLLM's ``LlamaModel`` or
``Qwen2Model`` (their own ``forward``; Qwen2 without QK norm), on one pipeline stage without
auxiliary hidden states, LoRA or speculative decoding; every layer's decoder, attention and MLP
are those classes' own, its norms plain ``RMSNorm`` with a weight, its rotary embedding vLLM's
base computation over the whole head (any cos/sin table: Llama 3 and linear scaling keep it),
its four linears ``cpu_int4`` on one kernel, ``avx2_w4a8_rows8`` (4-bit) or
``avx512_w4a8_rows16`` (its group codes and 6-bit layers too; the MLP as the one fused op the
compiled graph calls), with no dense copy and only QKV with a bias, its attention our decode op's envelope (``cpu_attention_calls``). Anything else is named
in ``summary()['reason']``.
Why: on a small model, a CPU decode step spends much of its forward between kernels: a Python
call per linear, a Python custom op per attention layer, the compiled graph's own kernels for
norms and rotary embeddings, each dispatched from Python. One C++ call per step leaves the
kernels' work.
Flag: ``VLLM_OMNI_EDGE_DECODER_STACK=0`` keeps vLLM's forward for every step (the A/B arm);
only with the decode attention op on (``VLLM_OMNI_EDGE_DECODE_ATTENTION``).
Verified by: tests/test_decoder_stack.py (the op against the same layers run from Python on a
random small llama and qwen2 shape, bias, GQA, several requests at different lengths; which
models and batches take it; the real default model's greedy tokens with and without); the
user-command grids with ``VLLM_OMNI_EDGE_DECODER_STACK=0`` as the control arm (``step_ab`` cannot
alternate it step by step: its roundings differ from the compiled graph's, so near-ties may pick
other tokens).
Remove when: vLLM runs a CPU decode step's forward without Python between kernels (a C++
wrapper or graph replay for CPU).
"""

from __future__ import annotations

import functools

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.worker.gpu_model_runner"
MARKER = "__edge_decoder_stack__"
# The linear kernels whose ops the stack calls, by the tile rows the C++ stack names them with.
KERNELS = {"avx2_w4a8_rows8": 8, "avx512_w4a8_rows16": 16}

RECORD = PatchRecord(
    name="decoder_stack",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.GPUModelRunner._model_forward",
    process=Process.WORKER,
    why="A small model's CPU decode step spends much of its forward in Python between kernels; "
    "one C++ call runs a decode batch's layers.",
    verified_by="tests/test_decoder_stack.py (the op against the layers run from Python; which "
    "models and batches take it; the default model's greedy tokens with and without); "
    "the user-command grids against VLLM_OMNI_EDGE_DECODER_STACK=0.",
    remove_when="vLLM runs a CPU decode step's forward without Python between kernels.",
    upstream="none found",
)

# On the runner: the current Stack, or the reason none runs (a str).
_STATE_ATTR = "_edge_decoder_stack"


class Unsupported(Exception):
    """The model is not one the stack runs; the message says why."""


class Stack:
    """The C++ stack for one model, with what the step needs to check and call it."""

    def __init__(self, op, embed, embedding, layer_names, kv_cache, codes, layers, kernel):
        self.op = op
        self.kernel = kernel  # the linears' kernel name
        self.embed = embed
        self.embedding = embedding  # how embed looks tokens up, for the evidence
        self.first_layer = layer_names[0]
        self.last_layer = layer_names[-1]
        self.kv_cache = kv_cache  # layer 0's, to notice a rebound cache
        self.codes = codes  # layer 0's QKV codes, to notice reloaded weights
        self.layers = layers
        self.steps = 0


def stack_class():
    """``torch.classes.edge_cpu.DecoderStack``, or None when the kernel library is not built here."""
    import torch

    from vllm_omni_edge.quantization.kernels import native

    if native.edge_cpu_op("decode_attention") is None:
        return None
    try:
        return torch.classes.edge_cpu.DecoderStack
    except (AttributeError, RuntimeError):
        return None


def _same_method(obj, name, *classes) -> bool:
    method = getattr(type(obj), name, None)
    return any(method is getattr(cls, name, None) for cls in classes)


def _linear(module, where, bias_allowed=False):
    """(kernel name, [codes, scales, offsets, factors, top bits], group size, bias) of a cpu_int4
    linear the stack can call; an empty tensor for a part the linear does not have."""
    import torch

    kernel = getattr(module, "int4_kernel", None)
    name = getattr(kernel, "name", type(module).__name__)
    if name not in KERNELS:
        raise Unsupported(f"{where} runs {name}, not {' or '.join(KERNELS)}")
    params = module._parameters
    if params.get("dense_weight") is not None:
        raise Unsupported(f"{where} keeps a dense copy")
    bias = getattr(module, "bias", None)
    if bias is not None and (not bias_allowed or getattr(module, "skip_bias_add", False)):
        raise Unsupported(f"{where} has a bias")
    codes, scales, offsets = params["qweight"], params["scales"], params["zeros"]
    factors, high = params.get("group_factors"), params.get("qweight_high")
    if factors is None and (scales.dtype != torch.bfloat16 or offsets.dtype != torch.bfloat16):
        raise Unsupported(f"{where}'s scales are not bf16")
    if KERNELS[name] == 8 and (factors is not None or high is not None):
        raise Unsupported(f"{where} keeps group codes or 6-bit codes on {name}")
    empty = torch.empty(0, dtype=torch.uint8)
    parts = [codes.data, scales.data, offsets.data, factors.data if factors is not None else empty,
             high.data if high is not None else empty]
    return name, parts, module.int4_group_size, bias


def embedding_lookup(inner):
    """(embed, how): the token lookup the stack's steps use. A cpu_int4 int8 input embedding
    (one table, tensor parallel 1, vLLM's own ``embed_input_ids``) is read by
    ``edge_cpu::embedding_int8_rows`` (the same values as ``embedding.lookup_int8``, in one call);
    any other by the model's ``embed_input_ids``."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.models import llama, qwen2

    from vllm_omni_edge.quantization.embedding import CpuInt4EmbeddingMethod
    from vllm_omni_edge.quantization.kernels import native

    table = getattr(inner, "embed_tokens", None)
    method = getattr(table, "quant_method", None)
    op = native.edge_cpu_op("embedding_int8_rows")
    if (op is None or not _same_method(inner, "embed_input_ids", llama.LlamaModel, qwen2.Qwen2Model)
            or type(table) is not VocabParallelEmbedding or table.tp_size != 1
            or type(method) is not CpuInt4EmbeddingMethod or method.fmt != "int8"
            or "weight" in table._parameters):
        return inner.embed_input_ids, "the model's embed_input_ids"
    codes, scales, dtype = table.qweight.data, table.scales.data, table.int4_act_dtype
    return (lambda ids: op(ids, codes, scales, dtype)), "edge_cpu::embedding_int8_rows"


def _norm(module, where, rms_norm_cls):
    if type(module) is not rms_norm_cls or not getattr(module, "has_weight", True) \
            or getattr(module, "variance_size_override", None) is not None:
        raise Unsupported(f"{where} is not a plain weighted RMSNorm")
    return module.weight.data, module.variance_epsilon


def plan(runner):
    """The Stack for ``runner``'s model; Unsupported says why there is none."""
    import torch

    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.models import llama, qwen2
    from vllm.v1.attention.backends import cpu_attn

    from vllm_omni_edge.patches.worker.cpu_attention_calls import DECODE_ISAS

    cls = stack_class()
    if cls is None:
        raise Unsupported("the kernel library with DecoderStack is not built here")
    if getattr(runner, "use_aux_hidden_state_outputs", False) or getattr(runner, "speculative_config", None):
        raise Unsupported("auxiliary hidden states or speculative decoding")
    if getattr(runner, "lora_config", None) is not None:
        raise Unsupported("LoRA")
    model = runner.model
    inner = getattr(model, "model", None)
    if not _same_method(inner, "forward", llama.LlamaModel, qwen2.Qwen2Model):
        raise Unsupported(f"{type(inner).__name__} is not vLLM's LlamaModel or Qwen2Model")
    layers = list(inner.layers)
    if getattr(inner, "start_layer", 0) != 0 or getattr(inner, "end_layer", len(layers)) != len(layers):
        raise Unsupported("more than one pipeline stage")
    if getattr(inner, "aux_hidden_state_layers", ()):
        raise Unsupported("auxiliary hidden states")
    final_norm, eps = _norm(inner.norm, "the final norm", RMSNorm)
    dtype = final_norm.dtype
    weights, caches, windows, names, isas = [], [], [], [], set()
    shape = None
    group_size = kernel = None
    for i, layer in enumerate(layers):
        where = f"layer {i}"
        if not _same_method(layer, "forward", llama.LlamaDecoderLayer, qwen2.Qwen2DecoderLayer):
            raise Unsupported(f"{where} is a {type(layer).__name__}")
        attn, mlp = layer.self_attn, layer.mlp
        if not _same_method(attn, "forward", llama.LlamaAttention, qwen2.Qwen2Attention) \
                or getattr(attn, "qk_norm", False):
            raise Unsupported(f"{where}'s attention is a {type(attn).__name__} (or has QK norm)")
        if not _same_method(mlp, "forward", llama.LlamaMLP, qwen2.Qwen2MLP) or type(mlp.act_fn) is not SiluAndMul:
            raise Unsupported(f"{where}'s MLP is not gated SiLU")
        rope = attn.rotary_emb
        if not isinstance(rope, RotaryEmbedding) or not all(
                _same_method(rope, m, RotaryEmbedding) for m in ("forward_native", "forward_cpu", "forward_static")):
            raise Unsupported(f"{where}'s rotary embedding is a {type(rope).__name__}")
        layer_attn = attn.attn
        impl = layer_attn.impl
        kv_cache = getattr(layer_attn, "kv_cache", None)
        if (type(impl) is not cpu_attn.CPUAttentionBackendImpl or getattr(layer_attn, "isa", None) not in DECODE_ISAS
                or impl.kv_cache_dtype != "auto" or impl.alibi_slopes is not None or impl.logits_soft_cap
                or impl.sinks is not None or impl.kv_sharing_target_layer_name is not None
                or impl.attn_type != cpu_attn.AttentionType.DECODER):
            raise Unsupported(f"{where}'s attention is outside the decode op's envelope")
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 4 or not kv_cache.is_contiguous():
            raise Unsupported(f"{where} has no bound KV cache")
        head = attn.head_dim
        layer_shape = (attn.num_heads, attn.num_kv_heads, head, float(impl.scale), bool(rope.is_neox_style))
        if rope.rotary_dim != head or head % 16:
            raise Unsupported(f"{where}: rotary dim {rope.rotary_dim}, head size {head}")
        if shape is not None and layer_shape != shape:
            raise Unsupported("layers of different attention shapes")
        shape = layer_shape
        in_norm, in_eps = _norm(layer.input_layernorm, f"{where}'s input norm", RMSNorm)
        post_norm, post_eps = _norm(layer.post_attention_layernorm, f"{where}'s second norm", RMSNorm)
        if in_eps != eps or post_eps != eps:
            raise Unsupported("norms with different epsilons")
        qkv = _linear(attn.qkv_proj, f"{where}'s QKV", bias_allowed=True)
        out = _linear(attn.o_proj, f"{where}'s output linear")
        gate_up = _linear(mlp.gate_up_proj, f"{where}'s gate/up")
        down = _linear(mlp.down_proj, f"{where}'s down")
        sizes = {qkv[2], out[2], gate_up[2], down[2]}
        if len(sizes) != 1 or (group_size is not None and sizes != {group_size}):
            raise Unsupported("linears of different group sizes")
        group_size = qkv[2]
        kernels = {qkv[0], out[0], gate_up[0], down[0]}
        if len(kernels) != 1 or (kernel is not None and kernels != {kernel}):
            raise Unsupported(f"linears on different kernels ({', '.join(sorted(kernels | {kernel} - {None}))})")
        kernel = qkv[0]
        for t in (in_norm, post_norm, kv_cache) + ((qkv[3].data,) if qkv[3] is not None else ()):
            if t.dtype != dtype:
                raise Unsupported(f"{where} mixes dtypes ({t.dtype}, {dtype})")
        bias = qkv[3].data if qkv[3] is not None else torch.empty(0, dtype=dtype)
        weights += [in_norm, *qkv[1], bias, *out[1], post_norm, *gate_up[1], *down[1]]
        caches.append(kv_cache)
        isas.add(layer_attn.isa)
        windows.append(impl.sliding_window if impl.sliding_window is not None else -1)
        names.append(layer_attn.layer_name)
    if not layers:
        raise Unsupported("no decoder layers")
    if len(isas) != 1:
        raise Unsupported(f"layers with different KV cache layouts ({', '.join(sorted(isas))})")
    table = layers[0].self_attn.rotary_emb
    cos_sin = table.cos_sin_cache
    if any(layer.self_attn.rotary_emb.cos_sin_cache is not cos_sin for layer in layers):
        raise Unsupported("layers with different rotary tables")
    if cos_sin.dtype != dtype:
        # vLLM converts the table to the activations' dtype on the first call; do it as it does.
        cos_sin = table._match_cos_sin_cache_dtype(final_norm)
    heads, kv_heads, head, scale, neox = shape
    op = cls(weights, caches, windows, final_norm, cos_sin.contiguous(), heads, kv_heads, head, group_size,
             float(eps), scale, neox, KERNELS[kernel], isas == {"amx"})
    embed, embedding = embedding_lookup(inner)
    return Stack(op, embed, embedding, names, caches[0], layers[0].self_attn.qkv_proj.qweight, layers, kernel)


def _warn_if_eager_chosen(runner, why: str) -> None:
    """The compile choice made this engine eager for the stack, which does not run: say so."""
    from vllm_omni_edge.levers import EAGER_FOR_STACK_ATTR
    from vllm_omni_edge.log import get_logger

    if getattr(getattr(runner, "model_config", None), EAGER_FOR_STACK_ATTR, None):
        get_logger("decoder_stack").warning(
            "vllm-omni-edge: this engine runs eager because the C++ decoder stack was expected to run its "
            "decode steps, but it does not (%s): decode goes op by op; VLLM_OMNI_EDGE_COMPILE=on compiles", why)


def _current(runner):
    """The runner's Stack if its model has one and it is still valid; None otherwise."""
    state = runner.__dict__.get(_STATE_ATTR)
    if isinstance(state, Stack):
        first = state.layers[0]
        if first.self_attn.attn.kv_cache is state.kv_cache and first.self_attn.qkv_proj.qweight is state.codes:
            return state
        state = None
    if state is None:
        try:
            state = plan(runner)
        except Unsupported as why:
            state = str(why)
            _warn_if_eager_chosen(runner, state)
        runner.__dict__[_STATE_ATTR] = state
    return state if isinstance(state, Stack) else None


def decode_metadata(stack, input_ids):
    """The step's attention metadata when every query is one token and one metadata serves every
    layer; None otherwise."""
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    if not isinstance(metadata, dict):
        return None
    md = metadata.get(stack.first_layer)
    if (md is None or metadata.get(stack.last_layer) is not md or md.max_query_len != 1 or md.causal is not True
            or md.dynamic_causal is not None):
        return None
    tokens = md.num_actual_tokens
    if tokens != input_ids.shape[0] or tokens != md.seq_lens.shape[0]:
        return None
    return md


def _make(original):
    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        if input_ids is not None and inputs_embeds is None and intermediate_tensors is None and not model_kwargs:
            stack = _current(self)
            if stack is not None:
                md = decode_metadata(stack, input_ids)
                if md is not None:
                    stack.steps += 1
                    return stack.op.forward(stack.embed(input_ids), positions, md.slot_mapping, md.block_table,
                                            md.seq_lens)
        return original(self, input_ids=input_ids, positions=positions,
                        intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds, **model_kwargs)

    return _model_forward


def _wrap(module) -> None:
    runner = module.GPUModelRunner
    original = runner.__dict__["_model_forward"]
    if getattr(original, MARKER, False):
        return
    wrapper = functools.wraps(original)(_make(original))
    setattr(wrapper, MARKER, True)
    runner._model_forward = wrapper


def in_force() -> bool:
    """Whether decode steps in this process may run through the stack."""
    import sys

    module = sys.modules.get(TARGET_MODULE)
    return module is not None and getattr(module.GPUModelRunner._model_forward, MARKER, False)


def summary(runner, make: bool = False) -> dict:
    """For the evidence record: whether the runner's model runs on the stack (``make``: plan it now,
    as the first decode step would), its layers and the decode steps it ran, or why not."""
    if not in_force():
        return {"on": False, "reason": "not applied"}
    if make:
        _current(runner)
    state = runner.__dict__.get(_STATE_ATTR)
    if isinstance(state, Stack):
        return {"on": True, "layers": len(state.layers), "steps": state.steps, "embedding": state.embedding,
                "kernel": state.kernel}
    return {"on": False, "reason": state if isinstance(state, str) else "no decode step yet"}


def apply() -> str:
    from vllm_omni_edge.levers import decoder_stack_enabled

    if not decoder_stack_enabled():
        return "vLLM's forward for decode steps (flag)"
    if stack_class() is None:
        return "vLLM's forward for decode steps: the kernel library is not built here"
    now = when_imported(TARGET_MODULE, _wrap)
    return "decode steps of llama-family models through edge_cpu.DecoderStack" + ("" if now else " (on import)")
