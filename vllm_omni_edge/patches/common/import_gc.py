"""Hold automatic garbage collection back while vLLM's package and its ``LLM`` module import.

What: a finder on ``sys.meta_path`` (installed at interpreter start by ``patches/early.py``)
pauses automatic collection just before the body of ``vllm`` runs, and again before the body of
``vllm.entrypoints.llm`` (what ``from vllm import LLM`` imports), and resumes it as each body
finishes: ``levers.startup_gc.pause(paused_for="import")`` in that lever's mode (``young`` by
default: the youngest generation is still collected, the older two are not scanned). A pause that
is already on (the CLI's for ``serve``) is left alone; a server's or an engine's pause that starts
during an import's ends the import's and takes over. A body that raises leaves the pause to the
lever's deadline.
Why: those two bodies import most of torch's compiler stack, transformers and vLLM: millions of
objects that live as long as the process. With collection on, CPython scans that growing heap
again each time it grows by a quarter, a large share of ``from vllm import LLM`` (the start-up
grid named under Verified by has the figures). The server's and the engine's start-up pauses
began after the import.
Flag: ``VLLM_OMNI_EDGE_IMPORT_GC=0`` leaves collection on during the imports (the A/B arm);
``VLLM_OMNI_EDGE_STARTUP_GC=0`` turns every start-up pause off, this one too.
Verified by: tests/test_import_gc.py (fresh interpreters: collection young inside the import and
as CPython's after it, both windows counted; flag off; a server pause kept; an engine pause taking
over restores CPython's thresholds); start-up-import-gc-default.yaml (the user's ``LLM()`` start
against the flag off; evidence ``startup_gc.import_pauses``).
Remove when: vLLM (or CPython) stops rescanning the import heap, e.g. a freeze after import.
"""

from __future__ import annotations

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process
from vllm_omni_edge.patches.import_hook import InstallOnce

MODULES = ("vllm", "vllm.entrypoints.llm")

RECORD = PatchRecord(
    name="import_gc",
    kind=Kind.LEVER,
    target="sys.meta_path (the bodies of vllm and vllm.entrypoints.llm)",
    process=Process.WORKER,  # every interpreter that imports vLLM
    why="Importing vLLM builds millions of long-lived objects, and automatic collection rescans that "
    "growing heap, a large share of `from vllm import LLM`; the start-up pauses began after the import.",
    verified_by="tests/test_import_gc.py; start-up-import-gc-default.yaml (evidence startup_gc.import_pauses).",
    remove_when="vLLM or CPython stops rescanning the import heap (a freeze after import).",
    upstream="none found",
)

_once = InstallOnce()


def _pause(module) -> None:
    from vllm_omni_edge.levers import startup_gc

    startup_gc.pause(paused_for=startup_gc.IMPORT)


def _resume(module) -> None:
    from vllm_omni_edge.levers import startup_gc

    startup_gc.resume(startup_gc.RESUMED_IMPORTED, only_if_paused_for=startup_gc.IMPORT)


def install() -> str:
    """Cheap (imports nothing heavy); at interpreter start and by ``apply``."""
    from vllm_omni_edge.levers import import_gc_enabled, startup_gc_enabled
    from vllm_omni_edge.patches.import_hook import before_imported, when_imported

    refused = _once.refusal(lambda: import_gc_enabled() and startup_gc_enabled(),
                            "collection as CPython's while vLLM imports")
    if refused:
        return refused
    watched = [name for name in MODULES if before_imported(name, _pause)]
    for name in watched:
        when_imported(name, _resume)
    if not watched:
        return "vLLM was already imported: from the next start"
    return "collection held back while " + " and ".join(watched) + " import"


def apply() -> str:
    return install()
