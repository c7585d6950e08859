"""Fidelity for llama.cpp: numpy top-k rows, the logit source on a fake engine, prepared inputs."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_omni_edge_bench.harness import fidelity as fid


def test_numpy_topk_rows_match_the_torch_version():
    import torch

    rng = np.random.default_rng(0)
    lp = fid.log_softmax_numpy(rng.normal(size=(5, 50)) * 3)
    extra = np.array([[3, 3, -1, 49], [0, 1, 2, -1], [-1, -1, -1, -1], [7, 8, 9, 10], [49, 48, 3, 3]])
    ids_n, vals_n, rest_n = fid.topk_rows_numpy(lp, 6, extra)
    ids_t, vals_t, rest_t = fid._topk_rows(torch.from_numpy(lp), 6, extra)
    for r in range(5):
        kept_n = {int(i): float(v) for i, v in zip(ids_n[r], vals_n[r]) if i >= 0}
        kept_t = {int(i): float(v) for i, v in zip(ids_t[r], vals_t[r]) if i >= 0}
        assert kept_n.keys() == kept_t.keys()
        assert all(kept_n[i] == pytest.approx(kept_t[i], abs=1e-5) for i in kept_n)
    np.testing.assert_allclose(rest_n, rest_t, rtol=1e-6)
    # The mass adds up: kept tokens plus the rest is the whole distribution.
    total = np.where(ids_n >= 0, np.exp(vals_n.astype(np.float64)), 0).sum(axis=1) + np.exp(rest_n)
    np.testing.assert_allclose(total, 1.0, rtol=1e-5)


class FakeEngine:
    """Deterministic logits per (position, token so far); counts evals to check chunking."""

    path = "fake.gguf"

    def __init__(self, vocab=40, n_batch=4):
        self.vocab, self.n_batch, self.calls, self.history = vocab, n_batch, [], []

    def reset(self):
        self.history = []

    def eval(self, ids, logits="last"):
        assert logits == "all" and len(ids) <= self.n_batch
        self.calls.append(len(ids))
        self.last = []
        for tok in ids:
            self.history.append(int(tok))
            self.last.append(self.logits_after(self.history))

    def all_logits(self, n, start=0, stop=None):
        assert n == len(self.last)
        return np.array(self.last)[start:stop]

    def logits_after(self, history):
        rng = np.random.default_rng(sum((i + 1) * t for i, t in enumerate(history)))
        return rng.normal(size=self.vocab) * 2


def dense_reference(engine, windows):
    rows, targets = [], []
    for w in windows:
        for j in range(w.score_from, len(w.ids)):
            rows.append(fid.log_softmax_numpy(engine.logits_after(list(w.ids[:j]))[None, :])[0])
            targets.append(w.ids[j])
    return fid.PositionLogprobs.from_dense(np.array(rows), targets)


def test_llamacpp_source_scores_the_right_positions_in_chunks(monkeypatch):
    monkeypatch.setattr(fid.LlamaCppLogitSource, "ROWS_PER_BLOCK", 3)  # blocks that straddle eval chunks
    engine = FakeEngine(n_batch=4)
    windows = fid.windows_of_ids(list(range(1, 23)), window=10, stride=6)
    source = fid.LlamaCppLogitSource(engine)
    dense = source.logprobs(windows, top_k=None)
    expected = dense_reference(engine, windows)
    np.testing.assert_allclose(dense.logprobs, expected.logprobs, rtol=1e-5)
    np.testing.assert_array_equal(dense.target_ids, expected.target_ids)
    assert max(engine.calls) <= 4  # windows of 10 went in as chunks of n_batch

    topk = source.logprobs(windows, top_k=5)
    # The target is always among the reported ids, as vLLM reports the prompt token.
    assert all(t in row for t, row in zip(topk.target_ids, topk.ids))
    result = fid.compare(expected.topk(8), topk)
    assert result["kld_mean"] == pytest.approx(0.0, abs=1e-6)
    assert result["same_top1"] == 1.0
    assert source.identity()["engine"] == "llamacpp"


def test_prepared_inputs_round_trip_and_missing_reference_is_a_problem(tmp_path):
    windows = fid.windows_of_ids(list(range(1, 30)), window=8, stride=4)
    prepared = {"reference_key": "ab" * 32, "cache_file": str(tmp_path / f"{'ab' * 32}.npz"),
                "windows": [[w.start, w.score_from, list(w.ids)] for w in windows], "command": "python -m ... reference"}
    assert fid.windows_from_prepared(prepared) == windows
    outcome = fid.run_prepared_workload(fid.LlamaCppLogitSource(FakeEngine()), {"label": "fidelity"}, prepared)
    assert outcome["result"] is None
    assert "no cached reference" in outcome["problems"][0] and "python -m ... reference" in outcome["problems"][0]


def test_prepared_workload_scores_against_a_cached_reference(tmp_path):
    engine = FakeEngine(vocab=30, n_batch=8)
    windows = fid.windows_of_ids(list(range(1, 25)), window=8, stride=4)
    reference = dense_reference(engine, windows).topk(10)
    key = "cd" * 32
    path = fid.ReferenceCache(tmp_path).put(key, reference)
    prepared = {"reference_key": key, "cache_file": str(path), "command": "-",
                "windows": [[w.start, w.score_from, list(w.ids)] for w in windows]}
    outcome = fid.run_prepared_workload(fid.LlamaCppLogitSource(engine), {"label": "fidelity", "top_k": 20}, prepared)
    assert outcome["problems"] == []
    assert outcome["result"]["same_top1"] == 1.0
    assert outcome["figures"]["fidelity KLD mean"]["value"] == pytest.approx(0.0, abs=1e-6)
