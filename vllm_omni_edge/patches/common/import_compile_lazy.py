"""Decorate vLLM's module-level ``torch.compile`` functions without loading the compiler.

What: once torch has imported, ``torch.compile`` is wrapped. A call made from a library module's
body or a class body in one (code that runs as the module imports: a decorator or an assignment)
on a plain function, or with arguments only (``@torch.compile(dynamic=True, ...)``), returns the
function wrapped instead: its first call compiles it with the same arguments (``torch.compile``
itself) and every call runs the compiled function, as the decorated name would have. Any other
call (on a module, from a function at run time, from a script's ``__main__``) is
``torch.compile``'s own.
Why: ``torch.compile`` asks its backend for its configuration when it decorates, and inductor's
answer imports ``torch._inductor.compile_fx`` and the whole compiler (most of inductor's modules,
a large share of ``from vllm import LLM``). vLLM and its dependencies decorate helpers at import in
modules every engine loads (``vocab_parallel_embedding``, ``deep_gemm``, the sampler's ops,
compressed-tensors' FP4 type): a process that never compiles still loaded the compiler. torch.compile compiles on the first call anyway; only the
configuration lookup moves.
Flag: ``VLLM_OMNI_EDGE_INDUCTOR_DEFERRED=0`` decorates as vLLM does (the A/B arm).
Verified by: tests/test_inductor_deferred.py (fresh interpreters: after ``from vllm import LLM``
and an eager engine's start, compile_fx not loaded; vLLM's helpers are the wrappers and a wrapper
compiles on first call with the decorator's arguments; modules and calls from functions get
torch.compile's own result; flag off).
Remove when: vLLM compiles its helpers where they are first used, or torch.compile stops loading
the backend at decoration (upstream: none found).
"""

from __future__ import annotations

import functools
import sys
import threading

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process
from vllm_omni_edge.patches.import_hook import InstallOnce

MARKER = "__edge_compile_lazy__"

RECORD = PatchRecord(
    name="import_compile_lazy",
    kind=Kind.LEVER,
    target="torch.compile (calls from module and class bodies as a library imports)",
    process=Process.WORKER,  # every interpreter that imports vLLM
    why="vLLM and its dependencies decorate helpers with torch.compile at import, and decorating asks inductor for its "
    "configuration, which imports the whole compiler into every vLLM process, compiling or not.",
    verified_by="tests/test_inductor_deferred.py.",
    remove_when="vLLM compiles its helpers on first use, or torch.compile stops loading the backend "
    "when it decorates.",
    upstream="none found",
    package="torch",  # what it wraps: torch.compile's signature and decoration
    vllm_versions=("2.13.0+cpu",),
)

_once = InstallOnce()


def _from_import_time_body(frame) -> bool:
    """A library module's body or a class body in one: code that runs as the module imports."""
    if frame is None or frame.f_globals.get("__name__", "__main__") == "__main__":
        return False
    if frame.f_code.co_name == "<module>":
        return True
    local = frame.f_locals
    return "__module__" in local and "__qualname__" in local  # a class body


def _compile_on_first_call(real, fn, kwargs):
    compiled = []
    compile_lock = threading.Lock()

    @functools.wraps(fn)
    def first_call_compiles(*args, **kw):
        if not compiled:
            with compile_lock:
                if not compiled:
                    compiled.append(real(fn, **kwargs))
        return compiled[0](*args, **kw)

    setattr(first_call_compiles, MARKER, True)
    return first_call_compiles


def lazy_compile(real):
    """``real`` (torch.compile) for every call but an import-time body's on a function."""
    import torch

    def compile(model=None, **kwargs):
        if not _from_import_time_body(sys._getframe(1)):
            return real(model, **kwargs) if model is not None else real(**kwargs)
        if model is None:  # @torch.compile(...) with arguments: the decorator it returns
            return lambda fn: (_compile_on_first_call(real, fn, kwargs) if callable(fn)
                               and not isinstance(fn, torch.nn.Module) else real(fn, **kwargs))
        if isinstance(model, torch.nn.Module) or not callable(model):
            return real(model, **kwargs)
        return _compile_on_first_call(real, model, kwargs)

    compile.__wrapped__ = real
    setattr(compile, MARKER, True)
    return compile


def _wrap(torch_module) -> None:
    if getattr(torch_module.compile, MARKER, False):
        return
    if getattr(torch_module, "__version__", None) not in RECORD.vllm_versions:
        return  # another torch: its torch.compile as it is
    torch_module.compile = lazy_compile(torch_module.compile)


def install() -> str:
    """Cheap (imports nothing heavy); at interpreter start."""
    from vllm_omni_edge.levers import inductor_deferred_enabled
    from vllm_omni_edge.patches.import_hook import when_imported

    refused = _once.refusal(inductor_deferred_enabled, "vLLM's module-level torch.compile as torch's")
    if refused:
        return refused
    when_imported("torch", _wrap)
    return "vLLM's module-level torch.compile functions compile on first call"


def apply() -> str:
    return install()
