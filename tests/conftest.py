"""Shared fixtures. Tests that start vLLM are marked ``e2e`` (see pyproject)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The real default model's bf16 checkpoint (built once, then cached)."""
    from vllm_omni_edge.models.default_model import pull_default_model

    return pull_default_model()


@pytest.fixture
def tokenizer_file_reads(monkeypatch) -> list[str]:
    """The paths transformers' ``AutoTokenizer.from_pretrained`` reads a tokenizer from, in order."""
    from transformers import AutoTokenizer

    reads: list[str] = []
    original = AutoTokenizer.from_pretrained.__func__

    def counted(cls, path, *args, **kwargs):
        reads.append(str(path))
        return original(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(counted))
    return reads


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch) -> Path:
    """A private model cache, so a test can break it without touching the real one."""
    monkeypatch.setenv("VLLM_OMNI_EDGE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def vllm_env(**extra: str) -> dict[str, str]:
    """Environment for a vLLM child: quiet, and with our venv's scripts on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.update(extra)
    return env
