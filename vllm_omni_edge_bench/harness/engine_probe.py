"""What the one-engine decode tools share: their command line, the engine core, the artifact.

``decode_decompose`` and ``step_ab`` each build ``LLM(model=CKPT, **llm_kwargs)`` in their own
process as the README's command does and time its engine steps. This module holds the options
they both take (``--model``, ``--llm-kwargs``, ``--rounds``, ``--gen-tokens``, ``--out``) with
their checks, the lookup of the engine core that runs in the calling process, the switch that
sends decode steps back through vLLM's compiled forward, and the atomic write of a
``<stem>.json`` + ``<stem>.md`` artifact.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from vllm_omni_edge_bench.harness import provenance


def add_arguments(parser: argparse.ArgumentParser, *, rounds: int, out_default: str) -> None:
    parser.add_argument("--model", default="default:cpu_int4", help="checkpoint dir or NAME[:cpu_int4]")
    parser.add_argument("--llm-kwargs", default='{"max_model_len": 512}',
                        help="JSON: LLM() keyword arguments besides model (the README's command by default)")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None, help=f"artifact directory [{out_default}]")


def parse(parser: argparse.ArgumentParser, args: argparse.Namespace,
          default_out: Callable[[], Path]) -> tuple[str, dict[str, Any], Path]:
    """The model directory, the LLM() keyword arguments and an empty output directory; a bad one is
    a parser error naming it."""
    if args.rounds < 3:
        parser.error(f"--rounds must be at least 3 (medians of 3 or more), got {args.rounds}")
    if args.gen_tokens < 16:
        parser.error(f"--gen-tokens must be at least 16, got {args.gen_tokens}")
    try:
        llm_kwargs = json.loads(args.llm_kwargs)
    except json.JSONDecodeError as error:
        parser.error(f"--llm-kwargs is not JSON: {error}")
    if not isinstance(llm_kwargs, dict) or "model" in llm_kwargs:
        parser.error("--llm-kwargs must be a JSON object without 'model' (use --model)")
    from vllm_omni_edge_bench.harness.grid import resolve_model

    model = resolve_model(args.model)
    if not Path(model).is_dir():
        parser.error(f"model {model} does not exist (build it with `vllm-omni-edge models pull ...`)")
    out = args.out or default_out()
    if out.exists() and any(out.iterdir()):
        parser.error(f"{out} is not empty; artifacts are never overwritten")
    return model, llm_kwargs, out


def without_decoder_stack() -> bool:
    """Decode steps through vLLM's compiled forward for the rest of this process (whether the
    decoder stack was in force): a tool that stubs or switches something inside that forward
    measures nothing while the stack runs the decode steps."""
    from vllm_omni_edge.patches.worker import decoder_stack

    if not decoder_stack.in_force():
        return False
    from vllm.v1.worker import gpu_model_runner

    runner = gpu_model_runner.GPUModelRunner
    runner._model_forward = runner._model_forward.__wrapped__
    return True


def in_process_core(llm, error: type[Exception], why: str):
    """The EngineCore that runs ``llm``'s steps in this process; ``error(...)`` when it runs elsewhere."""
    from vllm.v1.engine.core import EngineCore

    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    if not isinstance(core, EngineCore):
        raise error(f"the engine does not run in this process (vLLM's multiprocess layout?); {why}")
    return core


def record_start(module: str, argv: list[str] | None) -> dict[str, Any]:
    argv_record = sys.argv if argv is None else ["-m", module, *argv]
    return {"provenance": provenance.collect(grid_text="", argv=argv_record)}


def save(out: Path, stem: str, record: dict[str, Any], markdown: Callable[[dict[str, Any]], str]) -> None:
    """Write ``<stem>.json`` and ``<stem>.md`` into ``out`` at once, then print the report and the path."""
    from vllm_omni_edge.atomic import atomic_directory

    record["provenance"]["finished"] = provenance.now_iso()
    with atomic_directory(out) as work:
        (work / f"{stem}.json").write_text(json.dumps(record, indent=2, default=str))
        (work / f"{stem}.md").write_text(markdown(record))
    print((out / f"{stem}.md").read_text())
    print(out)
