"""Run vLLM's inductor fallback-list patch when inductor's lowering module loads, not at ``import vllm``.

What: ``vllm.env_override`` ends by calling its own ``_patch_inductor_fallback_allow_list()``,
which imports ``torch._inductor.lowering`` and ``torch._inductor.graph`` to wrap one list
(``FALLBACK_ALLOW_LIST``: vLLM's custom ops stay fallbacks in a compiled graph). While that
module's body runs, a finder first on ``sys.meta_path`` refuses those two modules, so the call
returns at its ``except ImportError`` (as vLLM wrote it to when inductor is missing). Once the
body has run, the finder is gone, and vLLM's same function is run when
``torch._inductor.lowering`` loads for whoever needs it: a compile, or the load of a compiled
graph. It runs right after lowering's body, before ``graph`` binds the list by name, so both
see vLLM's wrapper. If lowering was loaded before ``vllm``, the finder never acts and vLLM's
call wraps the list as it always did.
Why: the two modules pull in inductor's kernel templates, code cache and autotuner (most of
inductor's modules, a large share of ``from vllm import LLM``) into every process that imports
vLLM, although only a compile uses the list. An engine that does not compile never loads them.
Flag: ``VLLM_OMNI_EDGE_INDUCTOR_DEFERRED=0`` imports them with ``vllm`` (the A/B arm).
Verified by: tests/test_inductor_deferred.py (fresh interpreters: after ``from vllm import LLM``
lowering is not loaded; importing it afterwards leaves both names wrapped by vLLM's proxy; flag
off loads it with vllm); tests/e2e/test_compile_cache.py (a compiled start).
Remove when: vLLM wraps the list where it compiles (upstream: none found).
"""

from __future__ import annotations

import importlib.abc
import sys

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process
from vllm_omni_edge.patches.import_hook import InstallOnce

TARGET = "vllm.env_override"
LOWERING = "torch._inductor.lowering"
REFUSED = (LOWERING, "torch._inductor.graph")
VLLM_FUNCTION = "_patch_inductor_fallback_allow_list"

RECORD = PatchRecord(
    name="inductor_fallback_deferred",
    kind=Kind.LEVER,
    target=f"{TARGET}.{VLLM_FUNCTION} (run when {LOWERING} loads)",
    process=Process.WORKER,  # every interpreter that imports vLLM
    why="vllm.env_override imports inductor's lowering and graph modules (its kernel templates, code "
    "cache and autotuner) into every process to wrap one list only a compile reads.",
    verified_by="tests/test_inductor_deferred.py; tests/e2e/test_compile_cache.py (a compiled start).",
    remove_when="vLLM wraps FALLBACK_ALLOW_LIST where it compiles.",
    upstream="none found",
)

_once = InstallOnce()


class _Refuse(importlib.abc.MetaPathFinder):
    """Refuses inductor's lowering and graph modules while vllm.env_override's body runs."""

    def find_spec(self, fullname, path, target=None):
        if fullname in REFUSED:
            raise ImportError(f"{fullname}: deferred by vllm_omni_edge until a compile needs it")
        return None


_refuse = _Refuse()


def _supported(vllm_package) -> bool:
    return getattr(vllm_package, "__version__", None) in RECORD.vllm_versions


def _before(module) -> None:
    if _supported(sys.modules.get("vllm")):
        sys.meta_path.insert(0, _refuse)


def _run_vllm_patch(lowering_module) -> None:
    override = sys.modules.get(TARGET)
    function = getattr(override, VLLM_FUNCTION, None)
    if function is not None:
        function()  # vLLM's own, idempotent (a sentinel on its proxy)


def _after(module) -> None:
    from vllm_omni_edge.patches.import_hook import when_imported

    if _refuse not in sys.meta_path:
        return
    sys.meta_path.remove(_refuse)
    when_imported(LOWERING, _run_vllm_patch)


def install() -> str:
    """Cheap (imports nothing heavy); at interpreter start."""
    from vllm_omni_edge.levers import inductor_deferred_enabled
    from vllm_omni_edge.patches.import_hook import before_imported, when_imported

    refused = _once.refusal(inductor_deferred_enabled, "inductor's lowering imported with vllm")
    if refused:
        return refused
    if not before_imported(TARGET, _before):
        return "vllm was already imported: from the next start"
    when_imported(TARGET, _after)
    return f"{VLLM_FUNCTION} runs when {LOWERING} loads"


def apply() -> str:
    return install()
