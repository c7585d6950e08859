"""cpu_int4: 4-bit weights for vLLM on CPUs.

Layers, one way: checkpoint -> ``config.py`` (what it holds) -> ``linear.py``
(how a layer is built and loaded) -> ``kernels/`` (which instruction set runs
it). The number format lives in ``int4.py``; ``builder.py`` writes checkpoints.

Importing this package does not import vLLM; ``register_cpu_int4()`` does.
"""

from __future__ import annotations


def register_cpu_int4() -> str:
    """Make ``quantization="cpu_int4"`` known to vLLM in this process.

    Idempotent (Python imports the module once). Must run in the front-end
    process before the engine config is built; spawned workers import it again
    when they unpickle the config.
    """
    from vllm_omni_edge.quantization.config import QUANT_METHOD, CpuInt4Config  # noqa: F401

    return f"quantization method {QUANT_METHOD!r} registered"
