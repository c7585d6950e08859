"""Sample an all-greedy step with one argmax over the logits as they come from the head.

What: wraps ``vllm.v1.sample.sampler.Sampler.forward``. A step qualifies when every request in
the batch is greedy and nothing can move its argmax or ask for more than the token: no logprobs
(sampled or of given tokens), no allowed-token mask, no bad words, no penalties, no thinking
budget being tracked, no speculative bonus token, and each logits processor that can change a
greedy token is one of vLLM's built-in ones (logit bias, minimum tokens) with no request using it.
Such a step takes ``Sampler.greedy_sample`` of the 2-D CPU logits in their own dtype (our row-wise
argmax op where ``sampler_argmax`` is in force) and returns the ``SamplerOutput`` vLLM returns for
it: the indices as int32 ``[requests, 1]``, no logprobs. Every other step runs vLLM's ``forward``.
The indices are vLLM's: widening bfloat16 or float16 to float32 is exact and keeps every order,
so the first maximum (or first NaN) of a row is the same element before and after.
Why: for a greedy step vLLM's sampler still copies the logits to float32, walks the processors
and penalties, and converts the indices twice; on a small model's millisecond step that Python
and the copy are a visible share.
Flag: ``VLLM_OMNI_EDGE_GREEDY_SAMPLER=0`` keeps vLLM's ``forward`` for every step (the A/B arm).
Verified by: tests/test_greedy_sampler.py (against vLLM's own ``Sampler.forward`` on bfloat16,
float16 and float32 logits with ties, NaN and infinities; each condition that must keep vLLM's
path; idempotent; the greedy tokens of the default model equal with the flag on and off);
``step_ab --levers greedy_sampler`` (docs/edge/harness.md).
Remove when: vLLM's sampler takes an all-greedy batch without the float32 copy and processor walk.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.sample.sampler"
MARKER = "__edge_greedy_sampler__"

RECORD = PatchRecord(
    name="greedy_sampler",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.Sampler.forward",
    process=Process.WORKER,
    why="An all-greedy step needs one argmax, and vLLM's sampler first copies the logits to float32 "
    "and walks its processors and penalties in Python: a visible share of a small model's step.",
    verified_by="tests/test_greedy_sampler.py (against vLLM's Sampler.forward over dtypes, ties, NaN; every "
    "condition that keeps vLLM's path; greedy tokens equal on and off); `step_ab --levers greedy_sampler`.",
    remove_when="vLLM's sampler takes an all-greedy batch without the float32 copy and processor walk.",
    upstream="none found",
)

# How many steps took the one-argmax path in this process (for the evidence record).
taken = {"steps": 0}


def _inactive(processor) -> bool:
    """Whether a logits processor that can change a greedy token changes nothing this step: one of
    vLLM's built-in ones with no request using it (any other processor is assumed active)."""
    from vllm.v1.sample.logits_processor import builtin

    if type(processor) is builtin.LogitBiasLogitsProcessor:
        return not processor.biases
    if type(processor) is builtin.MinTokensLogitsProcessor:
        return not processor.min_toks
    return False


def qualifies(logits, metadata, predict_bonus_token: bool) -> bool:
    """Whether vLLM's ``forward`` would return exactly the argmax of ``logits`` and no logprobs."""
    import torch

    if predict_bonus_token or not metadata.all_greedy:
        return False
    if metadata.max_num_logprobs is not None or metadata.logprob_token_ids:
        return False
    if metadata.allowed_token_ids_mask is not None or metadata.bad_words_token_ids or not metadata.no_penalties:
        return False
    holder = metadata.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        return False
    if not all(_inactive(p) for p in metadata.logitsprocs.non_argmax_invariant):
        return False
    return (logits.dim() == 2 and logits.shape[-1] > 0 and logits.device.type == "cpu"
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16))


def _make(original):
    import torch

    from vllm.v1.outputs import SamplerOutput

    def forward(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
        if qualifies(logits, sampling_metadata, predict_bonus_token):
            taken["steps"] += 1
            sampled = self.greedy_sample(logits).to(torch.int32).unsqueeze(-1)
            return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None)
        return original(self, logits, sampling_metadata, predict_bonus_token, logprobs_mode_override)

    return forward


def _wrap(module) -> None:
    wrap_method_once(module.Sampler, "forward", _make, marker=MARKER)


def in_force() -> bool:
    import sys

    module = sys.modules.get(TARGET_MODULE)
    return module is not None and getattr(module.Sampler.forward, MARKER, False)


def apply() -> str:
    from vllm_omni_edge.levers import greedy_sampler_enabled

    if not greedy_sampler_enabled():
        return "vLLM's sampler for every step (flag)"
    now = when_imported(TARGET_MODULE, _wrap)
    return "all-greedy steps sampled by one argmax of the logits" + ("" if now else " (on import)")
