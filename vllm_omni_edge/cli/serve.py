"""``vllm-omni-edge serve``: vLLM's OpenAI server with edge defaults.

Defaults differ from ``vllm serve`` only where an edge box needs it: bind to
127.0.0.1 unless told otherwise, and serve the embedded default model when no
model is named. Every other argument goes to vLLM unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path


class ModelNotFoundError(SystemExit):
    """Exit with one line naming the missing model, not vLLM's traceback wall."""


def _named_model(args: list[str]) -> str | None:
    if args and not args[0].startswith("-"):
        return args[0]
    for i, a in enumerate(args):
        if a.startswith("--model="):
            return a.split("=", 1)[1]
        if a == "--model" and i + 1 < len(args):
            return args[i + 1]
    return None


def check_local_model(model: str) -> None:
    """Edge boxes load weights only from local files: a model directory or a .gguf file."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"vllm-omni-edge serve: {path} is not a model directory (no config.json)"
            )
        return
    raise ModelNotFoundError(
        f"vllm-omni-edge serve: model {model!r} does not exist as a local directory. "
        "This build loads weights only from local files; run "
        "`vllm-omni-edge models pull-default` for the default model."
    )


def _has_option(args: list[str], option: str) -> bool:
    return any(a == option or a.startswith(option + "=") for a in args)


def edge_serve_argv(args: list[str]) -> list[str]:
    """The argv for vLLM's CLI: ``vllm serve`` plus our defaults."""
    args = list(args)
    model = _named_model(args)
    if model is None:
        from vllm_omni_edge.models.default_model import pull_default_model

        args.insert(0, str(pull_default_model()))
    elif not any(a in ("-h", "--help") or a.startswith("--help=") for a in args):
        check_local_model(model)
    if not _has_option(args, "--host"):
        args += ["--host", "127.0.0.1"]
    return ["vllm", "serve", *args]


def serve(args: list[str]) -> int | None:
    from vllm_omni_edge.cli.vllm_entry import main as vllm_main

    sys.argv = edge_serve_argv(args)
    return vllm_main()
