"""The ``vllm`` console script: vLLM's own CLI, with our CLI patches applied first.

Besides the version lookup fix, it exits non-zero when the server stopped because
the engine died (patches/frontend/engine_death_exit.py), for plain ``vllm serve``
as for ``vllm-omni-edge serve``, so a supervisor restarts either. ``vllm serve`` gets the
same edge serving defaults as ``vllm-omni-edge serve`` (cli/serving_defaults.py), stated in
one line; the user's flags win. Both leave vLLM-Omni's general plugin out for a model it does
not register (``plugin_selection.py``).
"""

from __future__ import annotations

import sys


def main(apply_serving_defaults: bool = True) -> int | None:
    """``apply_serving_defaults=False``: the caller (``vllm-omni-edge serve``) applied them already."""
    from vllm_omni_edge.patches import apply_cli_patches
    from vllm_omni_edge.patches.early import install_interpreter_hooks
    from vllm_omni_edge.patches.frontend.startup_gc import resume_unless_in_force

    if starts_a_server(sys.argv[1:]):
        pause_collection_for_start("vllm serve")
        if apply_serving_defaults:
            from vllm_omni_edge.cli.serving_defaults import serving_defaults

            sys.argv[2:], stated = serving_defaults(sys.argv[2:], "vllm serve")
            print(stated, file=sys.stderr, flush=True)
        select_plugins(sys.argv[2:], "vllm serve" if apply_serving_defaults else "vllm-omni-edge serve")
    install_interpreter_hooks()  # a venv set up without scripts/setup.sh's .pth
    apply_cli_patches()
    resume_unless_in_force()  # nothing would turn collection back on
    from vllm.entrypoints.cli.main import main as vllm_main

    code = vllm_main()
    from vllm_omni_edge.patches.frontend.engine_death_exit import ENGINE_DEATH_EXIT_CODE, engine_died

    if engine_died():
        print("vllm-omni-edge: the inference engine died (see the log above); exiting with status "
              f"{ENGINE_DEATH_EXIT_CODE} so a supervisor can restart the server", file=sys.stderr)
        return ENGINE_DEATH_EXIT_CODE
    return code


def pause_collection_for_start(program: str) -> None:
    """levers/startup_gc.py's pause; a bad flag value is a one-line error, not a traceback."""
    from vllm_omni_edge import envs
    from vllm_omni_edge.levers import startup_gc

    try:
        startup_gc.pause()
    except envs.FlagError as err:
        raise SystemExit(f"{program}: {err}") from None


def select_plugins(args: list[str], program: str) -> None:
    """Leave vLLM-Omni's general plugin out for a model it does not register (plugin_selection).

    Here, not in a patch: vLLM's argument parser loads the general plugins before it reads
    the model.
    """
    import os

    from vllm_omni_edge.cli.serving_defaults import named_model
    from vllm_omni_edge.plugin_selection import text_model_plugins

    model = named_model(args)
    plugins = text_model_plugins(model, os.environ) if model else None
    if plugins is not None:
        os.environ["VLLM_PLUGINS"] = plugins
        print(f"{program}: VLLM_PLUGINS={plugins} (the model is not a vLLM-Omni "
              "architecture; set VLLM_PLUGINS to choose yourself)", file=sys.stderr)


def asks_for_help(args: list[str]) -> bool:
    return any(a in ("-h", "--help") or a.startswith("--help=") for a in args)


def starts_a_server(args: list[str]) -> bool:
    """``vllm serve ...``, not its help: the start the startup_gc lever is for."""
    return args[:1] == ["serve"] and not asks_for_help(args)


if __name__ == "__main__":
    sys.exit(main())
