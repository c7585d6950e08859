"""Streaming requests against the OpenAI server: one at a time, or N concurrent clients.

Every request ends in exactly one recorded state:

- ``completed``: the stream finished with a finish reason and a usage record;
- ``http_<status>``, ``connection``, ``stream_error``: the server refused or failed
  it; counted per status, not fatal (an overloaded server answering 4xx/5xx is a
  result worth having);
- ``timeout``: no end within ``request_timeout_s``;
- ``incomplete``: the stream ended without finishing.

A ``timeout`` or ``incomplete`` request, or a completed one that did not get the
tokens it asked for, makes the pass invalid: the figures would then describe
something other than the workload.

Requests use ``/v1/completions`` with prompt token ids (exact lengths, no chat
template) and ``return_token_ids``, so each streamed chunk says how many tokens
it carries and inter-token latency is per token even when chunks batch tokens.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

COMPLETED, TIMEOUT, INCOMPLETE = "completed", "timeout", "incomplete"
PREEMPTIONS_METRIC = "vllm:num_preemptions"  # a counter: exposed as vllm:num_preemptions_total


@dataclass
class RequestOutcome:
    index: int
    prompt_tokens: Optional[int]  # None for a text prompt, whose length the tokenizer decides
    max_tokens: int
    status: str = INCOMPLETE
    sent_t: float = 0.0
    first_token_t: Optional[float] = None
    done_t: Optional[float] = None
    completion_tokens: Optional[int] = None  # from the usage record
    streamed_tokens: int = 0  # counted from the chunks' token ids
    usage_prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None  # prompt tokens served by the prefix cache, if the server says
    finish_reason: Optional[str] = None
    token_gaps_s: list[float] = field(default_factory=list)  # one per token after the first
    error: Optional[str] = None

    @property
    def ttft_s(self) -> Optional[float]:
        return None if self.first_token_t is None else self.first_token_t - self.sent_t

    @property
    def decode_s(self) -> Optional[float]:
        """From the first to the last token, for (n-1)/decode_s."""
        if self.first_token_t is None or not self.token_gaps_s:
            return None
        return sum(self.token_gaps_s)

    def record(self) -> dict[str, Any]:
        out = asdict(self)
        out["ttft_s"] = self.ttft_s
        out["token_gaps_s"] = [round(g, 6) for g in self.token_gaps_s]
        return out


def prompt_lengths(requests: int, prompt_tokens: int, mix: Optional[list[int]]) -> list[int]:
    """Prompt length of each request: the mix cycled in order, else the fixed length."""
    cycle = list(mix) if mix else [prompt_tokens]
    return [cycle[i % len(cycle)] for i in range(requests)]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linear between closest ranks (numpy's default)."""
    import numpy as np

    if not values:
        raise ValueError("percentile of no values")
    return float(np.percentile(np.asarray(values, dtype=float), q))


def counter_total(metrics_text: str, name: str) -> Optional[float]:
    """Sum over label sets of counter ``name`` in Prometheus text; None if the server does not expose it."""
    from prometheus_client.parser import text_string_to_metric_families

    total, seen = 0.0, False
    for family in text_string_to_metric_families(metrics_text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == name + "_total":
                total += sample.value
                seen = True
    return total if seen else None


def _error_status(error: BaseException) -> str:
    import openai

    if isinstance(error, (asyncio.TimeoutError, openai.APITimeoutError)):
        return TIMEOUT
    if isinstance(error, openai.APIStatusError):
        return f"http_{error.status_code}"
    if isinstance(error, openai.APIConnectionError):
        return "connection"
    if isinstance(error, openai.APIError):
        return "stream_error"  # the server put an error event into the stream
    raise error


def _chunk_tokens(choice) -> int:
    ids = getattr(choice, "token_ids", None)
    if ids is None and getattr(choice, "model_extra", None):
        ids = choice.model_extra.get("token_ids")
    if ids is not None:
        return len(ids)
    return 1 if getattr(choice, "text", "") else 0


async def stream_completion(client, model: str, index: int, prompt_ids: list[int] | str, max_tokens: int,
                            timeout_s: float) -> RequestOutcome:
    """One greedy streamed completion of exactly ``max_tokens`` tokens (ignore_eos)."""
    outcome = RequestOutcome(index=index, prompt_tokens=None if isinstance(prompt_ids, str) else len(prompt_ids),
                             max_tokens=max_tokens)

    async def consume() -> None:
        stream = await client.completions.create(
            model=model, prompt=prompt_ids, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        last_t = None
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                outcome.completion_tokens = chunk.usage.completion_tokens
                outcome.usage_prompt_tokens = chunk.usage.prompt_tokens
                details = getattr(chunk.usage, "prompt_tokens_details", None)
                if details is not None:
                    outcome.cached_tokens = details.cached_tokens
            for choice in chunk.choices:
                n = _chunk_tokens(choice)
                if n:
                    if last_t is None:
                        # Tokens that came with the first one have no gap to measure.
                        outcome.first_token_t = now
                    else:
                        outcome.token_gaps_s += [(now - last_t) / n] * n
                    last_t = now
                    outcome.streamed_tokens += n
                if choice.finish_reason:
                    outcome.finish_reason = choice.finish_reason

    outcome.sent_t = time.perf_counter()
    try:
        await asyncio.wait_for(consume(), timeout_s)
    except BaseException as error:  # noqa: BLE001 - classified, or re-raised if unknown
        outcome.status = _error_status(error)
        outcome.error = f"{type(error).__name__}: {str(error)[:300]}"
    else:
        done = outcome.finish_reason is not None and outcome.completion_tokens is not None
        outcome.status = COMPLETED if done else INCOMPLETE
    outcome.done_t = time.perf_counter()
    return outcome


def make_client(base_url: str, timeout_s: float):
    from openai import AsyncOpenAI

    # No retries: a retried request would be counted once and measured twice.
    return AsyncOpenAI(base_url=base_url + "/v1", api_key="EMPTY", timeout=timeout_s, max_retries=0)


async def run_load(base_url: str, model: str, prompts: list[list[int]], gen_tokens: int, clients: int,
                   request_timeout_s: float, duration_s: Optional[float] = None) -> dict[str, Any]:
    """``clients`` workers take requests in order until all are sent or ``duration_s`` has passed."""
    client = make_client(base_url, request_timeout_s)
    outcomes: list[RequestOutcome] = []
    next_index = 0
    start = time.perf_counter()

    async def worker() -> None:
        nonlocal next_index
        while next_index < len(prompts):
            if duration_s is not None and time.perf_counter() - start >= duration_s:
                return
            index = next_index
            next_index += 1
            outcomes.append(await stream_completion(client, model, index, prompts[index], gen_tokens,
                                                    request_timeout_s))

    try:
        await asyncio.gather(*(worker() for _ in range(clients)))
    finally:
        await client.close()
    outcomes.sort(key=lambda o: o.index)
    return {"outcomes": outcomes, "not_sent": len(prompts) - len(outcomes), "start_t": start}


def outcome_problems(outcomes: list[RequestOutcome], what: str) -> list[str]:
    """Requests that neither completed as asked nor failed with a status the server gave."""
    problems = []
    for o in outcomes:
        where = f"{what} request {o.index}"
        if o.status in (TIMEOUT, INCOMPLETE):
            problems.append(f"{where}: {o.status} ({o.error or 'stream ended without a finish reason'})")
        elif o.status == COMPLETED:
            if o.completion_tokens != o.max_tokens or o.streamed_tokens != o.max_tokens:
                problems.append(f"{where}: asked for {o.max_tokens} tokens, usage says {o.completion_tokens}, "
                                f"stream carried {o.streamed_tokens} ({o.finish_reason})")
            if o.prompt_tokens is not None and o.usage_prompt_tokens != o.prompt_tokens:
                problems.append(f"{where}: sent {o.prompt_tokens} prompt tokens, usage says {o.usage_prompt_tokens}")
            if o.cached_tokens:
                problems.append(f"{where}: {o.cached_tokens} prompt tokens came from the prefix cache")
    return problems


# One sequence's tokens cannot come faster than this on a CPU; closer gaps mean the client read
# them late (it was starved of the CPU), so a rate taken from them would be the client's, not the server's.
BUNCHED_GAP_S = 0.0005


def late_start(gaps_s: list[float]) -> int:
    """How many of a stream's first token gaps are shorter than :data:`BUNCHED_GAP_S`: tokens the
    client read in one go right after the first, because it came late to the stream. The server sent
    them over a time the client did not see, so a rate from the read times leaves them out."""
    return next((i for i, gap in enumerate(gaps_s) if gap >= BUNCHED_GAP_S), len(gaps_s))


def bunched_stream_problem(gaps_s: list[float], what: str) -> str | None:
    """A problem when most of one stream's token gaps are shorter than :data:`BUNCHED_GAP_S`."""
    if len(gaps_s) < 8:
        return None
    median = sorted(gaps_s)[len(gaps_s) // 2]
    if median >= BUNCHED_GAP_S:
        return None
    return (f"{what}: tokens arrived bunched (median gap {median * 1e3:.3f} ms): the client read them "
            "late, so the stream rate is not the server's")


def summarise_load(outcomes: list[RequestOutcome], not_sent: int) -> dict[str, Any]:
    """Counts by status, throughput over the load's wall time, latency percentiles of completed requests."""
    by_status: dict[str, int] = {}
    for o in outcomes:
        by_status[o.status] = by_status.get(o.status, 0) + 1
    completed = [o for o in outcomes if o.status == COMPLETED]
    summary: dict[str, Any] = {
        "sent": len(outcomes),
        "not_sent": not_sent,
        "completed": len(completed),
        "errored": sum(n for s, n in by_status.items() if s not in (COMPLETED, TIMEOUT, INCOMPLETE)),
        "by_status": dict(sorted(by_status.items())),
    }
    if outcomes:
        wall = max(o.done_t for o in outcomes) - min(o.sent_t for o in outcomes)
        summary["wall_s"] = wall
        tokens = sum(o.completion_tokens or 0 for o in completed)
        summary["output_tokens"] = tokens
        summary["output_tok_s"] = tokens / wall if wall > 0 else None
        summary["request_s"] = len(completed) / wall if wall > 0 else None
    ttfts = [o.ttft_s for o in completed if o.ttft_s is not None]
    gaps = [g for o in completed for g in o.token_gaps_s]
    if ttfts:
        summary["ttft_p50_s"] = percentile(ttfts, 50)
        summary["ttft_p99_s"] = percentile(ttfts, 99)
    if gaps:
        summary["itl_p50_s"] = percentile(gaps, 50)
    return summary


def _figure(value: float, unit: str, better: str, source: str) -> dict[str, Any]:
    return {"value": value, "unit": unit, "better": better, "source": source}


def server_figures(label: str, summary: dict[str, Any], preemptions: Optional[float], clients: int) -> dict[str, Any]:
    """The workload's figures; a statistic without data gives no figure (the pass records why)."""
    wall = f"{clients} concurrent streaming clients, wall clock from first request sent to last finished"
    figures = {}
    if summary.get("output_tok_s") is not None:
        figures[f"{label} output"] = _figure(summary["output_tok_s"], "tok/s", "higher",
                                             f"completion tokens of completed requests / wall; {wall}")
        figures[f"{label} requests"] = _figure(summary["request_s"], "req/s", "higher",
                                               f"completed requests / wall; {wall}")
    if "ttft_p50_s" in summary:
        source = "completed requests: request sent to first streamed token"
        figures[f"{label} TTFT p50"] = _figure(summary["ttft_p50_s"] * 1000, "ms", "lower", source)
        figures[f"{label} TTFT p99"] = _figure(summary["ttft_p99_s"] * 1000, "ms", "lower", source)
    if "itl_p50_s" in summary:
        figures[f"{label} ITL p50"] = _figure(
            summary["itl_p50_s"] * 1000, "ms", "lower",
            "completed requests: gap between streamed chunks / tokens in the chunk, every token after the first")
    figures[f"{label} completed"] = _figure(summary["completed"], "requests", "higher", "requests that completed")
    figures[f"{label} errored"] = _figure(summary["errored"], "requests", "lower",
                                          "requests the server refused or failed, any HTTP status (see by_status)")
    if preemptions is not None:
        figures[f"{label} preemptions"] = _figure(
            preemptions, "count", "lower", f"server /metrics: {PREEMPTIONS_METRIC}_total after - before the workload")
    return figures
