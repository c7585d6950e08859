"""stream_chunk_time: a streamed request's tokens go out at most every N ms; held steps' tokens,
text and logprobs arrive whole in the next chunk. Driven through vLLM's own OutputProcessor."""

from __future__ import annotations

import pytest

from vllm_omni_edge.patches.frontend import stream_chunk_time as patch

WORDS = ["[UNK]", "hello", "edge", "box", "tokens", "stream", "slow", "fast", "chunk", "end"]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def paced(monkeypatch):
    """The patch on vLLM's RequestState (restored afterwards), 25 ms, a clock the test moves."""
    from vllm.v1.engine import output_processor

    state_cls = output_processor.RequestState
    monkeypatch.setattr(state_cls, "make_request_output", state_cls.make_request_output)
    patch._wrap(output_processor)
    patch._wrap(output_processor)  # idempotent: one wrapper
    assert not getattr(state_cls.make_request_output.__wrapped__, "__edge_wrapped__", False)
    clock = Clock()
    monkeypatch.setattr(patch, "clock", clock)
    monkeypatch.setattr(patch, "chunk_s", 0.025)
    monkeypatch.setattr(patch, "counts", {"chunks": 0, "held_steps": 0})
    return clock


def _run(steps_ms: list[float], clock: Clock | None, *, kind="DELTA", stream_interval=1,
         logprobs=None, tokens=None):
    """One request through an OutputProcessor, one token a step, ``steps_ms`` apart; the outputs."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor

    tokenizer = _tokenizer()
    params = SamplingParams(max_tokens=len(steps_ms), output_kind=getattr(RequestOutputKind, kind),
                            logprobs=logprobs, detokenize=True)
    processor = OutputProcessor(tokenizer, log_stats=False, stream_interval=stream_interval)
    request = EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2], mm_features=None, sampling_params=params,
                                pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None,
                                data_parallel_rank=None, external_req_id="r")
    processor.add_request(request, prompt="hello edge")
    tokens = tokens or [3 + i % 7 for i in range(len(steps_ms))]
    outputs = []
    for i, (ms, token) in enumerate(zip(steps_ms, tokens)):
        if clock is not None:
            clock.t += ms / 1000
        last = i == len(steps_ms) - 1
        new_logprobs = None
        if logprobs is not None:
            from vllm.v1.outputs import LogprobsLists
            import numpy as np

            new_logprobs = LogprobsLists(np.array([[token]]), np.array([[-0.5 - i]], dtype=np.float32),
                                         np.array([0]))
        core = EngineCoreOutput(request_id="r", new_token_ids=[token], new_logprobs=new_logprobs,
                                finish_reason=FinishReason.LENGTH if last else None)
        outputs += processor.process_outputs([core]).request_outputs
    return outputs, tokens


def _vllms(steps_ms, **kwargs):
    """The same request with the patch standing down (flag 0): vLLM's own outputs."""
    saved, patch.chunk_s = patch.chunk_s, 0.0
    try:
        return _run(steps_ms, None, **kwargs)[0]
    finally:
        patch.chunk_s = saved


def _joined(outputs):
    ids = [t for o in outputs for t in o.outputs[0].token_ids]
    text = "".join(o.outputs[0].text for o in outputs)
    return ids, text


def test_fast_steps_are_held_and_arrive_whole_in_the_next_chunk(paced):
    steps = [10.0] * 12  # 100 tok/s: chunks every third step
    outputs, tokens = _run(steps, paced)
    reference = _vllms(steps)
    assert [o.outputs[0].token_ids for o in reference] == [[t] for t in tokens]  # a chunk per step
    assert len(outputs) < len(steps)
    assert _joined(outputs) == _joined(reference)  # the same tokens and text, in fewer chunks
    assert len(outputs[0].outputs[0].token_ids) == 1  # the first token at once
    assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
    # Chunks after the first are 30 ms apart: three one-token steps each.
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 3, 3, 3, 2]
    assert patch.record() == {"chunks": 5, "held_steps": 7}


def test_slow_steps_are_single_token_chunks(paced):
    outputs, tokens = _run([40.0] * 6, paced)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1] * 6
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in _vllms([40.0] * 6)]
    assert patch.record()["held_steps"] == 0


def test_logprobs_follow_their_tokens(paced):
    outputs, tokens = _run([10.0] * 7, paced, logprobs=0)
    assert len(outputs) < 7
    for o in outputs:
        out = o.outputs[0]
        assert len(out.logprobs) == len(out.token_ids)
        assert [next(iter(lp)) for lp in out.logprobs] == out.token_ids
    assert [t for o in outputs for t in o.outputs[0].token_ids] == tokens


def test_an_abort_carries_the_held_tokens(paced):
    from vllm.v1.engine import FinishReason
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.engine.output_processor import RequestOutputCollector

    processor = OutputProcessor(_tokenizer(), log_stats=False, stream_interval=1)
    params = SamplingParams(max_tokens=10, output_kind=RequestOutputKind.DELTA)
    request = EngineCoreRequest(request_id="a", prompt_token_ids=[1], mm_features=None, sampling_params=params,
                                pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None,
                                data_parallel_rank=None, external_req_id="a")
    queue = RequestOutputCollector(RequestOutputKind.DELTA, "a")
    processor.add_request(request, prompt="hello", queue=queue)
    for token in (3, 4, 5):
        paced.t += 0.005
        processor.process_outputs([EngineCoreOutput(request_id="a", new_token_ids=[token])])
    first = queue.get_nowait()  # the first chunk; the next two steps came within 25 ms: held
    assert first.outputs[0].token_ids == [3]
    assert queue.get_nowait() is None  # 4 and 5 are held
    processor.abort_requests(["a"], internal=True)
    aborted = queue.get_nowait()
    assert aborted.finished and aborted.outputs[0].token_ids == [4, 5]
    assert aborted.outputs[0].finish_reason == str(FinishReason.ABORT)


@pytest.mark.parametrize("kind,stream_interval", [("CUMULATIVE", 1), ("DELTA", 2), ("FINAL_ONLY", 1)])
def test_other_requests_are_vllms(paced, kind, stream_interval):
    """Cumulative and final-only outputs, and a --stream-interval server, are left to vLLM."""
    outputs, tokens = _run([10.0] * 6, paced, kind=kind, stream_interval=stream_interval)
    assert patch.record() == {"chunks": 0, "held_steps": 0}
    if kind == "CUMULATIVE":
        assert len(outputs) == 6 and outputs[-1].outputs[0].token_ids == tokens
    elif kind == "FINAL_ONLY":
        assert len(outputs) == 1
    else:
        assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 2, 1]


def test_only_one_sequence_detokenized_delta_streams_are_paced(monkeypatch):
    """n > 1 (a parent request), streaming input, no detokenizer, or a token interval: vLLM's."""
    from types import SimpleNamespace

    from vllm.sampling_params import RequestOutputKind

    monkeypatch.setattr(patch, "chunk_s", 0.025)
    plain = dict(stream_interval=1, output_kind=RequestOutputKind.DELTA, detokenizer=object(), parent_req=None,
                 streaming_input=False)
    assert patch.paced(SimpleNamespace(**plain))
    for change in ({"parent_req": object()}, {"streaming_input": True}, {"detokenizer": None},
                   {"stream_interval": 2}, {"output_kind": RequestOutputKind.CUMULATIVE}):
        assert not patch.paced(SimpleNamespace(**{**plain, **change})), change
    monkeypatch.setattr(patch, "chunk_s", 0.0)
    assert not patch.paced(SimpleNamespace(**plain))
