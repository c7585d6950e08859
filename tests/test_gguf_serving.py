"""`vllm-omni-edge serve FILE.gguf`: the file is built into a checkpoint once, found again by its
SHA-256, and served under its file name; what cannot be built is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("gguf")

from tests.gguf_tiny import write_tiny_gguf  # noqa: E402
from vllm_omni_edge.cli.serve import ServeSetupError, edge_serve_argv  # noqa: E402
from vllm_omni_edge.models import gguf_serving  # noqa: E402


@pytest.fixture
def tiny_llama(tmp_path):
    return write_tiny_gguf(tmp_path / "tiny-llama.gguf", "llama")


def test_a_gguf_is_built_once_and_found_again_by_its_contents(tiny_llama, isolated_cache, tmp_path):
    built = gguf_serving.serving_checkpoint(tiny_llama, show_progress=False)
    assert built.name.endswith("-cpu_int4") and str(built).startswith(str(isolated_cache))
    config = json.loads((built / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "cpu_int4"
    stamp = (built / "config.json").stat().st_mtime_ns
    assert gguf_serving.serving_checkpoint(tiny_llama, show_progress=False) == built
    assert (built / "config.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    renamed = shutil.copy(tiny_llama, tmp_path / "tiny-llama.gguf.copy")
    digest = gguf_serving.file_sha256(tiny_llama, show_progress=False)
    assert digest == gguf_serving.file_sha256(renamed, show_progress=False)
    assert digest[:16] in built.name


def test_a_build_with_an_older_head_default_is_rebuilt(tmp_path, isolated_cache):
    from vllm_omni_edge.quantization.builder import GGUF_TIED_HEAD, build_cpu_int4_checkpoint
    from vllm_omni_edge.quantization.manifest import read_manifest

    tied = write_tiny_gguf(tmp_path / "tiny-qwen2.gguf", "qwen2")  # no output.weight: tied head
    built = gguf_serving.serving_checkpoint(tied, show_progress=False)
    assert read_manifest(built)["head"] == GGUF_TIED_HEAD == "bf16"
    build_cpu_int4_checkpoint(tied, built, progress=False, overwrite=True, embedding="int4", head="int4")
    assert read_manifest(built)["head"] == "int4"
    assert gguf_serving.serving_checkpoint(tied, show_progress=False) == built
    assert read_manifest(built)["head"] == GGUF_TIED_HEAD


def test_a_build_that_re_quantized_the_files_4bit_weights_is_rebuilt(tiny_llama, isolated_cache):
    import json

    from vllm_omni_edge.quantization.manifest import MANIFEST_NAME, read_manifest

    built = gguf_serving.serving_checkpoint(tiny_llama, show_progress=False)
    manifest = read_manifest(built)
    assert "gguf_grid_tensors" in manifest
    del manifest["gguf_grid_tensors"]  # as written before the builder kept a GGUF's 4-bit codes
    (built / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert gguf_serving.serving_checkpoint(tiny_llama, show_progress=False) == built
    assert "gguf_grid_tensors" in read_manifest(built)


def test_a_build_from_before_6bit_layers_is_rebuilt(tmp_path, isolated_cache):
    import json

    from tests.gguf_tiny import quantized_copy
    from vllm_omni_edge.quantization.manifest import MANIFEST_NAME, read_manifest

    gguf = quantized_copy(write_tiny_gguf(tmp_path / "tiny.gguf", "llama"), "q4_k_m")
    built = gguf_serving.serving_checkpoint(gguf, show_progress=False)
    manifest = read_manifest(built)
    assert "lm_head" in manifest["six_bit_layers"]
    del manifest["six_bit_layers"]  # as written before the builder kept Q6_K matrices at 6 bits
    (built / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert gguf_serving.serving_checkpoint(gguf, show_progress=False) == built
    assert "lm_head" in read_manifest(built)["six_bit_layers"]


def test_an_architecture_cpu_int4_does_not_take_is_served_in_bf16(tmp_path, isolated_cache):
    phi3 = write_tiny_gguf(tmp_path / "tiny-phi3.gguf", "phi3")
    built = gguf_serving.serving_checkpoint(phi3, show_progress=False)
    if built.name.endswith("-cpu_int4"):
        pytest.skip("the cpu_int4 builder takes phi3 now; nothing falls back")
    assert built.name.endswith("-bf16")
    assert "quantization_config" not in json.loads((built / "config.json").read_text())
    assert json.loads((built / "edge-manifest.json").read_text())["source_sha256"][:16] in built.name


def test_serve_points_vllm_at_the_build_and_serves_under_the_file_name(tiny_llama, isolated_cache):
    argv = edge_serve_argv([str(tiny_llama), "--port", "1"])
    built = gguf_serving.serving_checkpoint(tiny_llama, show_progress=False)
    assert argv[2] == str(built)
    assert argv[argv.index("--served-model-name") + 1] == "tiny-llama.gguf"


def test_what_is_not_a_gguf_is_refused_by_name(tmp_path, isolated_cache):
    fake = tmp_path / "notes.gguf"
    fake.write_bytes(b"not a model")
    with pytest.raises(ServeSetupError, match="not a GGUF file"):
        edge_serve_argv([str(fake)])
    assert not (isolated_cache / "gguf").exists()  # nothing half written


def test_a_base_models_file_without_a_chat_template_is_built_for_completions(tmp_path, isolated_cache):
    import dataclasses

    from tests.gguf_tiny import SPECS

    base = write_tiny_gguf(tmp_path / "tiny-base.gguf", dataclasses.replace(SPECS["gemma3"], chat_template=False))
    built = gguf_serving.serving_checkpoint(base, show_progress=False)
    config = json.loads((built / "tokenizer_config.json").read_text())
    assert not config.get("chat_template") and not (built / "chat_template.jinja").exists()
