"""One call of vLLM's C++ slot-mapping op writes the mapping vLLM's launcher writes."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_omni_edge.patches.worker import slot_mapping_call as patch

BLOCK, MAX_TOKENS = 16, 64


@pytest.fixture
def block_table(monkeypatch):
    bt = pytest.importorskip("vllm.v1.worker.block_table")
    import vllm._custom_ops  # noqa: F401  (loads the _C ops, as a CPU worker has)
    import vllm.utils.cpu_triton_utils as cpu_tl

    # What vLLM's CPU model runner does when Triton is absent.
    monkeypatch.setattr(bt._COMPUTE_SLOT_MAPPING_KERNEL, "kernel", cpu_tl.compute_slot_mapping_kernel)
    table = bt.BlockTable(block_size=BLOCK, max_num_reqs=4, max_num_blocks_per_req=8,
                          max_num_batched_tokens=MAX_TOKENS, pin_memory=False, device=torch.device("cpu"),
                          kernel_block_size=BLOCK, cp_kv_cache_interleave_size=1)
    table.add_row([7, 3, 9], 0)
    table.add_row([1, 12], 1)
    table.add_row([5], 2)
    table.commit_block_table(3)
    return bt, table


def _mapping(fn, table, starts, positions):
    table.slot_mapping.gpu.fill_(123456)
    fn(table, len(starts) - 1, torch.tensor(starts, dtype=torch.int32), torch.tensor(positions, dtype=torch.int64))
    return table.slot_mapping.gpu.clone()


@pytest.mark.parametrize("starts,positions,first", [
    ([0, 1, 2, 3], [40, 17, 3], 9 * BLOCK + 40 % BLOCK),          # decode: one token a request
    ([0, 4, 5, 7], [30, 31, 32, 33, 20, 0, 1], 3 * BLOCK + 30 % BLOCK),  # a prefill chunk, a decode, a prompt
])
def test_the_same_mapping_as_vllms_launcher(block_table, starts, positions, first):
    bt, table = block_table
    stock = bt.BlockTable.compute_slot_mapping
    stock = getattr(stock, "__wrapped__", stock)
    direct = patch.make_wrapper(bt)(lambda *a: pytest.fail("went to vLLM's launcher"))
    ours, theirs = _mapping(direct, table, starts, positions), _mapping(stock, table, starts, positions)
    assert torch.equal(ours, theirs)
    # Tokens past the batch are padding, as the launcher leaves them.
    assert ours[0] == first and ours[len(positions):].unique().numel() == 1


def test_other_tables_and_kernels_go_to_vllm(block_table, monkeypatch):
    bt, table = block_table
    calls = []
    wrapped = patch.make_wrapper(bt)(lambda *a: calls.append(a))
    monkeypatch.setattr(table, "blocks_per_kv_block", 2)
    wrapped(table, 1, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3]))
    monkeypatch.setattr(table, "blocks_per_kv_block", 1)
    monkeypatch.setattr(bt._COMPUTE_SLOT_MAPPING_KERNEL, "kernel", object())  # a real Triton kernel
    assert patch.direct_op(bt) is None
    wrapped(table, 1, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3]))
    assert len(calls) == 2


def test_wrapped_once():
    owner = types.SimpleNamespace(BlockTable=type("BlockTable", (), {"compute_slot_mapping": lambda self: None}))
    patch._wrap(owner)
    first = owner.BlockTable.compute_slot_mapping
    patch._wrap(owner)
    assert owner.BlockTable.compute_slot_mapping is first
