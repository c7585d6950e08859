"""Fit one encoder input in a step's token budget when vLLM picks the budget itself.

What: wraps ``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`` (front end,
while the config is built). When ``max_num_batched_tokens`` was not given and the model is
an encoder-decoder one (Whisper), raises the default to the encoder's input length
(``max_source_positions``: 1500 for Whisper), with a log line saying so.
Why: vLLM caps its default at ``max_num_seqs * max_model_len``, and an encoder-decoder
model schedules its whole encoder input (not chunkable) in one step. With Whisper
(``max_model_len`` 448) and ``max_num_seqs`` 2 (our serving default; any value below 4
does it in stock vLLM too) that is 896 < 1500 and the start fails with
"Chunked MM input disabled but max_tokens_per_mm_item (1500) is larger than
max_num_batched_tokens (896)" (whisper-base).
A given ``--max-num-batched-tokens`` is left alone (vLLM's own error names it).
Verified by: tests/test_encoder_batched_tokens.py (the config vLLM builds for whisper-base's
checkpoint config, with and without the flag; a decoder-only model untouched) and
tests/e2e/test_whisper_serve.py (``vllm serve`` whisper-base starts and transcribes).
Remove when: vLLM raises its default budget to the encoder input (as it does for
multimodal prefix-LM models since 0.30) for encoder-decoder models too.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once

RECORD = PatchRecord(
    name="encoder_batched_tokens",
    kind=Kind.FIX,
    target="vllm.engine.arg_utils.EngineArgs._set_default_max_num_seqs_and_batched_tokens_args",
    process=Process.FRONTEND,
    why="Whisper with max_num_seqs 2 got a default max_num_batched_tokens of 896 (2 x 448), "
    "below its 1500-token encoder input, and refused to start.",
    verified_by="tests/test_encoder_batched_tokens.py; tests/e2e/test_whisper_serve.py.",
    remove_when="vLLM's default budget covers an encoder-decoder model's encoder input.",
    upstream="https://github.com/vllm-project/vllm/issues/17797",
)


def encoder_input_tokens(model_config) -> int | None:
    """The tokens one encoder input takes in a step, for an encoder-decoder model; else None."""
    if not getattr(model_config, "is_encoder_decoder", False):
        return None
    hf_config = model_config.hf_config
    value = getattr(hf_config, "max_source_positions", None)
    return value if isinstance(value, int) and value > 0 else None


def apply() -> str:
    from vllm.engine.arg_utils import EngineArgs

    def make_wrapper(original):
        def wrapper(self, usage_context, model_config, parallel_config, *args, **kwargs):
            given = self.max_num_batched_tokens
            result = original(self, usage_context, model_config, parallel_config, *args, **kwargs)
            need = encoder_input_tokens(model_config)
            if given is None and need is not None and self.max_num_batched_tokens < need:
                from vllm_omni_edge.log import get_logger

                get_logger("encoder_batched_tokens").info(
                    "max_num_batched_tokens %d -> %d: one encoder input (max_source_positions) "
                    "must fit in a step", self.max_num_batched_tokens, need)
                self.max_num_batched_tokens = need
            return result

        return wrapper

    name = "_set_default_max_num_seqs_and_batched_tokens_args"
    done = wrap_method_once(EngineArgs, name, make_wrapper)
    return "encoder-decoder default batch budget covers one encoder input" + ("" if done else " (already)")
