"""cpu_int4 inside real vLLM layers (one process): registration, config, loading, tying."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
import torch.nn.functional as F

from tests.quantization.helpers import relative_error
from vllm_omni_edge.quantization import evidence, int4

BF16 = torch.bfloat16


def routed_kernel(K: int, N: int) -> str:
    """The kernel the router picks on this CPU for a default-format layer of this shape."""
    from vllm_omni_edge.quantization.kernels import CpuFeatures, choose_kernel

    return choose_kernel(CpuFeatures.detect(), int4.DEFAULT_GROUP_SIZE, K, N, BF16, float_zero=True)[0].name


def kernel_tolerance() -> float:
    """Relative error allowed against the exact product for the router's kernel, bf16 output.

    W4A16 kernels are exact up to bf16 rounding (1e-2); the W4A8 ones (``*_w4a8*``) add int8
    activations (2 %, tests/quantization/test_w4a8_ops.py) on top. A wrong shard order errs
    by ~100 %.
    """
    return 3e-2 if "w4a8" in routed_kernel(576, 576) else 1e-2


def quantized(weight):
    """The stored triple for a weight and the exact weights it stands for."""
    triple = int4.quantize(weight, int4.group_size_for(weight.shape[1], int4.DEFAULT_GROUP_SIZE))
    return triple, int4.dequantize(*triple)


def load_prequantized(layer, shards: dict):
    """Feed checkpoint tensors through the layer's own v2 loaders, as the model does."""
    for shard_id, (qweight, scales, zeros) in shards.items():
        for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
            param = getattr(layer, name)
            if shard_id is None:
                param.weight_loader(param, t)
            else:
                param.weight_loader(param, t, shard_id)


def test_registration_is_idempotent():
    from vllm.model_executor.layers import linear as vllm_linear
    from vllm.model_executor.layers import quantization as vllm_quant

    from vllm_omni_edge.quantization import register_cpu_int4
    from vllm_omni_edge.quantization.config import CpuInt4Config

    register_cpu_int4()
    register_cpu_int4()
    importlib.import_module("vllm_omni_edge.quantization.config")
    assert vllm_quant.QUANTIZATION_METHODS.count("cpu_int4") == 1
    assert vllm_quant.get_quantization_config("cpu_int4") is CpuInt4Config
    assert vllm_linear.WEIGHT_LOADER_V2_SUPPORTED.count("CpuInt4LinearMethod") == 1


def test_config_from_checkpoint_and_errors():
    from vllm_omni_edge.quantization.config import CpuInt4Config

    good = {"quant_method": "cpu_int4", "bits": 4, "group_size": 64, "format_version": 1,
            "lm_head": True, "zero_point": True}
    cfg = CpuInt4Config.from_config(good)
    assert (cfg.group_size, cfg.lm_head, cfg.prequantized) == (64, True, True)
    assert CpuInt4Config.override_quantization_method(good, None) == "cpu_int4"
    assert CpuInt4Config.override_quantization_method({"quant_method": "awq"}, None) is None
    assert CpuInt4Config.override_quantization_method(good, "gptq") is None
    online = CpuInt4Config()
    assert (online.group_size, online.prequantized, online.zero_point) == (32, False, "float")
    assert CpuInt4Config.from_config_dict_json(json.dumps({"group_size": 128})).group_size == 128
    assert CpuInt4Config.get_config_filenames() == []
    assert CpuInt4Config.from_config(good).zero_point == "int"  # a format_version 1 checkpoint
    assert CpuInt4Config.from_config({**good, "format_version": 2, "zero_point": "float"}).zero_point == "float"
    assert CpuInt4Config.from_config({**good, "format_version": 3, "zero_point": "float"}).embedding == "int4"
    for change, message in (({"bits": 8}, "bits=8"), ({"format_version": 4}, "format_version=4"),
                            ({"zero_point": False}, "zero_point"), ({"group_size": 48}, "group size 48"),
                            ({"format_version": 2, "zero_point": True}, "zero_point=True")):
        with pytest.raises(ValueError, match=message):
            CpuInt4Config.from_config({**good, **change})


def test_qkv_and_gate_up_shards_load_and_match(vllm_single_process):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    from vllm_omni_edge.quantization.config import CpuInt4Config

    cfg = CpuInt4Config(group_size=int4.DEFAULT_GROUP_SIZE, prequantized=True)
    torch.manual_seed(0)
    qkv = QKVParallelLinear(576, 64, 9, 3, bias=False, params_dtype=BF16, quant_config=cfg,
                            prefix="model.layers.0.self_attn.qkv_proj")
    gate_up = MergedColumnParallelLinear(576, [1536, 1536], bias=False, params_dtype=BF16,
                                         quant_config=cfg, prefix="model.layers.0.mlp.gate_up_proj")
    weights = {"q": torch.randn(576, 576) * 0.05, "k": torch.randn(192, 576) * 0.05,
               "v": torch.randn(192, 576) * 0.05, 0: torch.randn(1536, 576) * 0.05,
               1: torch.randn(1536, 576) * 0.05}
    triples = {k: quantized(w) for k, w in weights.items()}
    load_prequantized(qkv, {k: triples[k][0] for k in ("q", "k", "v")})
    load_prequantized(gate_up, {k: triples[k][0] for k in (0, 1)})
    for layer, keys in ((qkv, ("q", "k", "v")), (gate_up, (0, 1))):
        layer.quant_method.process_weights_after_loading(layer)
        x = torch.randn(5, 576).to(BF16)
        ref = F.linear(x.float(), torch.cat([triples[k][1] for k in keys]))
        out, _ = layer(x)
        assert relative_error(out, ref) < kernel_tolerance()
    counts = evidence.kernel_counts()
    assert sum(v for k, v in counts.items() if k.startswith("linear:")) == 2


def test_online_quantization_of_bf16_weights(vllm_single_process):
    from vllm.model_executor.layers.linear import RowParallelLinear

    from vllm_omni_edge.quantization.config import CpuInt4Config

    layer = RowParallelLinear(1536, 576, bias=True, params_dtype=BF16, quant_config=CpuInt4Config(),
                              prefix="model.layers.0.mlp.down_proj")
    w, b = (torch.randn(576, 1536) * 0.05).to(BF16), torch.randn(576).to(BF16)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    layer.quant_method.process_weights_after_loading(layer)
    assert "weight" not in dict(layer.named_parameters())
    x = torch.randn(3, 1536).to(BF16)
    out, _ = layer(x)
    _, exact = quantized(w)
    assert relative_error(out, F.linear(x.float(), exact, b.float())) < kernel_tolerance()


def test_layerwise_load_quantizes_each_layer_when_its_last_shard_arrives(vllm_single_process):
    from vllm.model_executor.layers.linear import QKVParallelLinear

    from vllm_omni_edge.quantization.config import CpuInt4Config

    qkv = QKVParallelLinear(576, 64, 9, 3, bias=False, params_dtype=BF16, quant_config=CpuInt4Config(),
                            prefix="model.layers.0.self_attn.qkv_proj")
    assert qkv.weight.is_meta  # nothing in bf16 is allocated before the checkpoint arrives
    shards = {"q": torch.randn(576, 576) * 0.05, "k": torch.randn(192, 576) * 0.05,
              "v": torch.randn(192, 576) * 0.05}
    for shard_id in ("q", "k"):
        qkv.weight.weight_loader(qkv.weight, shards[shard_id].to(BF16), shard_id)
        assert "qweight" not in dict(qkv.named_parameters())  # incomplete: still waiting
    qkv.weight.weight_loader(qkv.weight, shards["v"].to(BF16), "v")
    # Quantized as soon as the layer was complete, before any end-of-load pass.
    params = dict(qkv.named_parameters())
    assert "weight" not in params and params["qweight"].dtype == torch.uint8
    qkv.quant_method.process_weights_after_loading(qkv)  # vLLM's final pass: a no-op now
    x = torch.randn(3, 576).to(BF16)
    exact = torch.cat([quantized(shards[k].to(BF16))[1] for k in ("q", "k", "v")])
    assert relative_error(qkv(x)[0], F.linear(x.float(), exact)) < kernel_tolerance()


def test_whole_model_load_keeps_bf16_until_the_end(vllm_single_process, monkeypatch):
    from vllm.model_executor.layers.linear import RowParallelLinear

    from vllm_omni_edge.quantization.config import CpuInt4Config

    monkeypatch.setenv("VLLM_OMNI_EDGE_INT4_LOAD", "whole")
    layer = RowParallelLinear(128, 64, bias=False, params_dtype=BF16, quant_config=CpuInt4Config(),
                              prefix="whole")
    layer.weight.weight_loader(layer.weight, torch.randn(64, 128).to(BF16))
    assert layer.weight.dtype == BF16 and not layer.weight.is_meta
    layer.quant_method.process_weights_after_loading(layer)
    assert "weight" not in dict(layer.named_parameters())


def test_two_layouts_keep_a_dense_copy_used_only_for_prefill(vllm_single_process, monkeypatch):
    from vllm.model_executor.layers.linear import RowParallelLinear

    from vllm_omni_edge.quantization.config import CpuInt4Config
    from vllm_omni_edge.quantization.kernels.base import DENSE_MIN_ROWS

    monkeypatch.setenv("VLLM_OMNI_EDGE_INT4_LAYOUTS", "two")
    layer = RowParallelLinear(256, 64, bias=False, params_dtype=BF16, quant_config=CpuInt4Config(),
                              prefix="two")
    w = (torch.randn(64, 256) * 0.05).to(BF16)
    layer.weight.weight_loader(layer.weight, w)
    _, exact = quantized(w)
    assert torch.equal(layer.dense_weight.float(), exact.to(BF16).float())
    prefill, decode = torch.randn(DENSE_MIN_ROWS, 256).to(BF16), torch.randn(1, 256).to(BF16)
    assert torch.equal(layer(prefill)[0], F.linear(prefill, layer.dense_weight))
    assert relative_error(layer(decode)[0], F.linear(decode.float(), exact)) < kernel_tolerance()
    assert evidence.kernel_counts()["dense_prefill_copy"] == 1


def test_online_layer_with_unsupported_k_stays_unquantized(vllm_single_process):
    from vllm.model_executor.layers.linear import ColumnParallelLinear, UnquantizedLinearMethod

    from vllm_omni_edge.quantization.config import CpuInt4Config

    layer = ColumnParallelLinear(40, 64, bias=False, params_dtype=BF16, quant_config=CpuInt4Config(),
                                 prefix="odd")
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    assert evidence.kernel_counts()["linear:unquantized"] == 1


def test_tied_head_gets_own_4bit_copy_embedding_stays_bf16(vllm_single_process):
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    from vllm_omni_edge.quantization.config import CpuInt4Config

    # Online with the embedding kept bf16 (the default quantizes it: test_embedding_int4.py).
    cfg = CpuInt4Config(embedding="bf16")
    embed = VocabParallelEmbedding(320, 128, params_dtype=BF16, quant_config=cfg)
    assert isinstance(embed.quant_method, UnquantizedEmbeddingMethod)
    head = ParallelLMHead(320, 128, params_dtype=BF16, quant_config=cfg, prefix="lm_head")
    head = head.tie_weights(embed)
    assert head.weight is embed.weight  # loaded once, through the embedding

    table = (torch.randn(320, 128) * 0.05).to(BF16)
    embed.weight.weight_loader(embed.weight, table)
    head.quant_method.process_weights_after_loading(head)

    assert "weight" not in dict(head.named_parameters())
    assert embed.weight.dtype == BF16 and torch.equal(embed.weight.data, table)
    assert head.qweight.dtype == torch.uint8
    h = torch.randn(2, 128).to(BF16)
    _, exact = quantized(table)
    assert relative_error(head.quant_method.apply(head, h), F.linear(h.float(), exact)) < kernel_tolerance()
    assert evidence.kernel_counts()[f"lm_head:{routed_kernel(128, 320)}"] == 1


def test_prequantized_head_loads_through_vocab_loader_with_padding(vllm_single_process):
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from vllm_omni_edge.quantization.config import CpuInt4Config

    head = ParallelLMHead(300, 128, params_dtype=BF16, prefix="lm_head",
                          quant_config=CpuInt4Config(group_size=int4.DEFAULT_GROUP_SIZE, prequantized=True))
    assert head.qweight.shape == (320, 64)  # vocab padded to 64
    (triple, exact) = quantized(torch.randn(300, 128) * 0.05)
    load_prequantized(head, {None: triple})
    head.quant_method.process_weights_after_loading(head)
    h = torch.randn(3, 128).to(BF16)
    logits = head.quant_method.apply(head, h)
    assert logits.shape == (3, 320)
    assert relative_error(logits[:, :300], F.linear(h.float(), exact)) < kernel_tolerance()
    assert float(logits[:, 300:].abs().max()) == 0.0


def test_lm_head_false_leaves_head_unquantized(vllm_single_process):
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
    )

    from vllm_omni_edge.quantization.config import CpuInt4Config

    head = ParallelLMHead(320, 128, params_dtype=BF16, quant_config=CpuInt4Config(lm_head=False))
    assert isinstance(head.quant_method, UnquantizedEmbeddingMethod)


def test_summary_is_logged_once_all_layers_report(vllm_single_process, caplog):
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    from vllm_omni_edge.quantization.config import CpuInt4Config

    cfg = CpuInt4Config()
    layers = [ColumnParallelLinear(128, 64, bias=False, params_dtype=BF16, quant_config=cfg,
                                   prefix=f"l{i}") for i in range(2)]
    logger = evidence.logger
    logger.propagate, was = True, logger.propagate
    try:
        with caplog.at_level("INFO", logger=logger.name):
            for layer in layers:
                # Through the loader: layer-wise loading quantizes once the weight is complete.
                layer.weight.weight_loader(layer.weight, torch.randn(64, 128).to(BF16))
                layer.quant_method.process_weights_after_loading(layer)
    finally:
        logger.propagate = was
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cpu_int4: ")]
    assert len(lines) == 1 and f"'linear:{routed_kernel(128, 64)}': 2" in lines[0] and "'fallback': 0" in lines[0]


def test_config_verifies_the_manifest(tiny_llama_int4, tmp_path):
    import shutil

    from vllm_omni_edge.quantization.config import CpuInt4Config
    from vllm_omni_edge.quantization.manifest import CheckpointIntegrityError

    written = json.loads((tiny_llama_int4 / "config.json").read_text())
    cfg = CpuInt4Config.from_config(written["quantization_config"])
    cfg.maybe_update_config(str(tiny_llama_int4))  # intact: no error
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_llama_int4, damaged)
    with open(damaged / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(CheckpointIntegrityError, match="truncated"):
        cfg.maybe_update_config(str(damaged))
