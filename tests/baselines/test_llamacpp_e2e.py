"""llama.cpp's files from our bf16 reference, end to end: convert, quantize, load, answer.

Runs llama.cpp (no vLLM). Building the files takes about a minute on a quiet 2-core box;
the tensor-by-tensor comparison with the shipped GGUF is also marked slow. Run with -m e2e.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def built(tmp_path_factory, default_model):
    from vllm_omni_edge_bench.baselines.llamacpp_quantize import build

    out = tmp_path_factory.mktemp("llamacpp-gguf")
    manifest = build("default", ["q4_0"], out, threads=1, log=lambda _line: None)
    return out, manifest


@pytest.mark.slow  # dequantizing both files in numpy: minutes on a 2-core box
def test_bf16_gguf_equals_the_shipped_gguf_dequantized(built):
    """Same tensors (to bf16 rounding) and same tokenizer as the file the reference came from."""
    import gguf

    from vllm_omni_edge.models.default_model import default_gguf_path

    _, manifest = built
    ours = gguf.GGUFReader(manifest["files"]["bf16"]["path"])
    shipped = gguf.GGUFReader(str(default_gguf_path()))
    theirs = {t.name: t for t in shipped.tensors}
    assert sorted(t.name for t in ours.tensors) == sorted(theirs)
    for tensor in ours.tensors:
        if not any(part in tensor.name for part in ("attn_q", "attn_k", "blk.0.", "blk.29.", "token_embd")):
            continue  # every rotary-permuted tensor, two whole layers and the embedding
        a = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        b = gguf.quants.dequantize(theirs[tensor.name].data, theirs[tensor.name].tensor_type)
        assert a.shape == b.shape, tensor.name
        # bf16 keeps 8 significant bits: within 2^-8 of the largest magnitude.
        assert np.abs(a - b).max() <= np.abs(b).max() * 2 ** -8, tensor.name
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.padding_token_id", "tokenizer.chat_template", "llama.rope.freq_base",
                "llama.attention.head_count_kv", "llama.context_length"):
        assert ours.fields[key].contents() == shipped.fields[key].contents(), key


def test_q4_0_loads_and_answers_paris(built):
    from vllm_omni_edge_bench.baselines.llamacpp import LlamaCppEngine, LlamaCppOptions

    _, manifest = built
    path = manifest["files"]["q4_0"]["path"]
    engine = LlamaCppEngine(path, LlamaCppOptions(n_threads=1, n_ctx=512), echo_log=False)
    try:
        answer = engine.answer("What is the capital of France?", max_tokens=24)
        evidence = engine.evidence()
    finally:
        engine.close()
    assert "Paris" in answer, answer
    assert evidence["settings"]["print_info.file type"].startswith("Q4_0")
    assert evidence["weights_mmapped"] is True


def test_manifest_names_inputs_and_outputs(built):
    out, manifest = built
    on_disk = json.loads((out / "SmolLM2-135M-Instruct.manifest.json").read_text())
    assert on_disk == manifest
    assert set(manifest["files"]) == {"bf16", "q4_0"}
    for entry in manifest["files"].values():
        assert Path(entry["path"]).stat().st_size == entry["bytes"] and len(entry["sha256"]) == 64
    assert manifest["conversion"]["tokenizer_pre"] == "smollm"
    assert manifest["source"]["weights_sha256"]
    # The quantized file is about a quarter of the bf16 one (Q4_0: 4.5 bits per weight).
    assert manifest["files"]["q4_0"]["bytes"] < 0.4 * manifest["files"]["bf16"]["bytes"]
    assert not list(out.glob(".*partial*"))
