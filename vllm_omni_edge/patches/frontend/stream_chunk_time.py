"""A streamed request's tokens go out at most every few milliseconds, not after every step.

What: wraps ``RequestState.make_request_output`` (``vllm.v1.engine.output_processor``), which
turns one engine step's tokens for a request into the ``RequestOutput`` that the API server
streams as one chunk. For a streamed request (output kind DELTA, detokenized, one sequence,
no streaming input) when neither the server's ``--stream-interval`` nor the request asks for
more than one token a chunk: a step whose tokens come less than ``VLLM_OMNI_EDGE_STREAM_CHUNK_MS``
after the request's last chunk was sent is held, and its tokens go out with the next chunk.
The first chunk, the last (the request finished, stopped or was aborted) and any step that
comes that long after the last chunk go at once, carrying every token held since. Text,
token ids and logprobs of a chunk are vLLM's own for those tokens (its detokenizer's text
since the last chunk, the last n logprobs), as vLLM does for ``--stream-interval``. Below
1000 / ms tokens a second every token is its own chunk, as before; above, chunks are that
far apart.
Why: every chunk costs the API server's event loop (detokenized text, the SSE chunk, the
write) and the client reading the stream; on a box whose cores the model's OpenMP team
fills, that CPU is taken from the decode (the harness's served-decode CPU split measures it;
docs/edge/what-changes.md names the runs). vLLM's ``--stream-interval N`` counts tokens, so
at a slow model's twenty tokens a second its chunks would be visible; a time bound keeps
every chunk of a slow model a single token.
Flag: ``VLLM_OMNI_EDGE_STREAM_CHUNK_MS`` (default 25; 0 streams every step, vLLM's way).
``vllm serve --stream-interval N`` (any N) sets it to 0 (``cli/serving_defaults.py``).
Verified by: tests/test_stream_chunk_time.py (a real OutputProcessor over a fake clock: held
steps' tokens, text and logprobs arrive whole in the next chunk; first, finished and aborted
go at once; slow steps are single-token chunks; DELTA only; n > 1, stream_interval > 1 and
the flag at 0 untouched; idempotent); grids/serve-stream-chunk-default.yaml.
Remove when: vLLM paces streamed chunks by time.
"""

from __future__ import annotations

import time

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.engine.output_processor"
LAST_SENT = "_edge_last_chunk_t"  # RequestState attribute: monotonic time its last chunk was made

RECORD = PatchRecord(
    name="stream_chunk_time",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.RequestState.make_request_output",
    process=Process.FRONTEND,  # the output processor runs in the API server / LLM() process
    why="Each streamed chunk costs the event loop and the client CPU that, on a box the model's "
    "OpenMP team fills, comes out of the decode; chunks paced by time stay single tokens for a "
    "slow model.",
    verified_by="tests/test_stream_chunk_time.py; grids/serve-stream-chunk-default.yaml.",
    remove_when="vLLM paces streamed chunks by time.",
    upstream="none found",
)

# Chunks at least this many seconds apart (0: off); read at apply().
chunk_s: float = 0.0
clock = time.monotonic  # tests put a fake clock here

# Chunks sent and steps held in this process (record(); the tests read it).
counts = {"chunks": 0, "held_steps": 0}


def record() -> dict[str, int]:
    return dict(counts)


def paced(state) -> bool:
    """Whether this request's chunks are paced by time (see the module docstring)."""
    from vllm.sampling_params import RequestOutputKind  # imported by then: the caller is vLLM's

    return (chunk_s > 0 and state.stream_interval == 1 and state.output_kind is RequestOutputKind.DELTA
            and state.detokenizer is not None and state.parent_req is None
            and not getattr(state, "streaming_input", False))


def wrap_make_request_output(original):
    def make_request_output(self, new_token_ids, pooling_output, finish_reason, stop_reason, *args, **kwargs):
        if pooling_output is not None or not paced(self):
            return original(self, new_token_ids, pooling_output, finish_reason, stop_reason, *args, **kwargs)
        now = clock()
        last = getattr(self, LAST_SENT, None)
        if finish_reason is None and last is not None and now - last < chunk_s:
            counts["held_steps"] += 1
            return None  # these tokens go with the next chunk
        detokenizer = self.detokenizer
        if detokenizer.num_output_tokens() - self.sent_tokens_offset > len(new_token_ids):
            # The held steps' tokens, then this step's (sliced only then: the slow detokenizer's
            # output_token_ids copies every token of the request).
            new_token_ids = list(detokenizer.output_token_ids[self.sent_tokens_offset:])
        output = original(self, new_token_ids, pooling_output, finish_reason, stop_reason, *args, **kwargs)
        # vLLM keeps this offset only for --stream-interval; with one token a chunk it is ours.
        self.sent_tokens_offset = detokenizer.num_output_tokens()
        setattr(self, LAST_SENT, now)
        counts["chunks"] += 1
        return output

    return make_request_output


def _wrap(module) -> None:
    wrap_method_once(module.RequestState, "make_request_output", wrap_make_request_output)


def apply() -> str:
    from vllm_omni_edge.levers import stream_chunk_s

    global chunk_s
    chunk_s = stream_chunk_s()
    if chunk_s <= 0:
        return "VLLM_OMNI_EDGE_STREAM_CHUNK_MS=0: every step's tokens are streamed, as vLLM does"
    now = when_imported(TARGET_MODULE, _wrap)  # wrapped when vLLM imports it, not imported here
    return (f"streamed chunks at least {chunk_s * 1000:g} ms apart (held tokens go with the next)"
            + ("" if now else " (on import)"))
