"""Run a float16 checkpoint in float32 on a CPU without float16 arithmetic, when no dtype was asked.

What: wraps ``vllm.config.model._resolve_auto_dtype`` (``dtype="auto"``, vLLM's default): when
it resolves to float16 on the CPU platform and the CPU has neither AVX512-FP16 nor AMX-FP16,
the model runs in float32. Weights stored in float16 widen exactly, so outputs are those of
the checkpoint; an explicit ``dtype`` (``--dtype``) is never changed.
Why: vLLM-CPU lists float16 as native on every x86 CPU. Without AVX512-FP16, PyTorch's and
oneDNN's float16 matmuls and convolutions convert element by element: Whisper base (stored in
float16) transcribed several times slower than in float32 on an AVX-512 BF16 EPYC.
bfloat16 would be as fast but changes the numbers (a transcript's words changed).
Flag: ``VLLM_OMNI_EDGE_FP16_ON_CPU=float16`` keeps vLLM's choice (the lever's A/B arm).
Verified by: tests/test_fp16_as_float32.py (the rule per CPU, explicit dtypes untouched,
idempotent); the speech grid (docs/edge/speech.md).
Remove when: vLLM-CPU resolves float16 by the CPU's arithmetic, not only its architecture.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.config.model"
FP16_ARITHMETIC_FLAGS = ("avx512_fp16", "amx_fp16")

RECORD = PatchRecord(
    name="fp16_as_float32",
    kind=Kind.FIX,
    target="vllm.config.model._resolve_auto_dtype",
    process=Process.FRONTEND,
    why="vLLM-CPU runs float16 checkpoints in float16 on x86 CPUs that have no float16 "
    "arithmetic, where every matmul converts element by element.",
    verified_by="tests/test_fp16_as_float32.py; the speech grid's serve arm (docs/edge/speech.md).",
    remove_when="vLLM-CPU's supported_dtypes depends on the CPU's float16 arithmetic.",
    upstream="none found",
)


def cpu_has_fp16_arithmetic(flags: frozenset[str] | None = None) -> bool:
    from vllm_omni_edge.cpu_features import cpu_flags

    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in FP16_ARITHMETIC_FLAGS)


def apply() -> str:
    from vllm_omni_edge import envs

    if envs.get("VLLM_OMNI_EDGE_FP16_ON_CPU") == "float16":
        return "VLLM_OMNI_EDGE_FP16_ON_CPU=float16: vLLM's float16"
    if cpu_has_fp16_arithmetic():
        return "this CPU has float16 arithmetic: vLLM's choice kept"
    now = when_imported(TARGET_MODULE, _wrap)
    return "dtype auto: float16 checkpoints run in float32" + ("" if now else " (on import)")


def _wrap(module) -> None:
    original = module._resolve_auto_dtype
    if getattr(original, "_vllm_omni_edge_fp32", False):
        return

    def _resolve_auto_dtype(*args, **kwargs):
        import torch
        from vllm.platforms import current_platform

        dtype = original(*args, **kwargs)
        if dtype == torch.float16 and current_platform.is_cpu():
            from vllm_omni_edge.log import get_logger

            get_logger("fp16_as_float32").info(
                "float16 checkpoint on a CPU without float16 arithmetic: running it in float32 "
                "(exact; --dtype float16 or bfloat16 to choose otherwise)")
            return torch.float32
        return dtype

    _resolve_auto_dtype._vllm_omni_edge_fp32 = True
    _resolve_auto_dtype.__wrapped__ = original
    module._resolve_auto_dtype = _resolve_auto_dtype
