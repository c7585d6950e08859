"""The llama.cpp pass's workload logic on a fake engine (no llama.cpp): same definitions as pass_vllm."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_omni_edge_bench.harness import pass_llamacpp
from vllm_omni_edge_bench.harness.prompts import PromptBank


class FakePerf:
    def __init__(self):
        self.data = SimpleNamespace(t_p_eval_ms=0.0, n_p_eval=0, t_eval_ms=0.0, n_eval=0)

    def llama_perf_context_reset(self, _ctx):
        self.data = SimpleNamespace(t_p_eval_ms=0.0, n_p_eval=0, t_eval_ms=0.0, n_eval=0)

    def llama_perf_context(self, _ctx):
        return self.data


class FakeEngine:
    """Generates token 7 forever; 'prefill' costs 1 ms per prompt token, decode 10 ms per token."""

    ctx = object()
    n_vocab = 100

    def __init__(self, clock):
        self.L = FakePerf()
        self.clock = clock
        self.prompts = []

    def generate_greedy(self, prompt, n_tokens):
        self.prompts.append(list(prompt))
        self.clock.advance(0.001 * len(prompt) + 0.010 * (n_tokens - 1))
        self.L.data = SimpleNamespace(t_p_eval_ms=1.0 * len(prompt), n_p_eval=len(prompt),
                                      t_eval_ms=10.0 * (n_tokens - 1), n_eval=n_tokens - 1)
        return [7] * n_tokens

    def tokenize(self, text):
        return [1, 2, 3]

    def detokenize(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


class Clock:
    def __init__(self):
        self.now = 0.0

    def advance(self, seconds):
        self.now += seconds

    def __call__(self):
        return self.now


@pytest.fixture
def fake(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(pass_llamacpp.time, "perf_counter", clock)
    return FakeEngine(clock)


def test_decode_is_n_minus_one_over_the_time_difference(fake):
    runner = pass_llamacpp.Pass(fake, list(range(50)))
    result = runner.run({"kind": "decode", "label": "tg16", "prompt_tokens": 8, "gen_tokens": 16, "warmup": True}, {})
    assert runner.problems == []
    assert [r["purpose"] for r in result["requests"]] == ["tg16 warm-up", "tg16 decode", "tg16 prompt only"]
    assert result["figures"]["tg16"]["value"] == pytest.approx(100.0)  # 15 tokens in 0.15 s
    assert result["figures"]["tg16 (engine)"]["value"] == pytest.approx(100.0)
    # No two requests share a prompt (no prefix could be reused), all of the asked length.
    assert len({tuple(p) for p in fake.prompts}) == 3 and {len(p) for p in fake.prompts} == {8}


def test_prefill_and_ttft_are_one_request_with_one_token_out(fake):
    runner = pass_llamacpp.Pass(fake, list(range(50)))
    pp = runner.run({"kind": "prefill", "label": "pp64", "prompt_tokens": 64, "warmup": False}, {})
    assert pp["figures"]["pp64"]["value"] == pytest.approx(1000.0)
    ttft = runner.run({"kind": "ttft", "label": "ttft16", "prompt_tokens": 16, "warmup": False}, {})
    assert ttft["figures"]["ttft16"]["value"] == pytest.approx(16.0) and ttft["figures"]["ttft16"]["unit"] == "ms"


def test_short_generation_is_a_problem(fake, monkeypatch):
    monkeypatch.setattr(fake, "generate_greedy", lambda prompt, n: [7] * (n - 1))
    runner = pass_llamacpp.Pass(fake, list(range(50)))
    runner.generate(8, 4, "probe")
    assert runner.problems == ["probe: asked for 8+4 tokens, got 8+3"]


def test_unsupported_workload_is_refused(fake):
    with pytest.raises(NotImplementedError, match="server"):
        pass_llamacpp.Pass(fake, list(range(50))).run({"kind": "server", "label": "s"}, {})


def test_tokenizer_check_compares_meaning_not_only_ids(fake):
    ids = [0, 1, 2]
    spec = {"prompt_token_ids": ids, "prompt_text": "abc", "tokenizer_path": "/hf"}
    check = pass_llamacpp.tokenizer_check(fake, spec)
    assert check == {"hf_tokenizer": "/hf", "same_text_for_ids": True, "same_ids_for_text": False, "ids_in_vocab": True}
    assert pass_llamacpp.tokenizer_check(fake, {**spec, "prompt_text": "abd"})["same_text_for_ids"] is False


def test_prompt_bank_is_the_one_vllm_uses():
    ids = list(range(74))  # a multiple of PromptBank.STRIDE: the bank drops one id, in both passes alike
    assert pass_llamacpp.Pass(FakeEngine(Clock()), ids).bank.token_ids == PromptBank(ids).token_ids


def test_cpu_capability_from_compiled_features():
    assert pass_llamacpp._cpu_capability({"CPU": {"AVX": True, "AVX2": True, "AVX512": False}}) == "AVX2"
    assert pass_llamacpp._cpu_capability({"CPU": {"AVX2": True, "AVX512": True, "AMX_INT8": True}}) == "AMX_INT8"
    assert pass_llamacpp._cpu_capability({}) == "scalar"
