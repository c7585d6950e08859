"""The ``vllm`` console script: vLLM's own CLI, with the version lookup fixed first."""

from __future__ import annotations

import sys


def main() -> int | None:
    from vllm_omni_edge.patches import apply_cli_patches

    apply_cli_patches()
    from vllm.entrypoints.cli.main import main as vllm_main

    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
