"""Compiled or eager, when the user does not say: eager where our C++ decoder stack runs decode.

vLLM compiles a model by default. On a CPU box that buys two things: decode steps through one
compiled graph instead of an op at a time from Python, and prefill with the graph's fused
elementwise kernels. Where the C++ decoder stack (``patches/worker/decoder_stack.py``) runs a
model's decode steps, the compiled graph no longer runs them, and what is left is a small share
of prefill's time. It costs every start the compiler's import (inductor's modules, deferred by
``inductor_fallback_deferred`` and ``import_compile_lazy`` until something compiles) and
the compiled artifact's load, and a machine's first start the compile itself.
So ``auto`` runs such models eager. Everywhere else (a model or a CPU class the stack does not
run, a bf16 checkpoint, LoRA, speculative decoding, more than one worker) vLLM's compile stays.

:func:`decide` predicts from the checkpoint's config and this CPU's routing, before the engine
exists; the stack itself decides per step, and ``decoder_stack`` warns if a model this chose
eager for turns out not to run on it (the model config's ``EAGER_FOR_STACK_ATTR``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# The models the decoder stack runs (vLLM's classes for these architectures).
STACK_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
AUTO, ON, OFF = "auto", "on", "off"


@dataclass(frozen=True)
class Decision:
    eager: bool  # True: run eager; False: leave vLLM's compile
    reason: str


def read_config(model: str) -> dict | None:
    """A local checkpoint directory's config.json, or None (a hub name, a file, unreadable)."""
    path = Path(model).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def routed_kernel(config: dict) -> str | None:
    """The cpu_int4 kernel this CPU routes a hidden x hidden linear of ``config`` to, or None."""
    import torch

    from vllm_omni_edge.cpu_features import CpuFeatures
    from vllm_omni_edge.quantization.int4 import Int4FormatError
    from vllm_omni_edge.quantization.kernels import choose_kernel

    quant = config.get("quantization_config") or {}
    hidden = config.get("hidden_size")
    if not isinstance(hidden, int):
        return None
    group = quant.get("group_size", 32)
    try:
        kernel, _ = choose_kernel(CpuFeatures.detect(), group, hidden, hidden, torch.bfloat16, "the decoder stack check",
                                  float_zero=quant.get("zero_point", "float") == "float")
    except (Int4FormatError, ValueError, RuntimeError):
        return None
    return kernel.name


def stack_expected(model: str, quantization: str | None, *, lora: bool = False, speculative: bool = False,
                   workers: int = 1) -> tuple[bool, str]:
    """Whether the decoder stack should run ``model``'s decode steps here, and why (not)."""
    from vllm_omni_edge.levers import decoder_stack_enabled
    from vllm_omni_edge.patches.worker.decoder_stack import KERNELS

    if not decoder_stack_enabled():
        return False, "the decoder stack is off"
    if lora or speculative or workers != 1:
        return False, "LoRA, speculative decoding or more than one worker"
    config = read_config(model)
    if config is None:
        return False, "not a local checkpoint directory"
    architectures = config.get("architectures") or []
    if not any(a in STACK_ARCHITECTURES for a in architectures):
        return False, f"{'/'.join(architectures) or 'its architecture'} is not one the decoder stack runs"
    quant = quantization or (config.get("quantization_config") or {}).get("quant_method")
    if quant != "cpu_int4":
        return False, "not cpu_int4"
    kernel = routed_kernel(config)
    if kernel not in KERNELS:
        return False, f"this CPU runs {kernel or 'no cpu_int4 kernel'}, which the decoder stack does not call"
    return True, f"the C++ decoder stack runs its decode steps ({kernel})"


def decide(mode: str, model: str, quantization: str | None, *, user_chose: bool, lora: bool = False,
           speculative: bool = False, workers: int = 1) -> Decision:
    """Eager or vLLM's compile for an engine the user did not say (``user_chose``: they did)."""
    if user_chose:
        return Decision(False, "yours")
    if mode == ON:
        return Decision(False, "compiled (VLLM_OMNI_EDGE_COMPILE=on)")
    if mode == OFF:
        return Decision(True, "eager (VLLM_OMNI_EDGE_COMPILE=off)")
    expected, why = stack_expected(model, quantization, lora=lora, speculative=speculative, workers=workers)
    if expected:
        return Decision(True, f"eager: {why}, nothing left to compile (VLLM_OMNI_EDGE_COMPILE=on compiles)")
    return Decision(False, f"compiled: {why}")
