"""Prepare a steady decode step's inputs for the decoder stack straight from the persistent batch.

What: wraps ``GPUModelRunner.execute_model`` (the CPU runner inherits it). A step qualifies when
the runner's model runs on our decoder stack (``decoder_stack``) and the scheduler's output only
moves the requests already in the batch on by one token each: no new, finished, resumed or
preempted request, no speculative, encoder or KV-connector work, the batch's requests exactly the
scheduled ones. Such a step still goes through vLLM's ``_update_states`` (block ids, computed
tokens, KV block zeroing and copies, sampling metadata), and then, in place of
``_prepare_inputs``, the padding and micro-batch decision, the attention metadata builders and
the forward context, it reads each request's position (its computed tokens), token (the batch's
token ids at that position) and KV slot (the block table at that position) from the batch, writes
them into the runner's own input, position, sequence-length and slot-mapping buffers and calls the
stack and the model's ``compute_logits`` on them. What ``sample_tokens`` reads is set as vLLM's step
sets it (``execute_model_state``, the discard mask for a request still inside its prompt), so
sampling, bookkeeping and the engine above are vLLM's. Every other step, and every runner whose
model or configuration the stack or this path does not cover, runs vLLM's ``execute_model``.
Why: on a small model a decode step's kernels are a few milliseconds and vLLM's generic input
preparation (per-step numpy and torch calls for positions, slot mappings, metadata objects for
each attention group, CPU attention scheduling metadata the stack never reads) a large share of
the rest, all of it Python. The values it computes for a one-token query are three reads of
the batch.
Flag: ``VLLM_OMNI_EDGE_STACK_STEP_INPUTS=0`` keeps vLLM's ``execute_model`` for every step (the A/B
arm); only with the decoder stack (``VLLM_OMNI_EDGE_DECODER_STACK``).
Verified by: tests/test_stack_step_inputs.py (which steps and configurations qualify; the values
written, one by one and as arrays; on the real default model, two fresh engines with the flag on and
off: four requests through two sequence slots, one seeded, prompts read one token a step beside a
decoding request, and step by step the stack receives the same embeddings, positions, KV slots, block
rows and sequence lengths, and the same tokens come out); the user-command grids against
``VLLM_OMNI_EDGE_STACK_STEP_INPUTS=0``.
Remove when: vLLM prepares a CPU decode step's inputs without per-step Python over generic
metadata builders (a C++ or incremental input preparation for CPU).
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.worker.gpu_model_runner"
MARKER = "__edge_stack_step_inputs__"

RECORD = PatchRecord(
    name="stack_step_inputs",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.GPUModelRunner.execute_model",
    process=Process.WORKER,
    why="A steady decode step on the decoder stack needs each request's position, token and KV slot; "
    "vLLM's generic input preparation and metadata builders spend a large share of a small model's "
    "step computing them in Python.",
    verified_by="tests/test_stack_step_inputs.py (qualifying steps; the stack's inputs step by step and "
    "the tokens, greedy and seeded, equal to vLLM's preparation with requests joining, finishing and "
    "read one token a step); the user-command grids against VLLM_OMNI_EDGE_STACK_STEP_INPUTS=0.",
    remove_when="vLLM prepares a CPU decode step's inputs without per-step Python over generic "
    "metadata builders.",
    upstream="none found",
)

# On the runner: (the Stack it was judged with, None or why this path cannot run it).
_STATE_ATTR = "_edge_stack_step_inputs"
# On the runner: how many steps took this path.
_STEPS_ATTR = "_edge_stack_step_inputs_steps"
# Called with summary() when a runner takes this path for the first time (the evidence recorder
# registers one when the harness asks for evidence: the worker's record is written before decode).
listeners: list = []


def runner_blocker(runner) -> str | None:
    """Why ``runner``'s configuration keeps vLLM's preparation for every step; None if it need not."""
    from vllm.distributed.parallel_state import get_pp_group

    checks = (
        (getattr(runner, "speculative_config", None) is not None, "speculative decoding"),
        (getattr(runner, "use_async_scheduling", False), "async scheduling"),
        (getattr(runner, "enable_prompt_embeds", False), "prompt embeddings"),
        (getattr(runner, "uses_mrope", False) or getattr(runner, "uses_xdrope_dim", 0), "multimodal rotary positions"),
        (getattr(runner, "is_pooling_model", False), "a pooling model"),
        (getattr(runner, "lora_config", None) is not None, "LoRA"),
        (getattr(runner, "eplb_state", None) is not None, "expert load balancing"),
        (getattr(runner, "use_aux_hidden_state_outputs", False), "auxiliary hidden states"),
        (getattr(runner, "broadcast_pp_output", False), "pipeline output broadcast"),
        (getattr(runner, "routed_experts_initialized", False), "routed experts capture"),
        (runner.model_config.is_encoder_decoder, "an encoder-decoder model"),
        (runner.parallel_config.data_parallel_size != 1, "data parallel"),
        (get_pp_group().world_size != 1, "pipeline parallel"),
        (runner.cache_config.kv_sharing_fast_prefill, "KV sharing fast prefill"),
        (len(runner.input_batch.block_table.block_tables) != 1, "more than one KV cache group"),
    )
    for blocked, why in checks:
        if blocked:
            return why
    from vllm.v1.worker.block_table import SlotMappingMode

    table = runner.input_batch.block_table.block_tables[0]
    if (table.slot_mapping_mode != SlotMappingMode.TOKEN_TO_KV_SLOT or table.blocks_per_kv_block != 1
            or table.dcp_world_size != 1):
        return "a block table with kernel blocks, context parallel or no slot mapping"
    return None


def _stack_and_blocker(runner):
    """(the Stack, None) when this path may run the runner's steady steps; (None, why) otherwise."""
    from vllm_omni_edge.patches.worker import decoder_stack

    if not decoder_stack.in_force():
        # The stack's forward was taken away (a tool measuring vLLM's compiled forward): every
        # step goes to that forward, prepared by vLLM.
        return None, "the decoder stack is not in force"
    stack = decoder_stack._current(runner)
    if stack is None:
        return None, "the decoder stack does not run this model"
    state = runner.__dict__.get(_STATE_ATTR)
    if state is None or state[0] is not stack:
        state = (stack, runner_blocker(runner))
        runner.__dict__[_STATE_ATTR] = state
    return (stack, None) if state[1] is None else (None, state[1])


def steady_step(runner, scheduler_output) -> bool:
    """Whether ``scheduler_output`` only moves the batch's own requests on by one token each."""
    so = scheduler_output
    scheduled = so.num_scheduled_tokens
    cached = so.scheduled_cached_reqs
    if (so.scheduled_new_reqs or so.finished_req_ids or so.preempted_req_ids or cached.resumed_req_ids
            or so.scheduled_spec_decode_tokens or so.scheduled_encoder_inputs or so.free_encoder_mm_hashes
            or so.kv_connector_metadata is not None or so.ec_connector_metadata is not None
            or so.block_table_updates or not scheduled or so.total_num_scheduled_tokens != len(scheduled)):
        return False
    if _VLLM.has_kv_transfer_group() or _VLLM.has_ec_transfer():
        return False
    batch = runner.input_batch
    return batch.num_reqs == len(scheduled) and all(r in scheduled for r in batch.req_ids)


# Up to this many requests a step's inputs are written one by one (cheaper than array calls).
_SCALAR_ROWS = 8


def _write_inputs(runner, table, n):
    """Writes the step's token ids, positions, sequence lengths, KV slots and discard mask into the
    runner's buffers, from the batch after ``_update_states``."""
    batch = runner.input_batch
    size = table.block_size
    computed = batch.num_computed_tokens_cpu
    tokens = batch.token_ids_cpu
    blocks = table.block_table.np
    ids, positions, seq_lens = runner.input_ids.np, runner.positions.numpy(), runner.seq_lens.numpy()
    slots, discard = table.slot_mapping.np, runner.discard_request_mask.np
    requests = runner.requests
    if n <= _SCALAR_ROWS:
        for i, req_id in enumerate(batch.req_ids):
            pos = int(computed[i])
            ids[i] = tokens[i, pos]
            positions[i] = pos
            seq_lens[i] = pos + 1
            slots[i] = int(blocks[i, pos // size]) * size + pos % size
            # A request whose prompt is still being read (a one-token chunk) is not sampled.
            discard[i] = pos + 1 < requests[req_id].num_tokens
        return
    import numpy as np

    pos = computed[:n].astype(np.int64)
    rows = np.arange(n)
    ids[:n] = tokens[rows, pos]
    positions[:n] = pos
    seq_lens[:n] = pos + 1
    slots[:n] = blocks[rows, pos // size] * size + pos % size
    known = np.fromiter((requests[r].num_tokens for r in batch.req_ids), dtype=np.int64, count=n)
    discard[:n] = pos + 1 < known


def _run(runner, stack, scheduler_output):
    """The step's forward and logits from the batch's own state; sets what ``sample_tokens`` reads."""
    with runner.synchronize_input_prep():
        deferred = runner._update_states(scheduler_output)
    n = runner.input_batch.num_reqs
    table = runner.input_batch.block_table.block_tables[0]
    _write_inputs(runner, table, n)
    stack.steps += 1
    hidden = stack.op.forward(stack.embed(runner.input_ids.cpu[:n]), runner.positions[:n],
                              table.slot_mapping.cpu[:n], table.block_table.cpu[:n], runner.seq_lens[:n])
    logits = runner.model.compute_logits(hidden)
    runner.execute_model_state = _VLLM.ExecuteModelState(scheduler_output, logits, None, None, hidden, hidden,
                                                         None, None, None, None)
    runner.kv_connector_output = None
    steps = runner.__dict__[_STEPS_ATTR] = runner.__dict__.get(_STEPS_ATTR, 0) + 1
    if steps == 1:
        for listener in listeners:
            listener(summary(runner))
    if deferred:
        deferred()


class _Vllm:
    """vLLM's names this path calls each step, imported once when the patch is applied."""

    def load(self) -> None:
        from vllm.distributed.ec_transfer import has_ec_transfer
        from vllm.distributed.kv_transfer import has_kv_transfer_group
        from vllm.v1.worker.gpu_model_runner import ExecuteModelState

        self.has_ec_transfer, self.has_kv_transfer_group = has_ec_transfer, has_kv_transfer_group
        self.ExecuteModelState = ExecuteModelState


_VLLM = _Vllm()


def _make(original):
    import torch

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        if intermediate_tensors is None and self.execute_model_state is None and steady_step(self, scheduler_output):
            stack, _ = _stack_and_blocker(self)
            if stack is not None:
                with torch.inference_mode():
                    _run(self, stack, scheduler_output)
                return None
        return original(self, scheduler_output, intermediate_tensors)

    return execute_model


def _wrap(module) -> None:
    _VLLM.load()
    wrap_method_once(module.GPUModelRunner, "execute_model", _make, marker=MARKER)


def in_force() -> bool:
    import sys

    module = sys.modules.get(TARGET_MODULE)
    return module is not None and getattr(module.GPUModelRunner.execute_model, MARKER, False)


def summary(runner) -> dict:
    """For the evidence record: whether steady steps take this path, how many did, or why not."""
    if not in_force():
        return {"on": False, "reason": "not applied"}
    stack, why = _stack_and_blocker(runner)
    if stack is None:
        return {"on": False, "reason": why}
    return {"on": True, "steps": runner.__dict__.get(_STEPS_ATTR, 0)}


def apply() -> str:
    from vllm_omni_edge.levers import stack_step_inputs_enabled

    if not stack_step_inputs_enabled():
        return "vLLM's input preparation for every step (flag or decoder stack off)"
    now = when_imported(TARGET_MODULE, _wrap)
    return "steady decode steps on the decoder stack prepared from the batch" + ("" if now else " (on import)")
