"""whisper-base built as cpu_int4 by this tree's builder, served by `vllm-omni-edge serve`.

Every linear of vLLM's Whisper (encoder and decoder, self- and cross-attention, fc1/fc2) must
run on a cpu_int4 kernel in the server's own worker (its evidence), the vocabulary matrix must be
resident once, 4-bit (the token embedding reading the tied head's bytes, no float copy), and the
committed speech fixtures must be transcribed within the float checkpoint's bound.

The checkpoint is built into the test's own directory from the float one `models pull
whisper-base` caches, so the test serves what the builder writes now, whatever an older build
left in the cache; `whisper-base:cpu_int4` naming that cache entry is tested in
tests/quantization/test_whisper_int4.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import vllm_env
from tests.e2e.test_whisper_serve import FIXTURE_WER_MAX, text_of
from tests.e2e.test_whisper_serve import transcribe as post_transcription
from tests.speech import sentences, wav, wer
from vllm_omni_edge.cli.demo import ServerProcess, free_port
from vllm_omni_edge.quantization.group_codes import superblock_groups

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVED = "whisper-int4"
ROWS16 = "avx512_w4a8_rows16"
# The bound is the float checkpoint's (tests/e2e/test_whisper_serve.py): 4-bit weights must not
# cost a transcript more than the float model is allowed. The per-fixture transcripts of both are
# in docs/edge/speech.md; a quantization that broke a layer (a shard in the wrong rows, a k bias
# not zero) answers noise, far above the bound.


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vllm_omni_edge.models.default_model import WHISPER_BASE, pull_model
    from vllm_omni_edge.quantization.builder import build_cpu_int4_checkpoint

    log_dir = tmp_path_factory.mktemp("whisper-int4")
    checkpoint = log_dir / "whisper-base-cpu_int4"
    build_cpu_int4_checkpoint(pull_model(WHISPER_BASE), checkpoint, progress=False)
    evidence = log_dir / "evidence"
    srv = ServerProcess(str(checkpoint), free_port(), ["--served-model-name", SERVED, "--enforce-eager"],
                        log_dir / "serve.log", env=vllm_env(VLLM_OMNI_EDGE_EVIDENCE_DIR=str(evidence)))
    srv.checkpoint, srv.evidence_dir = checkpoint, evidence
    try:
        srv.wait_ready(600)
    except Exception:
        srv.stop()
        raise
    yield srv
    assert srv.stop() is not None


def transcribe(server, key: str) -> str:
    return text_of(post_transcription(server, wav(key).read_bytes(), served=SERVED))


def test_fixtures_are_transcribed_within_the_float_bound(server):
    refs = sentences()
    hyps = [transcribe(server, key) for key in refs]
    assert wer(list(refs.values()), hyps) <= FIXTURE_WER_MAX, hyps


def _worker(server) -> dict:
    [worker] = [json.loads(p.read_text()) for p in server.evidence_dir.glob("worker-*.json")]
    return worker


def _padded_vocab(config) -> int:
    from vllm.model_executor.layers.vocab_parallel_embedding import pad_vocab_size

    return pad_vocab_size(config["vocab_size"])  # vLLM pads the vocabulary rows of an embedding and head


def test_every_whisper_linear_and_the_head_ran_on_a_cpu_int4_kernel(server):
    from vllm_omni_edge.quantization.embedding import KERNEL_LAYOUTS, LAYOUT_STORED
    from vllm_omni_edge.quantization.kernels import CpuFeatures, choose_kernel

    config = json.loads((server.checkpoint / "config.json").read_text())
    assert config["quantization_config"]["embedding"] == "int4"
    # vLLM's layers: encoder qkv_proj, out_proj, fc1, fc2; decoder the same plus the
    # cross-attention's q_proj, kv_proj, out_proj; the head, and the embedding tied to it.
    linears = 4 * config["encoder_layers"] + 7 * config["decoder_layers"]
    d, g = config["d_model"], config["quantization_config"]["group_size"]

    def routed(n):
        return choose_kernel(CpuFeatures.detect(), g, d, n, torch.float32, float_zero=True)[0].name

    head = routed(_padded_vocab(config))
    layout = KERNEL_LAYOUTS.get(head, LAYOUT_STORED)
    worker = _worker(server)
    assert worker["quantization"] == "cpu_int4"
    # The server runs with no flags: rows16 layers keep 8-bit group codes (the lever's default).
    coded = (linears if routed(d) == ROWS16 else 0) + (head == ROWS16)
    assert worker["cpu_int4_kernels"] == {f"linear:{routed(d)}": linears, f"lm_head:{head}": 1,
                                          f"embedding:gather_{layout}": 1, "fallback": 0, "dense_prefill_copy": 0,
                                          "group_codes": coded, "six_bit": 0}
    assert worker["cpu_int4_other_layers"] == []
    by_dtype = worker["weights_bytes_by_dtype"]
    # The weights at 4 bits (half a byte each) are the only uint8 tensors, with the rows16 layers'
    # group codes (two bytes a group): self-attention q/k/v/out (4 d x d), cross-attention's four
    # more in the decoder, fc1 and fc2 (2 d x ffn), and the vocabulary matrix once.
    enc, dec, ffn = config["encoder_layers"], config["decoder_layers"], config["encoder_ffn_dim"]
    layer_weights = enc * (4 * d * d + 2 * d * ffn) + dec * (8 * d * d + 2 * d * ffn)
    vocab_weights = _padded_vocab(config) * d
    codes = 2 * ((layer_weights if routed(d) == ROWS16 else 0) + (vocab_weights if head == ROWS16 else 0)) // g
    assert by_dtype.get("uint8", 0) == (layer_weights + vocab_weights) // 2 + codes, by_dtype


def test_the_vocabulary_matrix_is_resident_once_in_4_bits(server):
    from safetensors import safe_open

    config = json.loads((server.checkpoint / "config.json").read_text())
    d, g, rows = config["d_model"], config["quantization_config"]["group_size"], _padded_vocab(config)
    worker = _worker(server)
    by_class = worker["weights_bytes_by_class"]
    # The embedding's triple (4-bit rows, a scale and offset per group: bf16, or on rows16 one-byte
    # codes with bf16 factors per superblock), which the head shares: counted once, under the
    # embedding, and nothing under the head.
    groups = d // g
    head_kernel = next(k.split(":", 1)[1] for k in worker["cpu_int4_kernels"] if k.startswith("lm_head:"))
    if head_kernel == ROWS16:  # the server runs with no flags: 8-bit group codes
        per_row = 2 * groups + 2 * (groups // superblock_groups(groups)) * 2
    else:
        per_row = 2 * groups * 2
    assert by_class.get("embedding") == rows * d // 2 + rows * per_row, by_class
    assert by_class.get("head", 0) == 0, by_class
    # No float copy: neither vLLM's oneDNN prepack of an unquantized head nor an embedding table.
    assert worker["heads_prepacked_names"] == [] and worker["embeddings_prepacked"] == 0
    with safe_open(str(server.checkpoint / "model.safetensors"), framework="pt") as f:
        kept = sum(torch.Size(f.get_slice(n).get_shape()).numel() for n in f.keys()
                   if not n.endswith((".qweight", ".scales", ".zeros")))
    float32 = worker["weights_bytes_by_dtype"].get("float32", 0)
    # The float tensors the checkpoint keeps (conv, positions, norms, biases), in float32; a float
    # vocabulary matrix would add vocab x d x 4 bytes.
    assert float32 - 4 * kept < config["vocab_size"] * d * 4 // 2, (float32, kept)
