"""patches/frontend/encoder_batched_tokens.py: the default step budget fits one encoder input."""

from __future__ import annotations

import pytest

from vllm_omni_edge.patches.base import apply_patch_module

MODULE = "vllm_omni_edge.patches.frontend.encoder_batched_tokens"


def _whisper_dir(tmp_path):
    """whisper-base's shapes that matter here (448 decoder positions, 1500 encoder ones), tiny otherwise."""
    from transformers import WhisperConfig

    WhisperConfig(vocab_size=51865, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                  decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                  max_source_positions=1500, max_target_positions=448,
                  architectures=["WhisperForConditionalGeneration"]).save_pretrained(tmp_path)
    return str(tmp_path)


def _budget(model: str, **kwargs) -> int:
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=model, skip_tokenizer_init=True, **kwargs).create_engine_config()
    return config.scheduler_config.max_num_batched_tokens


@pytest.fixture(scope="module", autouse=True)
def patched():
    assert apply_patch_module(MODULE).status == "applied"


def test_whisper_default_budget_fits_the_encoder_input(tmp_path):
    model = _whisper_dir(tmp_path)
    assert _budget(model, max_num_seqs=2) == 1500  # vLLM alone: min(2 * 448, ...) = 896
    assert _budget(model, max_num_seqs=8) >= 1500  # already enough: left as vLLM set it
    assert _budget(model, max_num_seqs=2, max_num_batched_tokens=1024) == 1024  # given: not touched


def test_decoder_only_models_are_left_alone(default_model):
    assert _budget(str(default_model), max_num_seqs=2, max_model_len=256) == 512
