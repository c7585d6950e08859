"""Fixtures for cpu_int4 tests: tiny random llama checkpoints and a one-process vLLM."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

# Shapes chosen so the default group 128 divides hidden (128) but not the MLP's
# intermediate size (192): down_proj exercises the group-size fallback.
TINY_LLAMA = dict(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=128,
)


def save_tiny_llama(path: Path, tie_word_embeddings: bool = True, dtype=torch.bfloat16) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**TINY_LLAMA, tie_word_embeddings=tie_word_embeddings)
    LlamaForCausalLM(config).to(dtype).save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A random tied-embedding llama, bf16, saved with save_pretrained (read-only for tests)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_llama_int4(tiny_llama, tmp_path_factory) -> Path:
    from vllm_omni_edge.quantization.builder import build_cpu_int4_checkpoint

    out = tmp_path_factory.mktemp("tiny-int4") / "tiny-llama-cpu-int4"
    # Format 3's shared 4-bit table (a tied head's default is int8 rows: test_embedding_int4.py).
    build_cpu_int4_checkpoint(tiny_llama, out, group_size=128, progress=False, embedding="int4")
    return out


@pytest.fixture(scope="session")
def _vllm_process_groups():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        with set_current_vllm_config(VllmConfig()):
            init_file = Path(tempfile.mkdtemp()) / "dist-init"
            parallel_state.init_distributed_environment(
                world_size=1, rank=0, distributed_init_method=f"file://{init_file}",
                local_rank=0, backend="gloo",
            )
            parallel_state.initialize_model_parallel(1, 1)


@pytest.fixture
def vllm_single_process(_vllm_process_groups):
    """One-rank vLLM process groups and a default config, to build real vLLM layers in-process."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_omni_edge.quantization import evidence

    evidence.reset()
    with set_current_vllm_config(VllmConfig()):
        yield
    evidence.reset()
