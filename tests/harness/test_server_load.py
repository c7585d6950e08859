"""The server workload's maths and bookkeeping, without a server: mixes, percentiles,
counts by status, /metrics parsing, and a stream faked chunk by chunk."""

import asyncio
import types

import httpx
import openai
import pytest

from vllm_omni_edge_bench.harness import server_load
from vllm_omni_edge_bench.harness.server_load import RequestOutcome
from tests.harness.conftest import FIXTURES


def test_mix_is_cycled_in_order_and_fixed_length_otherwise():
    assert server_load.prompt_lengths(7, 128, [32, 128, 384]) == [32, 128, 384, 32, 128, 384, 32]
    assert server_load.prompt_lengths(3, 64, None) == [64, 64, 64]


def test_percentiles_interpolate_between_ranks():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert server_load.percentile(values, 50) == pytest.approx(50.5)
    assert server_load.percentile(values, 99) == pytest.approx(99.01)
    assert server_load.percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError):
        server_load.percentile([], 50)


def _done(index, sent, first, gaps, tokens=4, prompt=16, status="completed", done=None):
    return RequestOutcome(index=index, prompt_tokens=prompt, max_tokens=tokens, status=status, sent_t=sent,
                          first_token_t=first, done_t=done if done is not None else first + sum(gaps),
                          completion_tokens=tokens if status == "completed" else None,
                          streamed_tokens=tokens if status == "completed" else 0, usage_prompt_tokens=prompt,
                          finish_reason="length" if status == "completed" else None, token_gaps_s=list(gaps))


def test_summary_counts_throughput_and_latency():
    outcomes = [
        _done(0, 0.0, 0.1, [0.1, 0.1, 0.1]),   # done at 0.4
        _done(1, 0.0, 0.3, [0.2, 0.2, 0.2]),   # done at 0.9
        _done(2, 0.5, 0.6, [0.1, 0.1, 0.4]),   # done at 1.2
        _done(3, 0.9, None, [], status="http_503", done=1.0),
        _done(4, 0.9, None, [], status="connection", done=1.0),
    ]
    summary = server_load.summarise_load(outcomes, not_sent=2)
    assert summary["wall_s"] == pytest.approx(1.2)
    assert summary["output_tokens"] == 12
    assert summary["output_tok_s"] == pytest.approx(12 / 1.2)
    assert summary["request_s"] == pytest.approx(3 / 1.2)
    assert summary["ttft_p50_s"] == pytest.approx(0.1)  # ttfts 0.1, 0.3, 0.1
    assert summary["ttft_p99_s"] == pytest.approx(0.1 + 0.98 * 0.2)
    assert summary["itl_p50_s"] == pytest.approx(0.1)  # gaps 0.1 x5, 0.2 x3, 0.4
    assert (summary["completed"], summary["errored"], summary["not_sent"], summary["sent"]) == (3, 2, 2, 5)
    assert summary["by_status"] == {"completed": 3, "connection": 1, "http_503": 1}
    figures = server_load.server_figures("server3x7", summary, preemptions=4.0, clients=3)
    assert figures["server3x7 output"]["value"] == pytest.approx(10.0)
    assert figures["server3x7 TTFT p99"]["value"] == pytest.approx(296.0)
    assert figures["server3x7 errored"]["value"] == 2 and figures["server3x7 errored"]["better"] == "lower"
    assert figures["server3x7 preemptions"]["value"] == 4.0


def test_no_completed_request_gives_counts_but_no_rates():
    summary = server_load.summarise_load([_done(0, 0.0, None, [], status="http_500", done=0.2)], not_sent=0)
    figures = server_load.server_figures("s", summary, preemptions=None, clients=1)
    assert set(figures) == {"s output", "s requests", "s completed", "s errored"}
    assert figures["s output"]["value"] == 0 and figures["s errored"]["value"] == 1


def test_errors_are_not_problems_but_hangs_and_short_requests_are():
    ok = _done(0, 0.0, 0.1, [0.1] * 3)
    refused = _done(1, 0.0, None, [], status="http_400", done=0.1)
    hung = _done(2, 0.0, 0.1, [0.1], status="timeout")
    cut = _done(3, 0.0, 0.1, [0.1], status="incomplete")
    short = _done(4, 0.0, 0.1, [0.1] * 3)
    short.completion_tokens = 3
    cached = _done(5, 0.0, 0.1, [0.1] * 3)
    cached.cached_tokens = 16
    assert server_load.outcome_problems([ok, refused], "w") == []
    problems = server_load.outcome_problems([hung, cut, short, cached], "w")
    assert [p.split(":")[0] for p in problems] == ["w request 2", "w request 3", "w request 4", "w request 5"]
    assert "asked for 4 tokens, usage says 3" in problems[2]
    assert "16 prompt tokens came from the prefix cache" in problems[3]


def test_preemption_counter_is_read_from_prometheus_text():
    text = (FIXTURES / "vllm_metrics.txt").read_text()
    assert server_load.counter_total(text, server_load.PREEMPTIONS_METRIC) == 3.0
    assert server_load.counter_total(text, "vllm:prompt_tokens") == 1234.0
    assert server_load.counter_total(text, "vllm:no_such_counter") is None


class _FakeStream:
    def __init__(self, chunks, error=None):
        self.chunks, self.error = chunks, error

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for chunk in self.chunks:
            await asyncio.sleep(0.01)
            yield chunk
        if self.error:
            raise self.error


def _chunk(token_ids=None, finish=None, usage=None):
    choices = [] if token_ids is None else [types.SimpleNamespace(token_ids=token_ids, text="x", finish_reason=finish)]
    return types.SimpleNamespace(choices=choices, usage=usage)


class _FakeClient:
    def __init__(self, result):
        self.result = result
        self.completions = self
        self.kwargs = None

    async def create(self, **kwargs):
        self.kwargs = kwargs
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


def _run(result, max_tokens=4, timeout_s=5.0):
    client = _FakeClient(result)
    outcome = asyncio.run(server_load.stream_completion(client, "m", 7, [1, 2, 3], max_tokens, timeout_s))
    return outcome, client.kwargs


def test_stream_counts_tokens_per_chunk_and_asks_for_exact_greedy_tokens():
    usage = types.SimpleNamespace(completion_tokens=4, prompt_tokens=3,
                                  prompt_tokens_details=types.SimpleNamespace(cached_tokens=0))
    outcome, kwargs = _run(_FakeStream([_chunk([5]), _chunk([6, 7]), _chunk([8], finish="length"), _chunk(usage=usage)]))
    assert outcome.status == "completed" and outcome.streamed_tokens == 4 and outcome.completion_tokens == 4
    assert outcome.cached_tokens == 0
    assert len(outcome.token_gaps_s) == 3  # a gap per token after the first; the pair shares one gap
    assert outcome.token_gaps_s[0] == outcome.token_gaps_s[1]
    assert outcome.ttft_s > 0 and server_load.outcome_problems([outcome], "w") == []
    assert kwargs["prompt"] == [1, 2, 3] and kwargs["temperature"] == 0.0 and kwargs["stream"] is True
    assert kwargs["extra_body"] == {"ignore_eos": True, "return_token_ids": True}


def test_stream_without_finish_is_incomplete():
    outcome, _ = _run(_FakeStream([_chunk([5])]))
    assert outcome.status == "incomplete"
    assert server_load.outcome_problems([outcome], "w")


def _request():
    return httpx.Request("POST", "http://127.0.0.1/v1/completions")


@pytest.mark.parametrize("error, status", [
    (openai.APIStatusError("busy", response=httpx.Response(503, request=_request()), body=None), "http_503"),
    (openai.APIConnectionError(request=_request()), "connection"),
    (openai.APITimeoutError(request=_request()), "timeout"),
])
def test_request_errors_are_classified(error, status):
    outcome, _ = _run(error)
    assert outcome.status == status and outcome.error


def test_error_inside_the_stream_is_a_stream_error():
    error = openai.APIError("An error occurred during streaming", request=_request(), body=None)
    outcome, _ = _run(_FakeStream([_chunk([5])], error=error))
    assert outcome.status == "stream_error"


def test_a_request_that_never_ends_times_out():
    class Forever(_FakeStream):
        async def _gen(self):
            while True:
                await asyncio.sleep(0.05)
                yield _chunk([1])

    outcome, _ = _run(Forever([]), timeout_s=0.3)
    assert outcome.status == "timeout"


def test_load_runs_every_request_once_with_bounded_concurrency(monkeypatch):
    active, peak, seen = 0, 0, []

    async def fake_stream(client, model, index, prompt, max_tokens, timeout_s):
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        seen.append(index)
        await asyncio.sleep(0.01)
        active -= 1
        return _done(index, 0.0, 0.01, [0.01] * (max_tokens - 1), tokens=max_tokens, prompt=len(prompt))

    class Closable:
        async def close(self):
            pass

    monkeypatch.setattr(server_load, "stream_completion", fake_stream)
    monkeypatch.setattr(server_load, "make_client", lambda url, timeout: Closable())
    prompts = [[1] * n for n in server_load.prompt_lengths(10, 0, [2, 5])]
    load = asyncio.run(server_load.run_load("http://x", "m", prompts, 4, clients=3, request_timeout_s=5))
    assert sorted(seen) == list(range(10)) and peak == 3
    assert [o.prompt_tokens for o in load["outcomes"]] == [2, 5] * 5 and load["not_sent"] == 0

    seen.clear()
    load = asyncio.run(server_load.run_load("http://x", "m", prompts, 4, clients=2, request_timeout_s=5,
                                            duration_s=1e-9))
    assert load["not_sent"] == 10 and load["outcomes"] == []


def test_a_stream_whose_tokens_arrived_bunched_is_a_problem():
    steady = [0.0066] * 127  # ~150 tok/s, one token per event
    assert server_load.bunched_stream_problem(steady, "tg128 decode") is None
    # A starved client: the first token late, then the rest read back to back.
    bunched = [0.00008] * 100 + [0.06] + [0.00008] * 26
    problem = server_load.bunched_stream_problem(bunched, "tg128 decode")
    assert problem and "bunched" in problem and "tg128 decode" in problem
    assert server_load.bunched_stream_problem([0.00008] * 5, "short") is None  # too few to judge


def test_tokens_read_together_right_after_the_first_are_left_out_of_the_rate():
    # The client came late: 56 tokens were waiting and read at once, then one token every 3.2 ms.
    gaps = [0.0] * 56 + [0.0032] * 71
    late = server_load.late_start(gaps)
    assert late == 56
    assert abs((len(gaps) - late) / sum(gaps[late:]) - 312.5) < 0.1  # not 127 / 0.227 s = 559
    assert server_load.late_start([0.0032] * 10) == 0
    assert server_load.late_start([0.0032, 0.0, 0.0032]) == 0  # only a leading run counts
    assert server_load.late_start([0.0] * 4) == 4
