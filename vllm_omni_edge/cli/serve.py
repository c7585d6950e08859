"""``vllm-omni-edge serve``: vLLM's OpenAI server with edge defaults.

Defaults differ from ``vllm serve`` only where an edge box needs it: bind to
127.0.0.1 unless told otherwise, serve the embedded default model when no model is
named, refuse bad request bodies before vLLM parses them (``request_guard``), fail in
one line when the port is taken, and exit non-zero when the engine dies (so a
supervisor restarts the server). Every other argument goes to vLLM unchanged.

The engine core and the model run on a thread of the API-server process by default
(patches/frontend/single_process.py); ``--multi-process`` (ours, not vLLM's) keeps vLLM's
three processes, ``--single-process`` insists on one. ``max_model_len`` and
``max_num_seqs`` get edge defaults (cli/serving_defaults.py), stated in one line at start.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from pathlib import Path

from vllm_omni_edge.cli.serving_defaults import has_option, named_model, option_value, serving_defaults
from vllm_omni_edge.cli.vllm_entry import asks_for_help

VLLM_DEFAULT_PORT = 8000
REQUEST_GUARD = "vllm_omni_edge.cli.request_guard.RequestGuard"
SINGLE_PROCESS_FLAG = "--single-process"
MULTI_PROCESS_FLAG = "--multi-process"


class ModelNotFoundError(SystemExit):
    """Exit with one line naming the missing model, not vLLM's traceback wall."""


class ServeSetupError(SystemExit):
    """Exit with one line naming the problem (port taken, bad setting) before vLLM starts."""


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


def check_port_free(host: str, port: int) -> None:
    """Fail in one line if vLLM could not bind ``host:port``.

    Binds the way vLLM does (``launcher.create_server_socket``: SO_REUSEADDR, so a
    port in TIME_WAIT is not reported as taken), then lets go. vLLM itself would say
    the same only as a traceback after its imports.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            where = f"{host or '0.0.0.0'}:{port}"
            if err.errno == errno.EADDRINUSE:
                raise ServeSetupError(
                    f"vllm-omni-edge serve: port {port} is already in use ({where}); "
                    "stop the program listening there or pass --port with a free port"
                ) from None
            raise ServeSetupError(
                f"vllm-omni-edge serve: cannot listen on {where}: {err.strerror}"
            ) from None


def _check_listen_address(args: list[str]) -> None:
    if has_option(args, "--uds"):
        return
    raw_port = option_value(args, "--port")
    try:
        port = VLLM_DEFAULT_PORT if raw_port is None else int(raw_port)
    except ValueError:
        return  # vLLM's parser names the bad value
    check_port_free(option_value(args, "--host") or "", port)


def _check_request_limit() -> None:
    from vllm_omni_edge.cli.request_guard import max_request_bytes

    try:
        max_request_bytes()
    except ValueError as err:
        raise ServeSetupError(f"vllm-omni-edge serve: {err}") from None


def _replace_model(args: list[str], old: str, new: str) -> list[str]:
    """``args`` with the model argument (the first positional, ``--model X`` or ``--model=X``)
    pointed at ``new``; other arguments equal to ``old`` (a ``--served-model-name``) stay."""
    out = list(args)
    if out and out[0] == old:
        out[0] = new
        return out
    for i, a in enumerate(out):
        if a == f"--model={old}":
            out[i] = f"--model={new}"
            return out
        if a == "--model" and i + 1 < len(out) and out[i + 1] == old:
            out[i + 1] = new
            return out
    return out


def edge_serve_argv(args: list[str]) -> list[str]:
    """The argv for vLLM's CLI: ``vllm serve`` plus our defaults."""
    from vllm_omni_edge.models.default_model import resolve_model_name

    args = list(args)
    model = named_model(args)
    cached = resolve_model_name(model) if model else None
    if cached is not None:
        # An embedded model name: serve its cached checkpoint (pull it first).
        if not (cached / "config.json").is_file():
            raise ModelNotFoundError(
                f"vllm-omni-edge serve: {model!r} is not built yet; run "
                f"`vllm-omni-edge models pull {model.removesuffix(':cpu_int4')}"
                f"{' --cpu-int4' if model.endswith(':cpu_int4') else ''}`"
            )
        args = _replace_model(args, model, str(cached))
        if not has_option(args, "--served-model-name"):
            args += ["--served-model-name", model]  # requests name the model as the user did
        model = str(cached)
    elif model is not None and Path(model).expanduser().suffix == ".gguf":
        # A GGUF file: serve the checkpoint built from it once (cached by its SHA-256).
        from vllm_omni_edge.models.gguf_serving import GgufServingError, serving_checkpoint
        from vllm_omni_edge.models.gguf_to_hf import UnsupportedCheckpointError

        try:
            built = serving_checkpoint(model)
        except (GgufServingError, UnsupportedCheckpointError) as err:
            raise ServeSetupError(f"vllm-omni-edge serve: {err}") from None
        args = _replace_model(args, model, str(built))
        if not has_option(args, "--served-model-name"):
            args += ["--served-model-name", Path(model).name]
        model = str(built)
    if model is None:
        from vllm_omni_edge.models.default_model import pull_default_model

        args.insert(0, str(pull_default_model()))
    elif not asks_for_help(args):
        check_local_model(model)
    if not has_option(args, "--host"):
        args += ["--host", "127.0.0.1"]
    args += ["--middleware", REQUEST_GUARD]
    return ["vllm", "serve", *args]


def take_layout_flag(args: list[str]) -> tuple[list[str], bool | None]:
    """``args`` without our layout flags, and True (``--single-process``), False
    (``--multi-process``) or None (neither: the default, one process when it can)."""
    single, multi = SINGLE_PROCESS_FLAG in args, MULTI_PROCESS_FLAG in args
    if single and multi:
        raise ServeSetupError(f"vllm-omni-edge serve: {SINGLE_PROCESS_FLAG} and {MULTI_PROCESS_FLAG} "
                              "ask for two layouts; give one")
    kept = [a for a in args if a not in (SINGLE_PROCESS_FLAG, MULTI_PROCESS_FLAG)]
    return kept, True if single else False if multi else None


def _select_process_layout(single_process: bool | None) -> None:
    """Set the layout flag before vLLM is imported; refuse a contradictory pair of flags."""
    from vllm_omni_edge import envs
    from vllm_omni_edge.levers import SINGLE_PROCESS_ENV, single_process_enabled

    if single_process is not None:
        envs.set_env(SINGLE_PROCESS_ENV, single_process)
    try:
        single_process_enabled()
    except envs.FlagError as err:
        raise ServeSetupError(f"vllm-omni-edge serve: {err}") from None


def build_kernels_if_missing() -> bool:
    """Our front ends build a missing C++ kernel library before the engine loads (a load never
    compiles: kernels/native.py); each step on stderr."""
    from vllm_omni_edge.quantization.kernels import native

    return native.build_if_missing(lambda line: print(f"vllm-omni-edge: {line}", file=sys.stderr, flush=True))


def serve(args: list[str]) -> int | None:
    from vllm_omni_edge.cli.vllm_entry import main as vllm_main, pause_collection_for_start

    args, single_process = take_layout_flag(args)
    argv = edge_serve_argv(args)  # may build the default model: not paused for that
    if not asks_for_help(args):
        # Before the first heavy import (plugin selection's transformers).
        pause_collection_for_start("vllm-omni-edge serve")
        _select_process_layout(single_process)
        args_with_defaults, stated = serving_defaults(argv[2:], "vllm-omni-edge serve")
        argv = ["vllm", "serve", *args_with_defaults]
        _check_request_limit()
        _check_listen_address(argv[2:])
        build_kernels_if_missing()
        print(stated, file=sys.stderr, flush=True)
    sys.argv = argv
    return vllm_main(apply_serving_defaults=False)  # exits non-zero if the engine died (vllm_entry.main)
