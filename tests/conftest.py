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
