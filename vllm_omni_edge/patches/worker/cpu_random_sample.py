"""Sample on CPU without compiling the sampler on the first sampled request.

What: replaces ``vllm.v1.sample.ops.topk_topp_sampler.compiled_random_sample`` (a
``torch.compile``-d function that ``TopKTopPSampler.forward_cpu`` calls for every
request with temperature > 0 and no per-request seed) with ``eager_random_sample``:
the same exponential-race (Gumbel-max) draw, ``argmax(probs / q)`` with
``q ~ Exp(1)``, where ``q = -log(u)`` for ``u ~ U(tiny, 1)`` instead of
``Tensor.exponential_``. With ``VLLM_OMNI_EDGE_SAMPLER_ARGMAX`` on (the default) and the kernel
library built, the draw is one op, ``edge_cpu::gumbel_argmax``: the same race in logs
(``argmax(logits + G)``, ``G = -log(-log u)``, a Gumbel-max draw) with its uniforms hashed from
one seed that torch's generator gives, and no softmax. Greedy and seeded requests take other
paths and are untouched.
Why: vLLM compiles that function with inductor the first time a request samples, in
every layout and also with ``enforce_eager``: 4.5 s on this 2-core box before the first
sampled token (``temperature`` defaults to 1 in the OpenAI API, so a user's first chat
pays it), with the inductor cache warm. vLLM compiled it because CPU ``exponential_`` is
slow (1.6 ms for a 49k vocabulary here); ``rand`` + ``log`` in eager is as fast as the
compiled code (0.39 vs 0.47 ms at 49k, 1.19 vs 1.25 ms at 152k, measured here).
Flag: ``VLLM_OMNI_EDGE_EAGER_SAMPLER=0`` keeps vLLM's compiled sampler (the A/B arm).
Verified by: tests/test_cpu_random_sample.py (draws follow the softmax, chi-square on
a 4-token vocabulary; tokens with probability 0 are never drawn; ``forward_cpu`` runs no
dynamo compile; idempotent); the ``cold_start`` workload's ``first sampled request``
figure (the run is named in the RECORD's ``verified_by``).
Remove when: vLLM's CPU sampler stops compiling on the first request (or the compile
is cached across processes and costs < 0.1 s).
"""

from __future__ import annotations

import torch

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process
from vllm_omni_edge.patches.worker import sampler_argmax
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.v1.sample.ops.topk_topp_sampler"

RECORD = PatchRecord(
    name="cpu_random_sample",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}.compiled_random_sample",
    process=Process.WORKER,
    why="vLLM inductor-compiles its CPU random sampler on the first sampled request: 4.5 s "
    "before a user's first token at temperature > 0; the eager draw is as fast.",
    verified_by="tests/test_cpu_random_sample.py; the cold_start 'first sampled request' "
    "figure of results/2026-12-01-start-up-default/grid.yaml.",
    remove_when="vLLM's CPU sampler no longer compiles on the first request.",
    upstream="none found",
)


def eager_random_sample(logits: torch.Tensor) -> torch.Tensor:
    """One token per row, drawn from ``softmax(logits)`` (exponential race, no compile)."""
    if _gumbel is not None and sampler_argmax.takes(logits):
        # One 64-bit seed from torch's generator: torch.manual_seed still fixes the draws.
        seed = int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64))
        return _gumbel(logits, seed)
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    # u > 0 keeps q finite, u < 1 keeps it > 0: no token is excluded or forced.
    uniform = torch.rand_like(probs).clamp_(min=torch.finfo(torch.float32).tiny)
    race = uniform.log_().neg_()
    return probs.div_(race).argmax(dim=-1).view(-1)


# The whole draw in one C++ op (edge_cpu::gumbel_argmax) when the sampler-ops lever is on and the
# kernel library loads; apply() picks it.
_gumbel = None

eager_random_sample.__edge_wrapped__ = True


def apply() -> str:
    from vllm_omni_edge.levers import eager_sampler_enabled, sampler_argmax_enabled

    global _gumbel
    if not eager_sampler_enabled():
        return "vLLM's compiled CPU sampler kept (flag)"
    _gumbel = sampler_argmax.gumbel_op() if sampler_argmax_enabled() else None
    now = when_imported(TARGET_MODULE, _replace)
    return ("CPU random sampling runs eager" + (" in one op (edge_cpu::gumbel_argmax)" if _gumbel else "")
            + ("" if now else " (on import)"))


def _replace(module) -> None:
    if getattr(module.compiled_random_sample, "__edge_wrapped__", False):
        return
    module.compiled_random_sample = eager_random_sample
