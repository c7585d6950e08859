"""The tiny SD3 builder: the checkpoint vLLM-Omni's SD3 pipeline loads, without starting vLLM-Omni."""

from __future__ import annotations

import json

import pytest

from vllm_omni_edge.omni import tiny_models


@pytest.fixture(scope="module")
def tiny_sd3_dir(tmp_path_factory):
    return tiny_models.tiny_sd3(tmp_path_factory.mktemp("tiny"))


def test_model_index_names_the_pipeline_vllm_omni_serves(tiny_sd3_dir):
    from vllm_omni.diffusion.registry import DiffusionModelRegistry

    index = json.loads((tiny_sd3_dir / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["_class_name"] in DiffusionModelRegistry.get_supported_archs()
    for part in ("transformer", "vae", "scheduler", "text_encoder", "text_encoder_2", "text_encoder_3",
                 "tokenizer", "tokenizer_2", "tokenizer_3"):
        assert (tiny_sd3_dir / part).is_dir(), part


def test_component_shapes_fit_together(tiny_sd3_dir):
    """The joins vLLM-Omni's SD3 pipeline makes between components, checked on the configs."""
    read = lambda part, name="config.json": json.loads((tiny_sd3_dir / part / name).read_text())  # noqa: E731
    transformer, vae = read("transformer"), read("vae")
    clip, clip_2, t5 = read("text_encoder"), read("text_encoder_2"), read("text_encoder_3")
    inner_dim = transformer["num_attention_heads"] * transformer["attention_head_dim"]
    assert transformer["caption_projection_dim"] == inner_dim
    assert transformer["pooled_projection_dim"] == clip["projection_dim"] + clip_2["projection_dim"]
    assert transformer["joint_attention_dim"] == t5["d_model"]
    assert clip["hidden_size"] + clip_2["hidden_size"] <= t5["d_model"]  # CLIP embeds are padded to T5's width
    assert transformer["in_channels"] == vae["latent_channels"] == transformer["out_channels"]
    vae_scale = 2 ** (len(vae["block_out_channels"]) - 1)
    assert vae_scale * transformer["patch_size"] == tiny_models.SD3_SIZE_MULTIPLE
    assert sum(p.stat().st_size for p in tiny_sd3_dir.rglob("*.safetensors")) < 16 * 2**20  # tiny


def test_tokenizers_load_as_vllm_omni_loads_them_and_fit_the_encoders(tiny_sd3_dir):
    from transformers import CLIPTokenizer, T5Tokenizer

    prompt = "a red square on a blue field"
    for sub, enc in (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")):
        tok = CLIPTokenizer.from_pretrained(tiny_sd3_dir, subfolder=sub, local_files_only=True)
        config = json.loads((tiny_sd3_dir / enc / "config.json").read_text())
        ids = tok(prompt, padding="max_length", max_length=tok.model_max_length).input_ids
        assert tok.model_max_length == config["max_position_embeddings"] == len(ids)
        assert max(ids) < config["vocab_size"]
        assert ids[0] == config["bos_token_id"] and config["eos_token_id"] in ids
        assert tok.decode(ids, skip_special_tokens=True).replace(" ", "") == prompt.replace(" ", "")
    t5_tok = T5Tokenizer.from_pretrained(tiny_sd3_dir, subfolder="tokenizer_3", local_files_only=True)
    t5 = json.loads((tiny_sd3_dir / "text_encoder_3" / "config.json").read_text())
    ids = t5_tok(prompt).input_ids
    assert ids[-1] == t5["eos_token_id"] and max(ids) < t5["vocab_size"]
    assert t5_tok.unk_token_id not in ids  # every character of the prompt has a token
    assert t5_tok.decode(ids, skip_special_tokens=True) == prompt


def test_cached_build_is_reused_and_a_stale_one_rebuilt(tiny_sd3_dir, monkeypatch):
    marker = tiny_sd3_dir / "vllm_omni_edge_tiny.json"
    before = marker.stat().st_mtime_ns
    assert tiny_models.tiny_sd3(tiny_sd3_dir.parent) == tiny_sd3_dir
    assert marker.stat().st_mtime_ns == before  # not rebuilt

    built = []
    monkeypatch.setattr(tiny_models, "build_tiny_sd3", lambda out: built.append(out) or out)
    marker.write_text(json.dumps({"tiny_sd3_version": tiny_models.TINY_SD3_VERSION - 1}))
    try:
        assert tiny_models.tiny_sd3(tiny_sd3_dir.parent) == tiny_sd3_dir
        assert built == [tiny_sd3_dir]
    finally:
        marker.write_text(json.dumps({"tiny_sd3_version": tiny_models.TINY_SD3_VERSION}))
