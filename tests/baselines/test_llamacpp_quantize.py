"""The HF -> GGUF converter's pieces: names, rotary permutation, tokenizer metadata, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vllm_omni_edge_bench.baselines import llamacpp_quantize as q


@pytest.mark.parametrize("hf, gguf_name", [
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
    ("model.layers.7.self_attn.k_proj.weight", "blk.7.attn_k.weight"),
    ("model.layers.7.self_attn.v_proj.weight", "blk.7.attn_v.weight"),
    ("model.layers.7.self_attn.o_proj.weight", "blk.7.attn_output.weight"),
    ("model.layers.29.mlp.gate_proj.weight", "blk.29.ffn_gate.weight"),
    ("model.layers.29.mlp.up_proj.weight", "blk.29.ffn_up.weight"),
    ("model.layers.29.mlp.down_proj.weight", "blk.29.ffn_down.weight"),
    ("model.layers.3.input_layernorm.weight", "blk.3.attn_norm.weight"),
    ("model.layers.3.post_attention_layernorm.weight", "blk.3.ffn_norm.weight"),
])
def test_llama_names(hf, gguf_name):
    assert q.gguf_tensor_name(hf, "llama", 30) == gguf_name


def test_qwen2_names_include_attention_biases():
    assert q.gguf_tensor_name("model.layers.2.self_attn.q_proj.bias", "qwen2", 28) == "blk.2.attn_q.bias"
    assert q.gguf_tensor_name("model.layers.2.self_attn.k_proj.weight", "qwen2", 28) == "blk.2.attn_k.weight"


def test_rotary_buffers_are_skipped_and_unknown_tensors_refused():
    assert q.gguf_tensor_name("model.layers.0.self_attn.rotary_emb.inv_freq", "llama", 30) is None
    with pytest.raises(q.ConversionError, match="no GGUF name for tensor 'model.vision_tower.weight'"):
        q.gguf_tensor_name("model.vision_tower.weight", "llama", 30)


def test_rope_permutation_pairs_adjacent_rows_per_head():
    n_head, head_dim = 2, 4
    w = np.arange(n_head * head_dim, dtype=np.float32)[:, None] * np.ones((1, 3), dtype=np.float32)
    permuted = q.permute_for_llama_rope(w, n_head)
    # HF pairs rows (0, 2), (1, 3) of a head; llama.cpp wants each pair adjacent: 0, 2, 1, 3.
    assert permuted[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    np.testing.assert_array_equal(q.unpermute_llama_rope(permuted, n_head), w)
    with pytest.raises(q.ConversionError):
        q.permute_for_llama_rope(np.zeros((6, 2)), 2)


def write_tokenizer(path, vocab, added, merges, tokenizer_config=None, config=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps({
        "model": {"type": "BPE", "vocab": vocab, "merges": merges}, "added_tokens": added}))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config or {}))
    (path / "config.json").write_text(json.dumps(config or {}))


def test_tokenizer_metadata_types_and_padding(tmp_path):
    import gguf

    write_tokenizer(tmp_path, {"a": 2, "b": 3, "ab": 4}, [
        {"id": 0, "content": "<|endoftext|>", "special": True},
        {"id": 1, "content": "<tool>", "special": False}], [["a", "b"]])
    meta = q.tokenizer_metadata(tmp_path, vocab_size=7)
    assert meta["tokens"] == ["<|endoftext|>", "<tool>", "a", "b", "ab", "[PAD5]", "[PAD6]"]
    T = gguf.TokenType
    assert meta["types"] == [T.CONTROL, T.USER_DEFINED, T.NORMAL, T.NORMAL, T.NORMAL, T.UNUSED, T.UNUSED]
    assert meta["merges"] == ["a b"]
    with pytest.raises(q.ConversionError, match="vocab_size is 4"):
        q.tokenizer_metadata(tmp_path, vocab_size=4)


def test_special_ids_follow_the_model_config_over_tokenizer_config(tmp_path):
    # transformers' GGUF export wrote eos_token=<|im_start|> (1) into tokenizer_config.json
    # for SmolLM2, while generation stops at <|im_end|> (2), as config.json says.
    write_tokenizer(tmp_path, {"a": 3}, [
        {"id": 0, "content": "<|endoftext|>", "special": True},
        {"id": 1, "content": "<|im_start|>", "special": True},
        {"id": 2, "content": "<|im_end|>", "special": True}], [],
        tokenizer_config={"bos_token": "<|im_start|>", "eos_token": "<|im_start|>", "unk_token": "<|endoftext|>"},
        config={"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2})
    ids = q.special_token_ids(tmp_path)
    assert ids["eos"] == 2 and ids["bos"] == 1 and ids["pad"] == 2


def test_pre_tokenizer_must_be_known(tmp_path):
    assert q.tokenizer_pre(tmp_path, {"model_type": "llama"}, "smollm") == ("smollm", "given")
    assert q.tokenizer_pre(tmp_path, {"model_type": "qwen2"}, None)[0] == "qwen2"
    with pytest.raises(q.ConversionError, match="--tokenizer-pre"):
        q.tokenizer_pre(tmp_path, {"model_type": "llama"}, None)


def test_unsupported_checkpoints_are_refused_before_writing(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    with pytest.raises(q.ConversionError, match="model_type 'gemma3' is not supported"):
        q.convert_hf_to_gguf(tmp_path / "m", tmp_path / "out.gguf")
    with pytest.raises(q.ConversionError, match="no config.json"):
        q.convert_hf_to_gguf(tmp_path / "absent", tmp_path / "out.gguf")
    with pytest.raises(q.ConversionError, match="outtype"):
        q.convert_hf_to_gguf(tmp_path / "m", tmp_path / "out.gguf", outtype="q4_0")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*partial*"))


def test_rope_scaling_is_refused():
    with pytest.raises(q.ConversionError, match="rope scaling 'yarn'"):
        q._hparams({"num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
                    "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "vocab_size": 10,
                    "rope_scaling": {"type": "yarn", "factor": 4.0}})


def test_unknown_quantization_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown quantization 'q3_xx'"):
        q.quantize(tmp_path / "a.gguf", tmp_path / "b.gguf", "q3_xx")
    with pytest.raises(FileNotFoundError, match="source GGUF not found"):
        q.quantize(tmp_path / "a.gguf", tmp_path / "b.gguf", "q4_0")
