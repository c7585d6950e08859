"""Run a decoder layer's gated SiLU MLP as one op when both its linears are 4-bit rows16.

What: wraps ``LlamaMLP.forward`` and ``Qwen2MLP.forward`` (vLLM's model classes; Mistral,
SmolLM2, Qwen2.5 and Qwen3 use them). When ``gate_up_proj`` and ``down_proj`` both run
cpu_int4's ``avx512_w4a8_rows16`` kernel, have no bias, no dense prefill copy and no tensor
parallel split, and ``act_fn`` is ``SiluAndMul``, the MLP is one call of
``edge_cpu_int4::w4a8_vnni_rows16_silu_mlp`` (gate_up, SiLU x up and down in C++); any other
MLP runs vLLM's code unchanged.
Why: at decode a small model's MLP is three calls (two linears and an inductor kernel) whose
fixed costs (Python dispatch, four allocations each, a thread fork/join) are as large as the
matrix work: SmolLM2-135M's MLP took 98 us as three calls and 69 us as one on this box (one
row, 2 threads, hot weights), 30 layers a token.
Flag: ``VLLM_OMNI_EDGE_FUSED_MLP=0`` keeps vLLM's three calls (the A/B arm).
Verified by: tests/test_fused_silu_mlp.py (op against the three calls on random weights,
prefill and decode rows; eligibility; fallback; idempotent); decode in
``grids/fused-mlp-default.yaml`` and ``grids/fused-mlp-qwen.yaml``, whose evidence asserts
``fused_silu_mlps`` (30 and 28 layers).
Remove when: vLLM's CPU path fuses a quantized MLP itself (a fused-MoE-style dense MLP op
for CPU), or our kernels move into a vLLM quantization backend that provides one.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

# Module -> MLP class whose forward is gate_up_proj, act_fn, down_proj (vLLM 0.30).
TARGETS = {
    "vllm.model_executor.models.llama": "LlamaMLP",
    "vllm.model_executor.models.qwen2": "Qwen2MLP",
}

RECORD = PatchRecord(
    name="fused_silu_mlp",
    kind=Kind.LEVER,
    target=", ".join(f"{module}.{cls}.forward" for module, cls in TARGETS.items()),
    process=Process.WORKER,
    why="At decode a small model's MLP is three calls whose fixed costs match its matrix work; "
    "with both linears on the rows16 W4A8 kernel they can be one C++ call.",
    verified_by="tests/test_fused_silu_mlp.py; grids/fused-mlp-default.yaml, grids/fused-mlp-qwen.yaml.",
    remove_when="vLLM fuses a quantized dense MLP on CPU itself.",
    upstream="none found",
)


def _rows16_linear(layer, kernel_cls) -> bool:
    return (
        type(getattr(layer, "int4_kernel", None)) is kernel_cls
        and getattr(layer, "bias", None) is None
        and getattr(layer, "dense_weight", None) is None
        and getattr(layer, "tp_size", 1) == 1
    )


def _fusable(mlp, act_cls, kernel_cls) -> bool:
    # Plain attribute and type checks: dynamo folds them into guards when it traces forward.
    return (
        isinstance(getattr(mlp, "act_fn", None), act_cls)
        and _rows16_linear(getattr(mlp, "gate_up_proj", None), kernel_cls)
        and _rows16_linear(getattr(mlp, "down_proj", None), kernel_cls)
    )


def _classes():
    from vllm.model_executor.layers.activation import SiluAndMul

    from vllm_omni_edge.quantization.kernels.w4a8_avx512 import Avx512VnniRows16W4A8Kernel

    return SiluAndMul, Avx512VnniRows16W4A8Kernel


def fusable(mlp) -> bool:
    """Whether this MLP's forward is the one fused op (a function of its modules only)."""
    return _fusable(mlp, *_classes())


def _make_forward(original):
    from vllm_omni_edge.quantization.kernels.w4a8_avx512 import silu_mlp

    act_cls, kernel_cls = _classes()

    def forward(self, x):
        if not _fusable(self, act_cls, kernel_cls):
            return original(self, x)
        return silu_mlp(self.gate_up_proj, self.down_proj, x)

    return forward


def fused_mlp_count(model) -> int:
    """MLPs of ``model`` that run the fused op in this process (evidence)."""
    import sys

    classes = tuple(getattr(sys.modules[name], cls) for name, cls in TARGETS.items() if name in sys.modules)
    # Only our wrapped forward fuses: not an unwrapped class, nor a subclass with its own forward.
    return sum(
        1 for m in model.modules()
        if isinstance(m, classes) and getattr(type(m).forward, "__edge_wrapped__", False) and fusable(m)
    )


def _wrapper_for(cls_name: str):
    def wrap(module) -> None:
        wrap_method_once(getattr(module, cls_name), "forward", _make_forward)

    return wrap


def apply() -> str:
    from vllm_omni_edge.levers import fused_mlp_enabled

    if not fused_mlp_enabled():
        return "vLLM's MLP calls kept (flag)"
    now = [when_imported(module, _wrapper_for(cls)) for module, cls in TARGETS.items()]
    return "gated SiLU MLPs on rows16 fused" + ("" if all(now) else " (on import)")
