"""Take a sampled token's argmax over the vocabulary with our row-wise argmax op.

What: wraps ``vllm.v1.sample.sampler.Sampler.greedy_sample`` (a static method:
``logits.argmax(dim=-1).view(-1)``). For a 2-D CPU float32/bfloat16/float16 logits tensor it
calls ``edge_cpu::argmax_rows`` (``quantization/kernels/csrc/argmax.cpp``): the same indices as
``torch.argmax`` (the first maximum of each row; a row's first NaN when it has one); anything
else goes to vLLM's code. The same flag lets ``cpu_random_sample``'s eager draw run as one op of
that library (``edge_cpu::gumbel_argmax``).
Why: a greedy token is one argmax over the vocabulary a step, and ATen's CPU argmax reduces a
row element by element: several times the vectorized op's time (the figures are in the run
named under Verified by's ``step_ab`` lever and ROADMAP).
Flag: ``VLLM_OMNI_EDGE_SAMPLER_ARGMAX=0`` keeps ``torch.argmax`` (the A/B arm).
Verified by: tests/test_sampler_argmax.py (the op against ``torch.argmax`` over dtypes,
lengths around the vector width, ties, NaN, infinities, strided rows; the wrapper's routing;
idempotent); ``step_ab --levers sampler_argmax`` (docs/edge/harness.md).
Remove when: ATen's CPU argmax vectorizes a row reduction as fast (or vLLM samples in C++).
"""

from __future__ import annotations

import functools

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.sample.sampler"
MARKER = "__edge_sampler_argmax__"

RECORD = PatchRecord(
    name="sampler_argmax",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.Sampler.greedy_sample",
    process=Process.WORKER,
    why="A greedy token is an argmax over the vocabulary each step, and ATen's CPU argmax is "
    "several times slower than a vectorized row reduction.",
    verified_by="tests/test_sampler_argmax.py; `step_ab --levers sampler_argmax` (docs/edge/harness.md).",
    remove_when="ATen's CPU argmax reduces a row as fast, or vLLM samples in C++.",
    upstream="none found",
)

def argmax_op():
    """``edge_cpu::argmax_rows``: torch.argmax(x, dim=-1) of a 2-D float tensor (None: not built)."""
    from vllm_omni_edge.quantization.kernels import native

    return native.edge_cpu_op("argmax_rows")


def gumbel_op():
    """``edge_cpu::gumbel_argmax``: a draw from each row's softmax, from one seed (None: not built)."""
    from vllm_omni_edge.quantization.kernels import native

    return native.edge_cpu_op("gumbel_argmax")


def takes(x) -> bool:
    """Whether the ops take ``x``: a non-empty 2-D CPU float32/bfloat16/float16 tensor."""
    import torch

    return (x.dim() == 2 and x.shape[-1] > 0 and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16))


def _make(original, op):
    def greedy_sample(logits):
        if takes(logits):
            return op(logits)
        return original(logits)

    return greedy_sample


def _wrap(module) -> None:
    op = argmax_op()
    sampler = module.Sampler
    original = sampler.__dict__["greedy_sample"]
    function = original.__func__ if isinstance(original, staticmethod) else original
    if op is None or getattr(function, MARKER, False):
        return
    wrapper = functools.wraps(function)(_make(function, op))
    setattr(wrapper, MARKER, True)
    sampler.greedy_sample = staticmethod(wrapper)


def in_force() -> bool:
    """Whether greedy tokens in this process are taken by our op."""
    import sys

    module = sys.modules.get(TARGET_MODULE)
    return module is not None and getattr(module.Sampler.greedy_sample, MARKER, False)


def apply() -> str:
    from vllm_omni_edge.levers import sampler_argmax_enabled

    if not sampler_argmax_enabled():
        return "torch.argmax kept for sampled tokens (flag)"
    if argmax_op() is None:
        return "torch.argmax kept for sampled tokens: the kernel library is not built here"
    now = when_imported(TARGET_MODULE, _wrap)
    return "greedy tokens through edge_cpu::argmax_rows" + ("" if now else " (on import)")
