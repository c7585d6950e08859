"""The row-wise argmax op and the sampler patch that takes greedy tokens with it.

The op must return what ``torch.argmax(x, dim=-1)`` returns (the first maximum of each row, a
row's first NaN), so torch is the reference over dtypes, lengths around the 8-lane vector,
ties, infinities and NaN; the patch must route only tensors the op takes.
"""

from __future__ import annotations

import types

import pytest
import torch

from vllm_omni_edge.patches.worker import cpu_random_sample
from vllm_omni_edge.patches.worker import sampler_argmax as patch

op = patch.argmax_op()
needs_op = pytest.mark.skipif(op is None, reason="kernel library not built here (vllm-omni-edge build-kernels)")

LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 100, 4099]


def _rows(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, n, generator=g)
    x[1] = 0.0  # all equal: index 0
    x[2] = -float("inf")
    if n > 3:
        x[3, n // 3] = x[3, n - 2] = x[3].abs().max() + 1  # a tie: the first one
        x[4, n // 2] = float("inf")
        x[5, n - 1] = float("nan")  # NaN after the maximum: the NaN
        x[6, 1] = float("nan")
        x[6, n - 1] = float("nan")  # two NaNs: the first
    return x.to(dtype)


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", LENGTHS)
def test_op_returns_torch_argmax(dtype, n):
    x = _rows(n, dtype, n)
    out = op(x)
    assert out.dtype == torch.int64 and out.shape == (7,)
    assert torch.equal(out, x.argmax(dim=-1))


@needs_op
def test_op_on_many_rows_and_strided_rows():
    x = torch.randn(300, 2048, generator=torch.Generator().manual_seed(1))  # rows in parallel
    assert torch.equal(op(x), x.argmax(dim=-1))
    strided = torch.randn(5, 202, generator=torch.Generator().manual_seed(2))[:, ::2]
    assert torch.equal(op(strided), strided.argmax(dim=-1))
    assert op(torch.empty(0, 16)).shape == (0,)


@needs_op
def test_op_refuses_bad_input():
    with pytest.raises(RuntimeError, match="must be 2-D"):
        op(torch.zeros(8))
    with pytest.raises(RuntimeError, match="rows of length 0"):
        op(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="is not float32, bfloat16 or float16"):
        op(torch.zeros(2, 8, dtype=torch.float64))


@needs_op
def test_wrapper_routes_what_the_op_takes():
    seen = []

    def original(logits):
        seen.append(logits)
        return logits.argmax(dim=-1).view(-1)

    Sampler = type("Sampler", (), {"greedy_sample": staticmethod(original)})
    module = types.SimpleNamespace(Sampler=Sampler)
    patch._wrap(module)
    patch._wrap(module)  # idempotent: wrapped once
    wrapped = Sampler.greedy_sample
    assert getattr(wrapped, patch.MARKER) and wrapped.__wrapped__ is original
    logits = torch.randn(3, 50).to(torch.bfloat16)
    assert torch.equal(Sampler().greedy_sample(logits), logits.argmax(dim=-1)) and not seen
    as_double = logits.double()
    assert torch.equal(Sampler().greedy_sample(as_double), as_double.argmax(dim=-1)) and len(seen) == 1
    assert torch.equal(patch.argmax_rows(as_double), as_double.argmax(dim=-1))


def test_flag_keeps_torch_argmax(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_SAMPLER_ARGMAX", "0")
    assert patch.apply() == "torch.argmax kept for sampled tokens (flag)"
    monkeypatch.setattr(cpu_random_sample, "_argmax", cpu_random_sample._torch_argmax)
    cpu_random_sample.apply()
    assert cpu_random_sample._argmax is cpu_random_sample._torch_argmax


@needs_op
def test_random_draw_takes_its_argmax_through_the_op(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_SAMPLER_ARGMAX", "1")
    monkeypatch.setattr(cpu_random_sample, "_argmax", cpu_random_sample._torch_argmax)
    cpu_random_sample.apply()
    assert cpu_random_sample._argmax is patch.argmax_rows
    logits = torch.full((2, 5), -float("inf"))
    logits[0, 3] = logits[1, 1] = 0.0  # one token with all the probability
    assert cpu_random_sample.eager_random_sample(logits).tolist() == [3, 1]
