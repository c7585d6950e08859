"""Warm a compiled CPU model up with a short dummy batch instead of a full one.

What: wraps ``vllm.v1.worker.cpu_model_runner.CPUModelRunner.warming_up_model`` so the
``profile_run`` it calls sees ``max_num_tokens`` lowered to ``WARMUP_TOKENS`` (16) for
the duration of the call; the runner's own value is restored afterwards. The number of
tokens the warm-up actually ran is kept for the worker evidence.
Why: on CPU, vLLM compiles once with the token count dynamic ("only generate graph for
the generic shape"), so the warm-up only has to trace and load the graph, but it runs a
dummy forward of ``max_num_batched_tokens`` tokens (4,096 in our grids). With a 4-bit decode kernel
(tinygemm prefills Qwen2.5-1.5B at ~40 tok/s on 2 cores) that forward is 93-108 s of
every compiled start, even when the compiled artifact loads from the cache
(``2026-12-01-decode-gap-qwen``); 8-11 s on SmolLM2-135M. Eager starts skip warm-up.
16 tokens, not 1: dynamo specialises sizes 0 and 1. A graph compiled fresh is traced at
16 tokens instead of 4,096 (the size inductor sees as its hint); the grid measures prefill
too, for that reason.
Flag: ``VLLM_OMNI_EDGE_COMPILE_WARMUP=full`` restores vLLM's full-size warm-up (the wrapper
stays, so the evidence records either size).
Verified by: tests/test_compile_warmup_tokens.py (the runner sees 16 during the call and
its own value after, also when the warm-up raises; the flag; idempotence);
a grid of the compiled arm, short vs full warm-up (start time, decode and prefill speed, the
evidence ``compile_warmup_tokens``), named in the RECORD's ``verified_by``.
Remove when: vLLM's CPU warm-up runs a small dummy batch for dynamic-shape compiles.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.worker.cpu_model_runner"
WARMUP_TOKENS = 16

RECORD = PatchRecord(
    name="compile_warmup_tokens",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.CPUModelRunner.warming_up_model",
    process=Process.WORKER,
    why="The compiled graph is dynamic in the token count, yet vLLM's CPU warm-up runs a "
    "4,096-token dummy forward: 93-108 s of each compiled Qwen-1.5B start on a 4-bit kernel.",
    verified_by="tests/test_compile_warmup_tokens.py; results/2026-12-01-compile-warmup-qwen/grid.yaml.",
    remove_when="vLLM's CPU warm-up uses a small dummy batch for dynamic-shape compiles.",
    upstream="none found",
)

# Tokens of the last warm-up in this process (None: none ran); read by vllm_omni_edge.evidence.
last_warmup_tokens: int | None = None


def apply() -> str:
    from vllm_omni_edge.levers import short_compile_warmup

    now = when_imported(TARGET_MODULE, _wrap)
    what = f"{WARMUP_TOKENS} tokens" if short_compile_warmup() else "vLLM's full size (flag)"
    return f"compiled warm-up runs {what}" + ("" if now else " (on import)")


def _wrap(module) -> None:
    def make(original):
        def warming_up_model(self, *args, **kwargs):
            from vllm_omni_edge.levers import short_compile_warmup

            global last_warmup_tokens
            if int(self.vllm_config.compilation_config.mode) == 0:  # eager: vLLM skips warm-up
                return original(self, *args, **kwargs)
            full = self.max_num_tokens
            if short_compile_warmup():
                self.max_num_tokens = min(WARMUP_TOKENS, full)
            try:
                result = original(self, *args, **kwargs)
                last_warmup_tokens = self.max_num_tokens
                return result
            finally:
                self.max_num_tokens = full

        return warming_up_model

    wrap_method_once(module.CPUModelRunner, "warming_up_model", make)
