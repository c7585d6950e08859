"""Each memory lever, checked in the worker process that holds the model."""

from __future__ import annotations

import psutil
import pytest

from tests.e2e.probe import run_probe
from vllm_omni_edge.cpu_features import usable_cores
from vllm_omni_edge.levers import kv_budget as kv

pytestmark = pytest.mark.e2e
NO_BUDGET = {"kv_cache_memory_bytes": None}


def test_default_budget_and_rope_cap_reach_the_worker(default_model, tmp_path, monkeypatch):
    monkeypatch.delenv(kv.ENV_KVCACHE_SPACE, raising=False)
    run = run_probe(default_model, tmp_path / "ev", NO_BUDGET | {"max_num_seqs": 4})
    assert run.returncode == 0, run.log
    assert "Paris" in run.text
    [worker] = run.workers
    shape = kv.KVShape(30 * 2 * 3 * 64 * 2, 128)  # SmolLM2-135M, bf16, CPU blocks of 128
    expected = kv.decide(None, shape, 512, 4, psutil.virtual_memory().total, "need")
    assert worker["kv_cache_memory_bytes_requested"] == expected.budget_bytes
    assert worker["kv_cache_bytes"] == expected.budget_bytes  # 4 whole requests, whole blocks
    assert [r["rows"] for r in worker["rope"]] == [512]


@pytest.mark.parametrize("max_model_len", [512, 1000])
def test_stock_llm_with_no_budget_answers_in_one_process(default_model, tmp_path, monkeypatch, max_model_len):
    """LLM(model, max_model_len=N) as a user writes it: no budget, no max_num_seqs, no flags."""
    monkeypatch.delenv(kv.ENV_KVCACHE_SPACE, raising=False)
    run = run_probe(default_model, tmp_path / "ev", {"kv_cache_memory_bytes": None, "enforce_eager": None,
                                                     "max_model_len": max_model_len})
    assert run.returncode == 0, run.log
    assert "Paris" in run.text
    assert [p["role"] for p in run.processes] == ["frontend"]  # in-process by default
    [worker] = run.workers
    shape = kv.KVShape(30 * 2 * 3 * 64 * 2, 128)
    assert worker["kv_cache_bytes"] >= shape.pool_bytes(max_model_len, 1)  # one request and the null block
    assert worker["torch_threads"] == usable_cores()  # the model gets every core


def test_rope_cap_off_keeps_vllms_table(default_model, tmp_path):
    run = run_probe(default_model, tmp_path / "ev", VLLM_OMNI_EDGE_ROPE_CAP="0")
    assert run.returncode == 0, run.log
    [worker] = run.workers
    assert [r["rows"] for r in worker["rope"]] == [8192]  # SmolLM2's max_position_embeddings


def test_env_budget_that_contradicts_the_argument_is_refused(default_model, tmp_path):
    run = run_probe(default_model, tmp_path / "ev", timeout=180, VLLM_CPU_KVCACHE_SPACE="1")
    assert run.returncode != 0 and not run.workers
    assert "disagree" in run.log and "VLLM_CPU_KVCACHE_SPACE" in run.log


def test_budget_too_small_for_max_model_len_names_the_minimum(default_model, tmp_path):
    minimum = kv.KVShape(30 * 2 * 3 * 64 * 2, 128).pool_bytes(512, 1)
    run = run_probe(default_model, tmp_path / "ev", {"kv_cache_memory_bytes": 1 << 20},
                    timeout=180)
    assert run.returncode != 0 and not run.workers
    assert "at least" in run.log and f"{minimum} B" in run.log
