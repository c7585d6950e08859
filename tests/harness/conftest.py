"""Helpers for the harness tests: grids in code, and the runner pointed at fake_pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_omni_edge_bench.harness import runner
from vllm_omni_edge_bench.harness.grid import parse_grid

FIXTURES = Path(__file__).parent / "fixtures"


def grid_dict(**overrides) -> dict:
    """A small valid grid as plain data; tests change one thing at a time."""
    data = {
        "name": "unit",
        "passes": 3,
        "control": "a",
        "arms": [
            {"name": "a", "model": "/tmp", "llm_kwargs": {"enforce_eager": True}},
            {"name": "b", "model": "/tmp", "llm_kwargs": {"enforce_eager": True}},
        ],
        "workloads": [{"decode": {"gen_tokens": 16}}],
    }
    data.update(overrides)
    return data


@pytest.fixture
def fake_engine(monkeypatch):
    """Run passes with tests/harness/fake_pass.py instead of vLLM."""
    monkeypatch.setitem(runner.PASS_MODULES, "vllm", "tests.harness.fake_pass")
    monkeypatch.setattr(runner, "EXIT_GRACE_S", 1.0)
    monkeypatch.setattr(runner, "TERM_GRACE_S", 1.0)


def fake_grid(tmp_path: Path, a: dict, b: dict, **overrides):
    """Two arms on fake_pass; ``a``/``b`` are the arms' llm_kwargs (fake mode, tok_s...)."""
    data = grid_dict(**overrides)
    data["arms"] = [
        {"name": "a", "model": str(tmp_path), "llm_kwargs": a},
        {"name": "b", "model": str(tmp_path), "llm_kwargs": b},
    ]
    return parse_grid(data)


def quiet_options(**kwargs) -> runner.RunOptions:
    return runner.RunOptions(sample_interval_s=0.05, log=lambda line: None, **kwargs)
