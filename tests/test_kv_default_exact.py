"""A need-sized KV default is what vLLM's own planner admits: property tests over many shapes.

For each drawn shape (layers, KV heads, head size, block size, ``max_model_len``,
``max_num_seqs``, sliding-window layers mixed in), the budget ``kv_default_exact`` sizes is
handed to vLLM's ``get_kv_cache_configs`` (which runs ``_check_enough_kv_cache_memory``):
it must be accepted and hold ``max_num_seqs`` full-length requests beside the null block;
for one sequence, one block less must be refused (the sizing is exact, not generous).
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

from vllm_omni_edge.levers import kv_budget as kv  # noqa: E402
from vllm_omni_edge.patches.worker.kv_default_exact import NEED_SIZED_ATTR, need_sized_bytes  # noqa: E402
from vllm_omni_edge.patches.worker.kv_default_exact import wrap_get_kv_cache_configs  # noqa: E402

HUGE_RAM = 1 << 50  # the cap is then DEFAULT_CAP_BYTES


class _Model:
    """The fields of ModelConfig the KV planner reads."""

    def __init__(self, max_model_len: int):
        self.max_model_len = max_model_len
        self.original_max_model_len = max_model_len


def config(max_model_len: int, max_num_seqs: int) -> VllmConfig:
    vc = VllmConfig()
    object.__setattr__(vc, "model_config", _Model(max_model_len))
    vc.scheduler_config.max_num_seqs = max_num_seqs
    vc.scheduler_config.max_num_batched_tokens = max(2048, max_model_len)
    vc.cache_config.kv_cache_layout = "LBHNC"  # the engine core resolves it before planning
    return vc


def specs(rng: random.Random, hybrid: bool) -> dict:
    block = rng.choice([16, 32, 64, 128])
    heads, head_size = rng.choice([1, 2, 3, 4, 8]), rng.choice([32, 64, 128])
    n_full = rng.randint(1, 12)
    out = {f"model.layers.{i}.attn": FullAttentionSpec(block, num_kv_heads=heads, head_size=head_size,
                                                        dtype=torch.bfloat16) for i in range(n_full)}
    if hybrid:
        window = rng.choice([64, 128, 512, 4096])
        for i in range(n_full, n_full + rng.randint(1, 12)):
            out[f"model.layers.{i}.attn"] = SlidingWindowSpec(block, num_kv_heads=heads, head_size=head_size,
                                                             dtype=torch.bfloat16, sliding_window=window)
    return out


def plan(vc: VllmConfig, layer_specs: dict, memory: int):
    return kcu.get_kv_cache_configs(vc, [dict(layer_specs)], [memory])[0]


CASES = [(seed, hybrid) for seed in range(60) for hybrid in (False, True)]


@pytest.mark.parametrize("seed,hybrid", CASES)
def test_sized_pool_is_admitted_and_holds_every_sequence(seed, hybrid):
    rng = random.Random(seed)
    layer_specs = specs(rng, hybrid)
    vc = config(rng.choice([100, 512, 1000, 2048, 4097, 8192]), rng.randint(1, 8))
    sized = need_sized_bytes(vc, layer_specs, HUGE_RAM)
    cfg = plan(vc, layer_specs, sized)  # raises if vLLM's check refuses
    groups = kcu.get_kv_cache_groups(vc, dict(layer_specs))
    per_block = kcu._pool_bytes_per_block(groups)
    one_request = kcu._max_memory_usage_bytes_from_groups(vc, groups)
    seqs = vc.scheduler_config.max_num_seqs
    # Every sequence while the need is under the cap; at least one request always.
    held = seqs if kv.pool_need_bytes(one_request, per_block, seqs) <= kv.DEFAULT_CAP_BYTES else 1
    assert cfg.num_blocks - 1 >= held * (one_request // per_block)


@pytest.mark.parametrize("seed,hybrid", CASES[::3])
def test_one_block_less_is_refused_for_one_sequence(seed, hybrid):
    rng = random.Random(seed)
    layer_specs = specs(rng, hybrid)
    vc = config(rng.choice([100, 512, 1000, 2048, 8192]), 1)
    sized = need_sized_bytes(vc, layer_specs, HUGE_RAM)
    per_block = kcu._pool_bytes_per_block(kcu.get_kv_cache_groups(vc, dict(layer_specs)))
    with pytest.raises(ValueError, match="estimated maximum model length|No available memory"):
        plan(vc, layer_specs, sized - per_block)


@pytest.mark.parametrize("max_model_len", [512, 1000, 2048, 4096, 8192])
@pytest.mark.parametrize("max_num_seqs", [1, 2, 4])
def test_front_end_estimate_equals_the_exact_size_for_full_attention(max_model_len, max_num_seqs):
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, bf16, CPU blocks of 128.
    layer_specs = {f"l{i}": FullAttentionSpec(128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
                   for i in range(30)}
    vc = config(max_model_len, max_num_seqs)
    shape = kv.KVShape(30 * 2 * 3 * 64 * 2, 128)
    front = kv.decide(None, shape, max_model_len, max_num_seqs, 24 << 30, "need").budget_bytes
    assert front == need_sized_bytes(vc, layer_specs, 24 << 30)
    plan(vc, layer_specs, front)  # the front end's own number is admitted too


def test_the_wrapper_resizes_only_a_need_sized_default():
    layer_specs = {f"l{i}": FullAttentionSpec(128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
                   for i in range(4)}
    seen = []
    wrapped = wrap_get_kv_cache_configs(lambda vc, s, mem: seen.append(mem[0]))
    vc = config(512, 2)
    wrapped(vc, [layer_specs], [123])
    assert seen == [123]  # explicit (not marked): untouched
    setattr(vc.cache_config, NEED_SIZED_ATTR, True)
    wrapped(vc, [layer_specs], [123])
    assert seen[-1] == need_sized_bytes(vc, layer_specs, 24 << 30) > 123


def test_the_patch_wraps_once():
    from types import SimpleNamespace

    from vllm_omni_edge.patches.worker import kv_default_exact

    module = SimpleNamespace(get_kv_cache_configs=lambda vc, specs, mem: mem)
    kv_default_exact._wrap(module)
    first = module.get_kv_cache_configs
    kv_default_exact._wrap(module)
    assert module.get_kv_cache_configs is first and first.__edge_wrapped__
