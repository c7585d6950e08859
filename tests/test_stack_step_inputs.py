"""A steady decode step on the decoder stack takes its inputs straight from the batch: only such
steps, with the values vLLM's preparation gives, and the same tokens out."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from tests.e2e.probe import run_script_probe
from vllm_omni_edge.patches.worker import stack_step_inputs as patch


def _scheduler_output(scheduled, **changes):
    cached = types.SimpleNamespace(resumed_req_ids=changes.pop("resumed", set()))
    fields = dict(scheduled_new_reqs=[], finished_req_ids=set(), preempted_req_ids=None,
                  scheduled_cached_reqs=cached, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                  free_encoder_mm_hashes=[], kv_connector_metadata=None, ec_connector_metadata=None,
                  block_table_updates=None, num_scheduled_tokens=dict(scheduled),
                  total_num_scheduled_tokens=sum(scheduled.values()))
    fields.update(changes)
    return types.SimpleNamespace(**fields)


def _runner(req_ids):
    return types.SimpleNamespace(input_batch=types.SimpleNamespace(req_ids=list(req_ids), num_reqs=len(req_ids)))


@pytest.fixture
def no_transfer(monkeypatch):
    monkeypatch.setattr(patch._VLLM, "has_kv_transfer_group", lambda: False, raising=False)
    monkeypatch.setattr(patch._VLLM, "has_ec_transfer", lambda: False, raising=False)


@pytest.mark.parametrize("case,scheduled,changes,expected", [
    ("the batch moved on by one token each", {"a": 1, "b": 1}, {}, True),
    ("a request joins", {"a": 1, "b": 1}, {"scheduled_new_reqs": ["c"]}, False),
    ("a request finished", {"a": 1, "b": 1}, {"finished_req_ids": {"c"}}, False),
    ("a request resumed", {"a": 1, "b": 1}, {"resumed": {"a"}}, False),
    ("a request was preempted", {"a": 1, "b": 1}, {"preempted_req_ids": {"c"}}, False),
    ("a prompt chunk of two tokens", {"a": 2, "b": 1}, {}, False),
    ("speculative tokens", {"a": 1, "b": 1}, {"scheduled_spec_decode_tokens": {"a": [5]}}, False),
    ("encoder inputs", {"a": 1, "b": 1}, {"scheduled_encoder_inputs": {"a": [0]}}, False),
    ("KV connector work", {"a": 1, "b": 1}, {"kv_connector_metadata": object()}, False),
    ("a request of the batch not scheduled", {"a": 1}, {}, False),
    ("nothing scheduled", {}, {}, False),
])
def test_only_steps_that_move_the_batch_on_by_one_token_qualify(no_transfer, case, scheduled, changes, expected):
    batch = ["a", "b"] if case != "nothing scheduled" else []
    assert patch.steady_step(_runner(batch), _scheduler_output(scheduled, **changes)) is expected, case


def test_a_kv_transfer_keeps_vllms_preparation(monkeypatch):
    monkeypatch.setattr(patch._VLLM, "has_kv_transfer_group", lambda: True, raising=False)
    monkeypatch.setattr(patch._VLLM, "has_ec_transfer", lambda: False, raising=False)
    assert not patch.steady_step(_runner(["a"]), _scheduler_output({"a": 1}))


class _Buffer:
    def __init__(self, n, dtype):
        self.cpu = torch.full((n,), -7, dtype=dtype)
        self.np = self.cpu.numpy()


def _batch_runner(n, block_size=4, blocks_per_req=8, in_prompt=()):
    """A runner whose batch holds ``n`` requests at different lengths, the ones in ``in_prompt``
    still inside their prompt."""
    rng = np.random.default_rng(n)
    computed = rng.integers(0, block_size * blocks_per_req - 1, size=n).astype(np.int32)
    tokens = rng.integers(0, 50000, size=(n, block_size * blocks_per_req)).astype(np.int32)
    blocks = torch.from_numpy(rng.permutation(1000)[: n * blocks_per_req].reshape(n, blocks_per_req).astype(np.int32))
    req_ids = [f"r{i}" for i in range(n)]
    requests = {r: types.SimpleNamespace(num_tokens=int(computed[i]) + 1 + (3 if r in in_prompt else 0))
                for i, r in enumerate(req_ids)}
    table = types.SimpleNamespace(block_size=block_size, block_table=types.SimpleNamespace(cpu=blocks, np=blocks.numpy()),
                                  slot_mapping=_Buffer(64, torch.int64))
    batch = types.SimpleNamespace(req_ids=req_ids, num_reqs=n, num_computed_tokens_cpu=computed,
                                  token_ids_cpu=tokens)
    runner = types.SimpleNamespace(input_batch=batch, requests=requests, input_ids=_Buffer(64, torch.int32),
                                   positions=torch.full((64,), -7, dtype=torch.int64),
                                   seq_lens=torch.full((64,), -7, dtype=torch.int32),
                                   discard_request_mask=_Buffer(64, torch.bool))
    return runner, table


@pytest.mark.parametrize("n", [1, 3, patch._SCALAR_ROWS, patch._SCALAR_ROWS + 5])
def test_the_inputs_are_each_requests_token_position_slot_and_length(n):
    runner, table = _batch_runner(n, in_prompt={"r0"})
    patch._write_inputs(runner, table, n)
    batch = runner.input_batch
    for i in range(n):
        pos = int(batch.num_computed_tokens_cpu[i])
        assert runner.input_ids.cpu[i] == batch.token_ids_cpu[i, pos]
        assert runner.positions[i] == pos and runner.seq_lens[i] == pos + 1
        block = int(table.block_table.np[i, pos // table.block_size])
        assert table.slot_mapping.cpu[i] == block * table.block_size + pos % table.block_size
        # r0 is still reading its prompt: its sampled token is discarded, as vLLM's step does.
        assert bool(runner.discard_request_mask.np[i]) is (i == 0)
    # Nothing past the batch is written.
    assert runner.input_ids.cpu[n] == -7 and runner.positions[n] == -7 and table.slot_mapping.cpu[n] == -7


def test_the_scalar_and_array_writes_agree():
    n = patch._SCALAR_ROWS
    runner, table = _batch_runner(n, in_prompt={"r1", "r4"})
    patch._write_inputs(runner, table, n)
    scalar = [t.clone() for t in (runner.input_ids.cpu, runner.positions, runner.seq_lens, table.slot_mapping.cpu,
                                  runner.discard_request_mask.cpu)]
    runner, table = _batch_runner(n, in_prompt={"r1", "r4"})
    original = patch._SCALAR_ROWS
    try:
        patch._SCALAR_ROWS = 0
        patch._write_inputs(runner, table, n)
    finally:
        patch._SCALAR_ROWS = original
    array = (runner.input_ids.cpu, runner.positions, runner.seq_lens, table.slot_mapping.cpu,
             runner.discard_request_mask.cpu)
    for a, b in zip(scalar, array):
        assert torch.equal(a, b)


def test_configurations_it_does_not_cover_keep_vllms_preparation():
    from vllm.v1.worker.block_table import SlotMappingMode

    table = types.SimpleNamespace(slot_mapping_mode=SlotMappingMode.TOKEN_TO_KV_SLOT, blocks_per_kv_block=1,
                                  dcp_world_size=1)

    def runner(**attrs):
        base = dict(model_config=types.SimpleNamespace(is_encoder_decoder=False),
                    parallel_config=types.SimpleNamespace(data_parallel_size=1),
                    cache_config=types.SimpleNamespace(kv_sharing_fast_prefill=False),
                    input_batch=types.SimpleNamespace(block_table=types.SimpleNamespace(block_tables=[table])))
        return types.SimpleNamespace(**{**base, **attrs})

    pp = types.SimpleNamespace(world_size=1)
    import vllm.distributed.parallel_state as ps

    original = ps.get_pp_group
    ps.get_pp_group = lambda: pp
    try:
        assert patch.runner_blocker(runner()) is None
        assert patch.runner_blocker(runner(speculative_config=object())) == "speculative decoding"
        assert patch.runner_blocker(runner(lora_config=object())) == "LoRA"
        assert patch.runner_blocker(runner(use_async_scheduling=True)) == "async scheduling"
        assert patch.runner_blocker(runner(parallel_config=types.SimpleNamespace(data_parallel_size=2))) == "data parallel"
        two_groups = types.SimpleNamespace(block_table=types.SimpleNamespace(block_tables=[table, table]))
        assert patch.runner_blocker(runner(input_batch=two_groups)) == "more than one KV cache group"
        kernel_blocks = types.SimpleNamespace(block_table=types.SimpleNamespace(block_tables=[
            types.SimpleNamespace(slot_mapping_mode=SlotMappingMode.TOKEN_TO_KV_SLOT, blocks_per_kv_block=2,
                                  dcp_world_size=1)]))
        assert "kernel blocks" in patch.runner_blocker(runner(input_batch=kernel_blocks))
        pp.world_size = 2
        assert patch.runner_blocker(runner()) == "pipeline parallel"
    finally:
        ps.get_pp_group = original


def test_wrapped_once():
    module = types.ModuleType("fake_runner_module")

    class GPUModelRunner:
        def execute_model(self, scheduler_output, intermediate_tensors=None):
            return "vllm"

    module.GPUModelRunner = GPUModelRunner
    patch._wrap(module)
    first = GPUModelRunner.execute_model
    patch._wrap(module)
    assert GPUModelRunner.execute_model is first and getattr(first, patch.MARKER)


def test_flag_keeps_vllms_preparation(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_STACK_STEP_INPUTS", "0")
    assert "flag" in patch.apply()
    monkeypatch.setenv("VLLM_OMNI_EDGE_STACK_STEP_INPUTS", "1")
    monkeypatch.setenv("VLLM_OMNI_EDGE_DECODER_STACK", "0")
    assert "flag" in patch.apply()


# Four requests through two sequence slots (the third and fourth join as the first two finish),
# one of them sampled with a seed, and a batched-token budget of two so that prompts are read one
# token a step beside a decoding request. Every call of the stack is recorded.
PROBE = (
    "import json, sys\n"
    "from vllm import LLM, SamplingParams\n"
    "from vllm_omni_edge.patches.worker import decoder_stack as d, stack_step_inputs as s\n"
    "calls = []\n"
    "class Recorder:\n"
    "    def __init__(self, op): self.op = op\n"
    "    def forward(self, emb, positions, slots, blocks, seq_lens):\n"
    "        rows = [blocks[i, : (int(seq_lens[i]) + BS - 1) // BS].tolist() for i in range(blocks.shape[0])]\n"
    "        calls.append([int(emb.view(torch.int16).long().sum()) if emb.dtype == torch.bfloat16 else float(emb.sum()),\n"
    "                      positions.tolist(), slots.tolist(), rows, seq_lens.tolist()])\n"
    "        return self.op.forward(emb, positions, slots, blocks, seq_lens)\n"
    "import torch\n"
    "plan = d.plan\n"
    "def recording_plan(runner):\n"
    "    stack = plan(runner)\n"
    "    stack.op = Recorder(stack.op)\n"
    "    return stack\n"
    "d.plan = recording_plan\n"
    "llm = LLM(model=sys.argv[1], max_model_len=512, max_num_seqs=2, max_num_batched_tokens=2,\n"
    "          kv_cache_memory_bytes=64 << 20)\n"
    "runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner\n"
    "BS = runner.input_batch.block_table.block_tables[0].block_size\n"
    "discards = []\n"
    "write = s._write_inputs\n"
    "def counting_write(runner, table, n):\n"
    "    write(runner, table, n)\n"
    "    discards.append(int(runner.discard_request_mask.np[:n].sum()))\n"
    "s._write_inputs = counting_write\n"
    "base = llm.get_tokenizer().encode('Write a short poem about the sea and the wind over the hills at night.')\n"
    "# A budget of two tokens a step: the seeded request's two-token prompt is read whole, every\n"
    "# later prompt one token a step beside a decoding request (chunks whose tokens are discarded).\n"
    "prompts = [{'prompt_token_ids': base[:n]} for n in (2, 5, 8, 4)]\n"
    "params = [SamplingParams(temperature=0.8, seed=7, max_tokens=14, ignore_eos=True),\n"
    "          SamplingParams(temperature=0, max_tokens=19, ignore_eos=True),\n"
    "          SamplingParams(temperature=0, max_tokens=11, ignore_eos=True),\n"
    "          SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]\n"
    "outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]\n"
    "print('PROBE-RESULT ' + json.dumps({'outs': outs, 'calls': calls, 'discards': discards,\n"
    "      'summary': s.summary(runner),\n"
    "      'stack': d.summary(runner)}))\n"
)


@pytest.mark.e2e
def test_the_stack_gets_vllms_inputs_and_the_same_tokens_come_out():
    from vllm_omni_edge.models.default_model import DEFAULT_MODEL, pull_cpu_int4_model

    model = str(pull_cpu_int4_model(DEFAULT_MODEL))
    ours = run_script_probe(PROBE, model, VLLM_OMNI_EDGE_STACK_STEP_INPUTS="1")
    vllm = run_script_probe(PROBE, model, VLLM_OMNI_EDGE_STACK_STEP_INPUTS="0")
    assert vllm["stack"]["on"] and not vllm["summary"]["on"], vllm["summary"]
    assert ours["summary"]["on"], ours["summary"]
    # Steady steps were taken from the batch, and the other decode steps through vLLM's preparation.
    assert 20 <= ours["summary"]["steps"] < ours["stack"]["steps"], (ours["summary"], ours["stack"])
    assert ours["stack"]["steps"] == vllm["stack"]["steps"]
    # A steady step carried a one-token prompt chunk beside a decoding request: its token discarded.
    assert sum(ours["discards"]) >= 1 and len(ours["discards"]) == ours["summary"]["steps"], ours["discards"]
    # Step by step, the stack saw the same embeddings, positions, KV slots, block rows and lengths.
    assert len(ours["calls"]) == len(vllm["calls"])
    for step, (a, b) in enumerate(zip(ours["calls"], vllm["calls"])):
        assert a == b, (step, a, b)
    assert ours["outs"] == vllm["outs"]
    assert [len(o) for o in ours["outs"]] == [14, 19, 11, 9]


def test_without_the_stacks_forward_every_step_is_vllms(monkeypatch):
    from vllm_omni_edge.patches.worker import decoder_stack

    monkeypatch.setattr(decoder_stack, "in_force", lambda: False)
    monkeypatch.setattr(decoder_stack, "_current", lambda runner: pytest.fail("the stack was asked for"))
    assert patch._stack_and_blocker(types.SimpleNamespace()) == (None, "the decoder stack is not in force")


def test_the_first_step_a_runner_takes_is_told_to_the_listeners(monkeypatch):
    import contextlib

    heard = []
    monkeypatch.setattr(patch, "listeners", [heard.append])
    monkeypatch.setattr(patch, "_write_inputs", lambda runner, table, n: None)
    monkeypatch.setattr(patch, "in_force", lambda: True)
    monkeypatch.setattr(patch, "_stack_and_blocker", lambda runner: (stack, None))
    monkeypatch.setattr(patch._VLLM, "ExecuteModelState", lambda *fields: fields, raising=False)
    stack = types.SimpleNamespace(steps=0, embed=lambda ids: ids, op=types.SimpleNamespace(forward=lambda *a: "hidden"))
    table = types.SimpleNamespace(slot_mapping=_Buffer(4, torch.int64), block_table=types.SimpleNamespace(cpu=torch.zeros(4, 4)))
    runner = types.SimpleNamespace(
        synchronize_input_prep=contextlib.nullcontext, _update_states=lambda so: None,
        input_batch=types.SimpleNamespace(num_reqs=1, block_table=types.SimpleNamespace(block_tables=[table])),
        input_ids=_Buffer(4, torch.int32), positions=torch.zeros(4), seq_lens=torch.zeros(4),
        model=types.SimpleNamespace(compute_logits=lambda hidden: "logits"))
    for _ in range(3):
        patch._run(runner, stack, "scheduler output")
    assert heard == [{"on": True, "steps": 1}] and stack.steps == 3
    assert runner.execute_model_state[:2] == ("scheduler output", "logits")
