"""Our C++ decoder stack computes a decode step's layers as vLLM's native ops do, and the runner
sends exactly the one-token steps of a model it can run to it."""

from __future__ import annotations

import types

import pytest
import torch

from tests.e2e.probe import run_script_probe
from tests.quantization.helpers import int4_layer, relative_error
from vllm_omni_edge.cpu_features import CpuFeatures
from vllm_omni_edge.patches.worker import decoder_stack as patch
from vllm_omni_edge.quantization.embedding import lookup_int8
from vllm_omni_edge.quantization import int4
from vllm_omni_edge.quantization.kernels import native
from vllm_omni_edge.quantization.kernels.base import high_bits
from vllm_omni_edge.quantization.kernels.w4a8_avx2 import Avx2W4A8Rows8Kernel
from vllm_omni_edge.quantization.kernels.w4a8_avx512 import Avx512VnniRows16W4A8Kernel, group_factors

LOADED, WHY = native.load_library()
pytestmark = pytest.mark.skipif(not LOADED or patch.stack_class() is None,
                                reason=f"decoder stack unavailable: {WHY}")

GROUP = 32
VNNI, VNNI_WHY = Avx512VnniRows16W4A8Kernel.can_implement(CpuFeatures.detect(), GROUP, 64, 16, torch.float32,
                                                          float_zero=True)
# The linear kernels the stack runs on: rows8 (AVX2), and rows16 (AVX-512 VNNI) with its default
# 8-bit group codes, with the stored bf16 pairs (VLLM_OMNI_EDGE_INT4_GROUP_CODES=bf16), and with
# 6-bit output and down linears (as a Q4_K_M's promoted layers are built).
KERNELS = ["rows8", *(pytest.param(k, marks=pytest.mark.skipif(not VNNI, reason=f"avx512_w4a8_rows16 cannot run here: {VNNI_WHY}"))
                      for k in ("rows16", "rows16-bf16", "rows16-6bit"))]


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    if request.param == "rows16-bf16":
        monkeypatch.setenv("VLLM_OMNI_EDGE_INT4_GROUP_CODES", "bf16")
    return request.param


def _linear(N, K, dtype, seed, kernel, six_bit=False):
    if six_bit and kernel == "rows16-6bit":
        layer = torch.nn.Module()
        weight = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
        for name, t in zip(("qweight", "qweight_high", "scales", "zeros"), int4.quantize_6bit(weight, GROUP)):
            layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        layer.int4_in_features, layer.int4_group_size, layer.int4_act_dtype = K, GROUP, dtype
    else:
        layer, _ = int4_layer(N, K, GROUP, dtype, seed)
    (Avx2W4A8Rows8Kernel() if kernel == "rows8" else Avx512VnniRows16W4A8Kernel()).process_weights(layer)
    return layer


def _parts(layer):
    """A linear's five tensors as the stack takes them (empty for a part it does not have)."""
    empty = torch.empty(0, dtype=torch.uint8)
    factors, high = group_factors(layer), high_bits(layer)
    return [layer.qweight.data, layer.scales.data, layer.zeros.data, empty if factors is None else factors,
            empty if high is None else high]


class _Model:
    """A random llama-family decoder (cpu_int4 linears on ``kernel``) and its paged KV caches."""

    def __init__(self, dtype, layers, heads, kv_heads, head, inter, bias, neox=True, blocks=24, block=16,
                 positions=512, seed=0, kernel="rows8"):
        g = torch.Generator().manual_seed(seed)
        H = heads * head
        self.dtype, self.heads, self.kv_heads, self.head, self.neox, self.eps = dtype, heads, kv_heads, head, neox, 1e-5
        self.kernel = kernel
        self.layers = []
        for i in range(layers):
            s = seed + 10 * i
            self.layers.append(dict(
                in_norm=(1 + 0.1 * torch.randn(H, generator=g)).to(dtype),
                post_norm=(1 + 0.1 * torch.randn(H, generator=g)).to(dtype),
                qkv=_linear((heads + 2 * kv_heads) * head, H, dtype, s + 1, kernel),
                bias=(0.1 * torch.randn((heads + 2 * kv_heads) * head, generator=g)).to(dtype) if bias else None,
                out=_linear(H, H, dtype, s + 2, kernel, six_bit=True),
                gate_up=_linear(2 * inter, H, dtype, s + 3, kernel),
                down=_linear(H, inter, dtype, s + 4, kernel, six_bit=True),
                kv=(0.5 * torch.randn(blocks, kv_heads, block, 2 * head, generator=g)).to(dtype),
            ))
        self.final_norm = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
        inv = 1.0 / (10000 ** (torch.arange(0, head, 2).float() / head))
        freqs = torch.outer(torch.arange(positions).float(), inv)
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)
        self.block, self.blocks = block, blocks

    def stack(self, windows=None, amx=False):
        windows = windows or [-1] * len(self.layers)
        return patch.stack_class()(self.weights(), [layer["kv"] for layer in self.layers], windows, self.final_norm,
                                   self.cos_sin, self.heads, self.kv_heads, self.head, GROUP, self.eps,
                                   self.head ** -0.5, self.neox, 8 if self.kernel == "rows8" else 16, amx)

    def weights(self):
        weights = []
        for layer in self.layers:
            for name in ("in_norm", "qkv", "bias", "out", "post_norm", "gate_up", "down"):
                v = layer[name]
                if name in ("qkv", "out", "gate_up", "down"):
                    weights += _parts(v)
                elif name == "bias":
                    weights.append(v if v is not None else torch.empty(0, dtype=self.dtype))
                else:
                    weights.append(v)
        return weights

    def batch(self, lens, seed=1):
        """Block tables, the new tokens' slots, positions and hidden inputs for one decode step."""
        g = torch.Generator().manual_seed(seed)
        per_request = max((n + self.block - 1) // self.block for n in lens)
        table = torch.randperm(self.blocks, generator=g)[: len(lens) * per_request].to(torch.int32)
        table = table.view(len(lens), per_request)
        slots = torch.tensor([int(table[r, (n - 1) // self.block]) * self.block + (n - 1) % self.block
                              for r, n in enumerate(lens)])
        positions = torch.tensor([n - 1 for n in lens])
        x = torch.randn(len(lens), self.heads * self.head, generator=g).to(self.dtype)
        return x, positions, slots, table, torch.tensor(lens, dtype=torch.int32)


def _reference(model, x, positions, slots, table, seq_lens, windows=None):
    """The step as vLLM's native ops compute it, the linears and attention by the same ops;
    on copies of the KV caches. (final hidden, caches)."""
    from vllm.ir.ops.layernorm import fused_add_rms_norm, rms_norm
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if model.kernel == "rows8":
        def mm(x, lin):
            return torch.ops.edge_cpu_int4.w4a8_avx2_rows8_mm(x, lin.qweight, lin.scales, lin.zeros, GROUP)
    else:
        def mm(x, lin):
            return torch.ops.edge_cpu_int4.w4a8_vnni_rows16_mm(x, lin.qweight, lin.scales, lin.zeros, GROUP,
                                                                 group_factors(lin), high_bits(lin))
    heads, kv_heads, head = model.heads, model.kv_heads, model.head
    q_size, kv_size = heads * head, kv_heads * head
    caches = [layer["kv"].clone() for layer in model.layers]
    residual, h = None, x
    for i, layer in enumerate(model.layers):
        if residual is None:
            residual, h = h, rms_norm(h, layer["in_norm"], model.eps)
        else:
            h, residual = fused_add_rms_norm(h, residual, layer["in_norm"], model.eps)
        qkv = mm(h, layer["qkv"])
        if layer["bias"] is not None:
            qkv = qkv + layer["bias"]
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = RotaryEmbedding.forward_static(positions, q, k, head, head, model.cos_sin, model.neox)
        out = torch.empty(x.shape[0], q_size, dtype=x.dtype)
        window = windows[i] if windows else -1
        torch.ops.edge_cpu.decode_attention(q.reshape(-1, heads, head), k.reshape(-1, kv_heads, head),
                                            v.reshape(-1, kv_heads, head), caches[i], out, slots, table, seq_lens,
                                            head ** -0.5, window, True)
        h = mm(out, layer["out"])
        h, residual = fused_add_rms_norm(h, residual, layer["post_norm"], model.eps)
        gu = mm(h, layer["gate_up"])
        inter = gu.shape[-1] // 2
        a = (torch.nn.functional.silu(gu[:, :inter].float()) * gu[:, inter:].float()).to(x.dtype)
        h = mm(a, layer["down"])
    h, _ = fused_add_rms_norm(h, residual, model.final_norm, model.eps)
    return h, caches


def _written(cache, slots, block, head):
    """The keys and values in ``slots`` of a cache [blocks, kv heads, block, 2 * head]: per (block,
    kv head) keys as [head][block positions], then values as [block positions][head]."""
    blocks, kv_heads = cache.shape[:2]
    halves = cache.view(blocks, kv_heads, 2, block * head)
    keys = halves[:, :, 0].view(blocks, kv_heads, head, block)
    values = halves[:, :, 1].view(blocks, kv_heads, block, head)
    b, p = slots // block, slots % block
    return keys[b, :, :, p], values[b, :, p, :]


SHAPES = [  # layers, heads, kv heads, head, intermediate, qkv bias, neox, sequence lengths
    (1, 9, 3, 64, 512, False, True, [40]),  # SmolLM2's attention shape, one request
    (1, 6, 2, 32, 384, True, True, [1, 17, 60]),  # Qwen2's bias, requests at block edges
    (1, 4, 4, 32, 256, False, False, [5, 33]),  # no grouping, GPT-J style rotation
    (3, 9, 3, 64, 512, False, True, [40, 3]),
    (3, 6, 2, 32, 384, True, False, [1, 17, 60]),
]
# The first layer's keys and values: the same ops and roundings up to the order of float32 sums.
KV_TIGHT = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
# Anything after a linear's input: each linear quantizes its input to int8 per block of 32, and a
# rounding that flips there (a float32 sum ordered otherwise is enough) moves its output by up to
# half a step of that block; the differences grow with depth. A wrong step is far outside these
# (test_a_wrong_rotation_or_residual_is_far_outside).
OUT = {torch.bfloat16: 2e-2, torch.float32: 5e-3}
DEEP = 6e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"L{s[0]}-{s[1]}x{s[2]}x{s[3]}-bias{int(s[5])}-neox{int(s[6])}")
def test_the_stack_computes_the_layers_as_vllms_native_ops(dtype, shape, kernel):
    layers, heads, kv_heads, head, inter, bias, neox, lens = shape
    model = _Model(dtype, layers, heads, kv_heads, head, inter, bias, neox, kernel=kernel)
    x, positions, slots, table, seq_lens = model.batch(lens)
    want, want_caches = _reference(model, x, positions, slots, table, seq_lens)
    got = model.stack().forward(x, positions, slots, table, seq_lens)
    assert got.dtype == dtype and got.shape == want.shape
    assert relative_error(got, want) < (OUT[dtype] if layers == 1 else DEEP)
    for i, (layer, cache) in enumerate(zip(model.layers, want_caches)):
        for ours, theirs in zip(_written(layer["kv"], slots, model.block, head),
                                _written(cache, slots, model.block, head)):
            assert relative_error(ours, theirs) < (KV_TIGHT[dtype] if i == 0 else DEEP)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_wrong_rotation_or_residual_is_far_outside(dtype, kernel):
    model = _Model(dtype, 3, 9, 3, 64, 512, True, True, kernel=kernel)
    x, positions, slots, table, seq_lens = model.batch([40, 3])
    want, want_caches = _reference(model, x, positions, slots, table, seq_lens)
    keys = _written(want_caches[0], slots, model.block, model.head)[0]
    model.neox = False
    model.stack().forward(x, positions, slots, table, seq_lens)
    assert relative_error(_written(model.layers[0]["kv"], slots, model.block, model.head)[0], keys) > 10 * KV_TIGHT[dtype]
    # The final norm's weight left out: what a lost residual or norm step looks like at the output.
    model.neox = True
    model.final_norm = torch.ones_like(model.final_norm)
    wrong = model.stack().forward(x, positions, slots, table, seq_lens)
    assert relative_error(wrong, want) > DEEP


def _to_amx(cache):
    """A cache in the vec layout rearranged into vLLM's amx layout (decode_attention.cpp): keys
    [block / 16][head / 2][16][2], values [head / 16][block / 2][16][2]."""
    blocks, kv_heads, block, two_head = cache.shape
    D = two_head // 2
    halves = cache.reshape(blocks, kv_heads, 2, block * D)
    keys = halves[:, :, 0].reshape(blocks, kv_heads, D // 2, 2, block // 16, 16).permute(0, 1, 4, 2, 5, 3)
    values = halves[:, :, 1].reshape(blocks, kv_heads, block // 2, 2, D // 16, 16).permute(0, 1, 4, 2, 5, 3)
    return torch.cat([keys.reshape(blocks, kv_heads, -1), values.reshape(blocks, kv_heads, -1)], -1).view(cache.shape)


def test_on_the_amx_layout_the_stack_computes_what_it_computes_on_the_vec_layout(kernel):
    model = _Model(torch.bfloat16, 2, 9, 3, 64, 512, True, kernel=kernel)
    x, positions, slots, table, seq_lens = model.batch([40, 3, 17])
    vec = [layer["kv"].clone() for layer in model.layers]
    for layer in model.layers:
        layer["kv"] = _to_amx(layer["kv"])
    amx_out = model.stack(amx=True).forward(x, positions, slots, table, seq_lens)
    amx = [layer["kv"] for layer in model.layers]
    for layer, cache in zip(model.layers, vec):
        layer["kv"] = cache
    vec_out = model.stack().forward(x, positions, slots, table, seq_lens)
    assert relative_error(amx_out, vec_out) < OUT[torch.bfloat16]
    # The first layer writes the same keys and values (the same ops before attention).
    assert torch.equal(amx[0], _to_amx(model.layers[0]["kv"]))
    assert relative_error(amx[1], _to_amx(model.layers[1]["kv"])) < 1e-2


def test_the_stack_writes_only_the_new_tokens_slots():
    model = _Model(torch.float32, 2, 4, 2, 32, 128, False)
    before = [layer["kv"].clone() for layer in model.layers]
    x, positions, slots, table, seq_lens = model.batch([7, 20])
    model.stack().forward(x, positions, slots, table, seq_lens)
    block, head = model.block, model.head
    for layer, old in zip(model.layers, before):
        # Per (block, kv head): keys as [head][block positions], then values as [block positions][head].
        blocks, kv_heads = old.shape[:2]
        changed = (layer["kv"] != old).view(blocks, kv_heads, 2, block * head)
        keys = changed[:, :, 0].view(blocks, kv_heads, head, block).any(dim=2)
        values = changed[:, :, 1].view(blocks, kv_heads, block, head).any(dim=3)
        written = {(int(b), int(p)) for b, _, p in (keys | values).nonzero()}
        assert written == {(int(s) // block, int(s) % block) for s in slots}


def test_a_sliding_window_is_passed_to_each_layer(kernel):
    model = _Model(torch.float32, 2, 4, 2, 32, 128, False, blocks=40, kernel=kernel)
    x, positions, slots, table, seq_lens = model.batch([300])
    windows = [-1, 50]
    want, _ = _reference(model, x, positions, slots, table, seq_lens, windows)
    unwindowed, _ = _reference(model, x, positions, slots, table, seq_lens)
    got = model.stack(windows).forward(x, positions, slots, table, seq_lens)
    assert relative_error(got, want) < 1e-5
    assert relative_error(got, unwindowed) > 1e-3


def test_bad_input_is_refused_with_the_reason():
    model = _Model(torch.float32, 1, 4, 2, 32, 128, False)
    x, positions, slots, table, seq_lens = model.batch([10])
    stack = model.stack()
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        stack.forward(x, torch.tensor([10_000]), slots, table, seq_lens)
    with pytest.raises(RuntimeError, match="the model's weights"):
        stack.forward(x.bfloat16(), positions, slots, table, seq_lens)
    with pytest.raises(RuntimeError, match="one int64 position and one sequence length a token"):
        stack.forward(x, positions, slots, table, torch.tensor([10, 11], dtype=torch.int32))
    cls = patch.stack_class()
    with pytest.raises(RuntimeError, match="tensors a layer"):
        cls([model.final_norm], [model.layers[0]["kv"]], [-1], model.final_norm, model.cos_sin, 4, 2, 32, GROUP,
            1e-5, 0.1, True, 8, False)
    with pytest.raises(RuntimeError, match="named by its tile rows, 8 or 16, got 4"):
        cls(model.weights(), [model.layers[0]["kv"]], [-1], model.final_norm, model.cos_sin, 4, 2, 32, GROUP, 1e-5, 0.1,
            True, 4, False)
    # A rows8 stack handed group factors (a rows16 layer's) refuses them by name.
    model.kernel = "rows8"
    model.layers[0]["qkv"].register_parameter("group_factors", torch.nn.Parameter(
        torch.ones(1, dtype=torch.bfloat16), requires_grad=False))
    with pytest.raises(RuntimeError, match="rows8 kernel takes no group factors"):
        model.stack()


# ---- The runner's side ----

def _metadata(**over):
    md = dict(max_query_len=1, causal=True, dynamic_causal=None, num_actual_tokens=2,
              seq_lens=torch.tensor([5, 9], dtype=torch.int32))
    md.update(over)
    return types.SimpleNamespace(**md)


@pytest.mark.parametrize("case,expected", [
    ("decode", True), ("prefill", False), ("padded", False), ("two groups", False), ("no metadata", False),
    ("not causal", False),
])
def test_only_one_token_steps_with_one_metadata_take_the_stack(monkeypatch, case, expected):
    import vllm.forward_context as fc

    md = _metadata(**({"max_query_len": 7} if case == "prefill" else {}),
                   **({"causal": False} if case == "not causal" else {}))
    metadata = {"layers.0.attn": md, "layers.1.attn": md if case != "two groups" else _metadata()}
    if case == "no metadata":
        metadata = None
    monkeypatch.setattr(fc, "get_forward_context", lambda: types.SimpleNamespace(attn_metadata=metadata))
    stack = types.SimpleNamespace(first_layer="layers.0.attn", last_layer="layers.1.attn")
    ids = torch.zeros(3 if case == "padded" else 2, dtype=torch.long)
    assert (patch.decode_metadata(stack, ids) is md) is expected


def test_a_rebound_kv_cache_or_new_weights_make_the_stack_again(monkeypatch):
    made = []

    def fake_plan(runner):
        first = runner.layers[0]
        made.append(1)
        return patch.Stack(None, None, "", ["a"], first.self_attn.attn.kv_cache, first.self_attn.qkv_proj.qweight,
                           runner.layers, "avx2_w4a8_rows8")

    monkeypatch.setattr(patch, "plan", fake_plan)
    attn = types.SimpleNamespace(attn=types.SimpleNamespace(kv_cache=torch.zeros(1)),
                                 qkv_proj=types.SimpleNamespace(qweight=torch.zeros(1)))
    runner = types.SimpleNamespace(layers=[types.SimpleNamespace(self_attn=attn)])
    first = patch._current(runner)
    assert patch._current(runner) is first and len(made) == 1
    attn.attn.kv_cache = torch.zeros(1)
    assert patch._current(runner) is not first and len(made) == 2
    attn.qkv_proj.qweight = torch.zeros(1)
    patch._current(runner)
    assert len(made) == 3


def test_a_model_it_cannot_run_keeps_its_reason(monkeypatch):
    def refuse(runner):
        raise patch.Unsupported("layer 0 runs int4pack, not avx2_w4a8_rows8")

    monkeypatch.setattr(patch, "plan", refuse)
    runner = types.SimpleNamespace()
    assert patch._current(runner) is None
    assert patch._current(runner) is None
    assert runner.__dict__[patch._STATE_ATTR] == "layer 0 runs int4pack, not avx2_w4a8_rows8"


def _embedding_table(fmt="int8", vocab=50, hidden=64):
    """A VocabParallelEmbedding in cpu_int4's int8 format (tensor parallel 1), without a vLLM config."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from vllm_omni_edge.quantization.embedding import CpuInt4EmbeddingMethod

    gen = torch.Generator().manual_seed(3)
    table = VocabParallelEmbedding.__new__(VocabParallelEmbedding)
    torch.nn.Module.__init__(table)
    table.tp_size = 1
    table.quant_method = CpuInt4EmbeddingMethod(GROUP, True, "model.embed_tokens", fmt=fmt)
    table.qweight = torch.nn.Parameter(torch.randint(-128, 128, (vocab, hidden), dtype=torch.int8, generator=gen),
                                       requires_grad=False)
    table.scales = torch.nn.Parameter(torch.rand(vocab, 1, generator=gen).to(torch.bfloat16) / 50,
                                      requires_grad=False)
    table.int4_act_dtype = torch.bfloat16
    return table


def _inner(table):
    from vllm.model_executor.models import llama

    inner = type("Inner", (), {"embed_input_ids": llama.LlamaModel.embed_input_ids})()
    inner.embed_tokens = table
    return inner


def test_an_int8_embedding_is_looked_up_by_one_op_with_the_same_values():
    table = _embedding_table()
    embed, how = patch.embedding_lookup(_inner(table))
    assert how == "edge_cpu::embedding_int8_rows"
    for ids in (torch.tensor([0, 49, 7]), torch.tensor([[5, 6], [7, 8]], dtype=torch.int32), torch.tensor([12])):
        expected = table.quant_method.embedding(table, ids.long())  # what VocabParallelEmbedding.forward runs
        got = embed(ids)
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    op = native.edge_cpu_op("embedding_int8_rows")
    for dtype in (torch.float16, torch.float32):
        ids = torch.tensor([1, 2, 3])
        assert torch.equal(op(ids, table.qweight.data, table.scales.data, dtype),
                           lookup_int8(ids, table.qweight.data, table.scales.data, dtype))
    with pytest.raises(RuntimeError, match="token id 50 is outside the vocabulary of 50"):
        embed(torch.tensor([50]))
    with pytest.raises(RuntimeError, match="codes must be a contiguous int8"):
        op(torch.tensor([1]), table.qweight.data.float(), table.scales.data, torch.bfloat16)


def test_other_embeddings_keep_the_models_lookup():
    assert patch.embedding_lookup(_inner(_embedding_table(fmt="int4")))[1] == "the model's embed_input_ids"
    table = _embedding_table()
    table.weight = torch.nn.Parameter(torch.zeros(50, 64), requires_grad=False)  # online, before processing
    assert patch.embedding_lookup(_inner(table))[1] == "the model's embed_input_ids"
    table = _embedding_table()
    table.tp_size = 2
    assert patch.embedding_lookup(_inner(table))[1] == "the model's embed_input_ids"


def test_wrapped_once():
    from vllm.v1.worker import gpu_model_runner

    patch._wrap(gpu_model_runner)
    first = gpu_model_runner.GPUModelRunner._model_forward
    patch._wrap(gpu_model_runner)
    assert gpu_model_runner.GPUModelRunner._model_forward is first
    assert patch.in_force()


def test_flag_keeps_vllms_forward(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_DECODER_STACK", "0")
    assert "flag" in patch.apply()
    monkeypatch.setenv("VLLM_OMNI_EDGE_DECODER_STACK", "1")
    monkeypatch.setenv("VLLM_OMNI_EDGE_DECODE_ATTENTION", "0")
    assert "flag" in patch.apply()


PROBE = (
    "import json, sys\n"
    "from vllm import LLM, SamplingParams\n"
    "from vllm_omni_edge.patches.worker import decoder_stack as d\n"
    "llm = LLM(model=sys.argv[1], max_model_len=512)\n"
    "runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner\n"
    "sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)\n"
    "prompts = ['The capital of France is', 'One, two, three,']\n"
    "stack = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]\n"
    "summary = d.summary(runner)\n"
    "runner.__dict__[d._STATE_ATTR] = 'off in this test'\n"
    "vllm = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]\n"
    "text = llm.get_tokenizer().decode(stack[0])\n"
    "print('PROBE-RESULT ' + json.dumps({'stack': [list(t) for t in stack], 'vllm': [list(t) for t in vllm],"
    " 'summary': summary, 'text': text}))\n"
)


@pytest.mark.e2e
def test_the_default_model_decodes_through_the_stack():
    from vllm_omni_edge.models.default_model import DEFAULT_MODEL, pull_cpu_int4_model

    model = pull_cpu_int4_model(DEFAULT_MODEL)
    result = run_script_probe(PROBE, str(model))
    summary = result["summary"]
    # Two requests of 24 tokens decoded together: 23 steps after the prefill.
    assert summary["on"] and summary["layers"] == 30 and summary["steps"] >= 23, summary
    assert summary["embedding"] == "edge_cpu::embedding_int8_rows", summary
    assert "Paris" in result["text"]
    # vLLM's compiled forward rounds in other places; the tokens agree until a near-tie.
    for stack, vllm in zip(result["stack"], result["vllm"]):
        assert stack[:8] == vllm[:8], result
