"""The kernel-path benchmark times forwards as a model makes them (routing is built on it)."""

from __future__ import annotations

import torch

from vllm_omni_edge_bench.harness import kernel_bench

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 256}


def test_shapes_follow_the_merged_vllm_layers():
    assert kernel_bench.model_linear_shapes(TINY) == [
        ("qkv_proj", 64, 128, 3), ("o_proj", 64, 64, 3), ("gate_up_proj", 64, 256, 3),
        ("down_proj", 128, 64, 3), ("lm_head", 64, 256, 1)]


def test_model_order_is_layer_by_layer_then_the_head():
    shapes = kernel_bench.model_linear_shapes(TINY)
    layers = {name: [f"{name}{i}" for i in range(count)] for name, _K, _N, count in shapes}
    order = [fn for _name, fn in kernel_bench._model_order(shapes, layers)]
    assert order == ["qkv_proj0", "o_proj0", "gate_up_proj0", "down_proj0",
                     "qkv_proj1", "o_proj1", "gate_up_proj1", "down_proj1",
                     "qkv_proj2", "o_proj2", "gate_up_proj2", "down_proj2", "lm_head0"]


def test_every_layer_has_its_own_weights(monkeypatch):
    made = []
    real_layer = kernel_bench._layer

    def recording(kernel_cls, triple, K, group_size, dtype):
        fn = real_layer(kernel_cls, triple, K, group_size, dtype)
        made.append(fn)
        return fn

    monkeypatch.setattr(kernel_bench, "_layer", recording)
    result = kernel_bench.run(TINY, passes=3, group_size=32, threads=1, repeats=1,
                              only_paths=["int4pack", "dense"], phases=["decode"])
    assert result["method"].startswith("forward over distinct layers")
    # 3 layers x 4 shapes + the head, per path.
    assert len(made) == 2 * 13
    weights = [cell.cell_contents for fn in made for cell in fn.__closure__ or ()
               if isinstance(cell.cell_contents, torch.nn.Module)]
    pointers = [next(iter(layer.parameters()), getattr(layer, "dense", None)).data_ptr() for layer in weights]
    assert len(set(pointers)) == len(pointers)
    summary = result["summary"]["decode"]
    assert set(summary) == {"int4pack", "dense"}
    for figures in summary.values():
        assert len(figures["passes_ms"]) == 3 and figures["min_ms"] <= figures["median_ms"] <= figures["max_ms"]
        assert figures["median_ms"] > 0


def test_a_path_that_cannot_run_a_shape_is_left_out_and_says_why():
    # A head of 40 rows: neither W4A8 on AMX (N % 32) nor tinygemm (N % 16) can run it,
    # so neither can run this model, on any CPU; the dense copy can.
    odd_head = {**TINY, "vocab_size": 40}
    result = kernel_bench.run(odd_head, passes=3, group_size=32, threads=1, repeats=1,
                              only_paths=["amx_w4a8", "int4pack", "dense"], phases=["decode"])
    assert set(result["summary"]["decode"]) == {"dense"}
    assert "N=40 is not a multiple of 16" in result["refused"]["int4pack"]
    assert "amx_w4a8" in result["refused"]
