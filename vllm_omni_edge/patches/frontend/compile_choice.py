"""Eager, not compiled, where our C++ decoder stack runs the model's decode steps (unless you say).

What: wraps ``EngineArgs.create_engine_config`` (front end, ``LLM()`` and ``vllm serve``). When the
user gave no ``enforce_eager``, compilation config or optimization level, it asks
``levers.compile_choice.decide`` and, where the decoder stack will run the model's decode
steps, sets ``enforce_eager`` before vLLM builds its config. The decision is logged in one line
and, when eager, kept on the model config for the worker's evidence (``compile_choice``) and the
decoder stack's warning should the stack not run.
Why: vLLM compiles by default, which on CPU made decode fast by running one graph instead of an
op at a time. Where the decoder stack runs decode, the graph is left with a small share of
prefill's time, and a compiled engine still pays the compiler's import and the artifact's load
every start, and the compile itself on a machine's first (the grids named under Verified by have
the figures).
Flag: ``VLLM_OMNI_EDGE_COMPILE=auto`` (default) | ``on`` (vLLM's compile) | ``off`` (eager).
Verified by: tests/test_compile_choice.py (the decision per model, CPU class and flag; the
user's own setting wins; the wrapped EngineArgs); tests/e2e/test_compile_cache.py (``on``
compiles and loads the artifact); user-commands grids (an arm with ``VLLM_OMNI_EDGE_COMPILE=on``).
Remove when: vLLM on CPU runs decode without Python between kernels and compiles no faster
than it starts eager.
"""

from __future__ import annotations

import functools

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process

ATTR = "_edge_compile_choice"

RECORD = PatchRecord(
    name="compile_choice",
    kind=Kind.LEVER,
    target="vllm.engine.arg_utils.EngineArgs.create_engine_config",
    process=Process.FRONTEND,
    why="vLLM compiles by default; where our decoder stack runs decode, the compiled graph has only "
    "prefill left, and every start pays the compiler's import and artifact load (a first start, a compile).",
    verified_by="tests/test_compile_choice.py; tests/e2e/test_compile_cache.py; user-commands grids "
    "(an arm with VLLM_OMNI_EDGE_COMPILE=on).",
    remove_when="vLLM on CPU decodes without Python between kernels and a compiled start costs no more.",
    upstream="none found",
)


def user_chose(args) -> bool:
    """Whether these EngineArgs say compiled or eager themselves."""
    from vllm.config import CompilationConfig
    from vllm.engine.arg_utils import EngineArgs

    default_level = EngineArgs.__dataclass_fields__["optimization_level"].default
    return bool(args.enforce_eager) or args.compilation_config != CompilationConfig() \
        or args.optimization_level != default_level


def choose(args):
    """The lever's decision for ``args`` (EngineArgs), applied to them; None if already decided."""
    from vllm_omni_edge.levers import compile_choice, compile_mode
    from vllm_omni_edge.log import get_logger

    if getattr(args, ATTR, None) is not None:
        return None
    workers = args.tensor_parallel_size * args.pipeline_parallel_size * args.data_parallel_size
    decision = compile_choice.decide(
        compile_mode(), str(args.model), args.quantization, user_chose=user_chose(args),
        lora=bool(args.enable_lora), speculative=args.speculative_config is not None, workers=workers)
    setattr(args, ATTR, decision)
    if decision.eager:
        args.enforce_eager = True
    get_logger("compile_choice").info("vllm-omni-edge: %s", decision.reason)
    return decision


def apply() -> str:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "__edge_wrapped__", False):
        return "already wrapped"

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        from vllm_omni_edge.levers import EAGER_FOR_STACK_ATTR

        choose(self)
        config = original(self, *args, **kwargs)
        decision = getattr(self, ATTR)
        if decision.eager and config.model_config is not None:
            # Travels with the config to the worker: its evidence and the decoder stack read it.
            setattr(config.model_config, EAGER_FOR_STACK_ATTR, decision.reason)
        return config

    create_engine_config.__edge_wrapped__ = True
    EngineArgs.create_engine_config = create_engine_config
    return "eager where the decoder stack runs decode, unless the user says"
