"""The eager CPU sampler: draws follow the softmax, nothing compiles, applied once.

The draw tests run on both of its paths: torch ops, and the one Gumbel-max op of our kernel
library (skipped where the library is not built).
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni_edge.patches.worker import cpu_random_sample, sampler_argmax


@pytest.fixture(params=["torch", "gumbel_op"], autouse=True)
def draw_path(request, monkeypatch):
    op = sampler_argmax.gumbel_op() if request.param == "gumbel_op" else None
    if request.param == "gumbel_op" and op is None:
        pytest.skip("kernel library not built here (vllm-omni-edge build-kernels)")
    monkeypatch.setattr(cpu_random_sample, "_gumbel", op)
    return request.param


def test_draws_follow_the_softmax():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20_000, 4).contiguous()
    tokens = cpu_random_sample.eager_random_sample(logits)
    counts = torch.bincount(tokens, minlength=4).double()
    expected = probs.double() * tokens.numel()
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 16.27, (counts, chi_square)  # 3 d.o.f., p = 0.001


def test_a_token_with_probability_zero_is_never_drawn_and_a_certain_one_always():
    torch.manual_seed(1)
    logits = torch.tensor([[0.0, float("-inf"), 0.0]]).expand(5_000, 3).contiguous()
    assert 1 not in cpu_random_sample.eager_random_sample(logits).tolist()
    certain = torch.tensor([[float("-inf"), 0.0]]).expand(100, 2).contiguous()
    assert cpu_random_sample.eager_random_sample(certain).tolist() == [1] * 100


def test_torch_seed_fixes_the_draws_and_a_large_vocabulary_follows_the_softmax():
    logits = torch.randn(1, 49_152, generator=torch.Generator().manual_seed(3)) * 3
    torch.manual_seed(5)
    first = [int(cpu_random_sample.eager_random_sample(logits)) for _ in range(5_000)]
    torch.manual_seed(5)
    assert [int(cpu_random_sample.eager_random_sample(logits)) for _ in range(5)] == first[:5]
    # The most likely tokens are drawn at their probabilities (z-scores of independent draws).
    probs = logits.softmax(-1)[0].double()
    for token in probs.argsort(descending=True)[:3].tolist():
        share = first.count(token) / len(first)
        sd = float((probs[token] * (1 - probs[token]) / len(first)) ** 0.5)
        assert abs(share - float(probs[token])) < 4.5 * sd, (token, share, float(probs[token]))


def test_vllms_cpu_sampler_uses_it_and_compiles_nothing():
    from torch._dynamo.utils import counters

    from vllm.v1.sample.ops import topk_topp_sampler

    compiled = topk_topp_sampler.compiled_random_sample
    try:
        cpu_random_sample._replace(topk_topp_sampler)
        assert topk_topp_sampler.compiled_random_sample is cpu_random_sample.eager_random_sample
        sampler = topk_topp_sampler.TopKTopPSampler()
        counters.clear()
        tokens, _ = sampler.forward_cpu(torch.randn(2, 49_152), {}, None, None)
        assert tokens.shape == (2,) and tokens.dtype == torch.int64
        assert not counters["stats"]["unique_graphs"], dict(counters["stats"])
    finally:
        topk_topp_sampler.compiled_random_sample = compiled


def test_replacing_twice_replaces_once():
    import types

    module = types.SimpleNamespace(compiled_random_sample=lambda logits: None)
    cpu_random_sample._replace(module)
    assert module.compiled_random_sample is cpu_random_sample.eager_random_sample
    cpu_random_sample._replace(module)
    assert module.compiled_random_sample is cpu_random_sample.eager_random_sample


def test_the_flag_keeps_vllms_compiled_sampler(monkeypatch):
    import pytest

    from vllm_omni_edge.levers import LeverFlagError

    replaced = []
    monkeypatch.setattr(cpu_random_sample, "when_imported", lambda name, callback: replaced.append(name))
    monkeypatch.setenv("VLLM_OMNI_EDGE_EAGER_SAMPLER", "0")
    assert "kept" in cpu_random_sample.apply() and replaced == []
    monkeypatch.setenv("VLLM_OMNI_EDGE_EAGER_SAMPLER", "1")
    cpu_random_sample.apply()
    assert replaced == [cpu_random_sample.TARGET_MODULE]
    monkeypatch.setenv("VLLM_OMNI_EDGE_EAGER_SAMPLER", "yes")
    with pytest.raises(LeverFlagError, match="VLLM_OMNI_EDGE_EAGER_SAMPLER='yes'"):
        cpu_random_sample.apply()
