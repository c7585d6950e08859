"""Edge serving defaults: added only where the user said nothing, and stated in one line."""

from __future__ import annotations

import json

from vllm_omni_edge.cli.serving_defaults import (EDGE_MAX_MODEL_LEN, EDGE_MAX_NUM_SEQS, model_context_limit,
                                                 with_serving_defaults)


def checkpoint(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_defaults_fill_what_the_user_left_out(tmp_path):
    model = checkpoint(tmp_path, max_position_embeddings=8192)
    args, line = with_serving_defaults([model, "--port", "9"], model)
    assert args == [model, "--port", "9", "--max-model-len", str(EDGE_MAX_MODEL_LEN),
                    "--max-num-seqs", str(EDGE_MAX_NUM_SEQS)]
    assert f"max_model_len {EDGE_MAX_MODEL_LEN} (the model allows 8192)" in line
    assert "KV cache sized from need" in line and "compiled" in line


def test_the_users_flags_win(tmp_path):
    model = checkpoint(tmp_path, max_position_embeddings=8192)
    given = [model, "--max-model-len=512", "--max-num-seqs", "8", "--kv-cache-memory-bytes", "1G", "--enforce-eager"]
    args, line = with_serving_defaults(given, model)
    assert args == given
    assert "max_model_len yours" in line and "max_num_seqs yours" in line and "KV cache yours" in line
    assert "eager" in line and "compiled" not in line


def test_a_shorter_model_keeps_its_own_limit(tmp_path):
    model = checkpoint(tmp_path, max_position_embeddings=32768, text_config={"max_position_embeddings": 2048})
    assert model_context_limit(model) == 2048
    args, line = with_serving_defaults([model], model)
    assert "--max-model-len" not in args and "the model's (2048)" in line


def test_no_readable_config_adds_no_length(tmp_path):
    assert model_context_limit(str(tmp_path / "missing")) is None
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    args, _ = with_serving_defaults([str(tmp_path / "model.gguf")], str(tmp_path / "model.gguf"))
    assert "--max-model-len" not in args and "--max-num-seqs" in args


def test_streamed_chunks_are_paced_unless_the_user_sets_an_interval(tmp_path, monkeypatch):
    from vllm_omni_edge.cli.serving_defaults import serving_defaults
    from vllm_omni_edge.levers import STREAM_CHUNK_ENV, stream_chunk_s

    monkeypatch.delenv(STREAM_CHUNK_ENV, raising=False)
    model = checkpoint(tmp_path, max_position_embeddings=2048)
    _, line = with_serving_defaults([model], model)
    assert "streamed chunks at least 25 ms apart" in line
    args, line = serving_defaults([model, "--stream-interval", "4"], "vllm serve")
    assert "stream interval yours" in line and args[1:3] == ["--stream-interval", "4"]
    assert stream_chunk_s() == 0  # the patch stands down in this server
    monkeypatch.setenv(STREAM_CHUNK_ENV, "0")
    assert "a streamed chunk per step" in with_serving_defaults([model], model)[1]
