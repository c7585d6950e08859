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


def test_flag_keeps_torch_argmax_and_the_torch_draw(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_SAMPLER_ARGMAX", "0")
    assert patch.apply() == "torch.argmax kept for sampled tokens (flag)"
    monkeypatch.setattr(cpu_random_sample, "_gumbel", "stale")
    cpu_random_sample.apply()
    assert cpu_random_sample._gumbel is None


@needs_op
def test_the_random_draw_runs_as_one_op_by_default(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_SAMPLER_ARGMAX", "1")
    monkeypatch.setattr(cpu_random_sample, "_gumbel", None)
    assert "edge_cpu::gumbel_argmax" in cpu_random_sample.apply()
    assert cpu_random_sample._gumbel is patch.gumbel_op()


@needs_op
def test_gumbel_op_draws_follow_the_softmax_row_by_row():
    gumbel = patch.gumbel_op()
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05, 0.0])
    logits = probs.log().expand(30_000, 6).contiguous()  # every row its own stream of one seed
    counts = torch.bincount(gumbel(logits, 12345), minlength=6).double()
    assert counts[5] == 0  # probability 0: never drawn
    expected = probs[:5].double() * logits.shape[0]
    chi_square = float(((counts[:5] - expected) ** 2 / expected).sum())
    assert chi_square < 18.47, (counts, chi_square)  # 4 d.o.f., p = 0.001
    assert torch.equal(gumbel(logits[:50], 7), gumbel(logits[:50], 7))  # a seed fixes the draw
    assert not torch.equal(gumbel(logits[:50], 7), gumbel(logits[:50], 8))
    assert gumbel(torch.full((2, 40), -float("inf")), 1).tolist() == [0, 0]  # nothing to draw
    with pytest.raises(RuntimeError, match="must be 2-D"):
        gumbel(torch.zeros(8), 1)
    with pytest.raises(RuntimeError, match="is not float32, bfloat16 or float16"):
        gumbel(torch.zeros(2, 8, dtype=torch.float64), 1)
