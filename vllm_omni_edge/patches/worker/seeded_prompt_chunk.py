"""A seeded request whose prompt is read in chunks: rewind its CPU generator instead of crashing.

What: wraps ``GPUModelRunner._sample`` and ``GPUModelRunner._bookkeeping_sync`` (the CPU runner
inherits both). A step that reads part of a request's prompt samples a token for it all the same
and then discards it; for a request with a seed, vLLM rewinds that request's generator so the
discarded draw costs nothing, with ``gen.set_offset(gen.get_offset() - 4)``: the offset of CUDA's
Philox generator. A CPU generator (a Mersenne Twister) has no offset, and both calls raise
"CPU Generator does not use offset": the engine dies. Here, before the step samples, the state of
each such request's CPU generator is kept (``get_state``); in the bookkeeping it is put back
(``set_state``: the generator as if the discarded token was never drawn), and vLLM's offset
rewind finds a stand-in with nothing left to do. Generators that are not CPU ones, and steps
that discard nothing seeded, run vLLM's code untouched.
Why: the OpenAI API's ``seed`` field (which evaluation harnesses send by default) gives a request
its own generator; any prompt longer than the step's token budget, or one read beside other
requests, is chunked. On CPU that request killed the engine, and with it the server.
Verified by: tests/test_seeded_prompt_chunk.py (the generator after a discarded draw is where it
was before it, and a kept draw still advances it; on the real default model a seeded request with
a chunked prompt completes and repeats itself, where vLLM's rewind raised).
Remove when: vLLM's CPU runner rewinds CPU generators (or skips sampling discarded requests).
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.worker.gpu_model_runner"
MARKER = "__edge_seeded_prompt_chunk__"
# On the runner, between _sample and _bookkeeping_sync: {batch index: generator state}.
_SAVED_ATTR = "_edge_seeded_prompt_chunk_states"

RECORD = PatchRecord(
    name="seeded_prompt_chunk",
    kind=Kind.FIX,
    target=f"{TARGET_MODULE}.GPUModelRunner._sample, ._bookkeeping_sync",
    process=Process.WORKER,
    why="vLLM rewinds a seeded request's generator after a discarded prompt-chunk draw with "
    "set_offset, which a CPU generator refuses ('CPU Generator does not use offset'): the engine dies.",
    verified_by="tests/test_seeded_prompt_chunk.py (the rewind restores the generator; a seeded "
    "request with a chunked prompt completes on the real default model where vLLM's rewind raised).",
    remove_when="vLLM's CPU runner rewinds CPU generators or skips sampling discarded requests.",
    upstream="https://github.com/vllm-project/vllm/pull/10097",
)


class _Rewound:
    """Stands in for a generator whose state was already put back: vLLM's offset rewind is a no-op."""

    @staticmethod
    def get_offset() -> int:
        return 0

    @staticmethod
    def set_offset(offset: int) -> None:
        return None


def kept_states(generators: dict, discard, num_reqs: int) -> dict:
    """{index: state} of the CPU generators of the requests whose draw this step discards."""
    return {i: g.get_state() for i, g in generators.items()
            if i < num_reqs and discard[i] and g.device.type == "cpu"}


def _make_sample(original):
    def _sample(self, *args, **kwargs):
        generators = self.input_batch.generators
        if generators:
            saved = kept_states(generators, self.discard_request_mask.np, self.input_batch.num_reqs)
            if saved:
                self.__dict__[_SAVED_ATTR] = saved
        return original(self, *args, **kwargs)

    return _sample


def _make_bookkeeping(original):
    def _bookkeeping_sync(self, *args, **kwargs):
        saved = self.__dict__.pop(_SAVED_ATTR, None)
        if not saved:
            return original(self, *args, **kwargs)
        generators = self.input_batch.generators
        real = {}
        for i, state in saved.items():
            gen = generators.get(i)
            if gen is None:
                continue
            gen.set_state(state)
            real[i] = gen
            generators[i] = _Rewound()
        try:
            return original(self, *args, **kwargs)
        finally:
            generators.update(real)

    return _bookkeeping_sync


def _wrap(module) -> None:
    runner = module.GPUModelRunner
    wrap_method_once(runner, "_sample", _make_sample, marker=MARKER)
    wrap_method_once(runner, "_bookkeeping_sync", _make_bookkeeping, marker=MARKER)


def in_force() -> bool:
    import sys

    module = sys.modules.get(TARGET_MODULE)
    return module is not None and getattr(module.GPUModelRunner._bookkeeping_sync, MARKER, False)


def apply() -> str:
    now = when_imported(TARGET_MODULE, _wrap)
    return "seeded requests' CPU generators rewound by state after a discarded prompt-chunk draw" + (
        "" if now else " (on import)")
