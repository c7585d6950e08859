"""A progress line while the model is compiled for this machine (a first compiled start).

What: wraps ``vllm.compilation.wrapper.TorchCompileWithNoGuardsWrapper.aot_compile``, the
call that traces and compiles the model when vLLM finds no saved artifact (on CPU the
whole model is one dynamo graph compiled by inductor: a start that loads the artifact
never calls it). While it runs, a tqdm line on stderr shows the elapsed time and how many
C++ kernels inductor has handed to its compiler so far (counted by wrapping
``torch._inductor.async_compile.AsyncCompile.cpp_pybinding`` for the duration of the
call, and put back after). It appears after ``SHOW_AFTER_S`` seconds and closes with the
call, whether it returns or raises; the exception propagates unchanged.
Why: a machine's first compiled start spends one to two minutes in dynamo and inductor
with no output after "Warming up model for the compilation"; the serving start line says a
first start compiles, and this line shows it is moving.
Verified by: tests/test_compile_progress.py (the line counts kernels handed over and
closes; an error closes it and propagates; the kernel counter is put back; idempotence).
Remove when: vLLM reports compile progress itself.
"""

from __future__ import annotations

import threading

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm.compilation.wrapper"
BAR_DESCRIPTION = "compiling the model for this CPU (first start; later starts load it)"
SHOW_AFTER_S = 3.0
REFRESH_S = 1.0

RECORD = PatchRecord(
    name="compile_progress",
    kind=Kind.FIX,
    target=f"{TARGET_MODULE}.TorchCompileWithNoGuardsWrapper.aot_compile",
    process=Process.WORKER,
    why="A first compiled start spends one to two minutes in dynamo and inductor with no output; "
    "a progress line shows the elapsed time and the C++ kernels handed to the compiler.",
    verified_by="tests/test_compile_progress.py.",
    remove_when="vLLM reports compile progress itself.",
    upstream="none found",
)


def apply() -> str:
    now = when_imported(TARGET_MODULE, _wrap)
    return "progress line while the model compiles" + ("" if now else " (on import)")


class _KernelCounter:
    """Counts ``AsyncCompile.cpp_pybinding`` calls while installed; ``remove`` puts it back."""

    def __init__(self):
        self.count = 0
        try:
            from torch._inductor.async_compile import AsyncCompile
        except ImportError:
            self._owner = None
            return
        self._owner = AsyncCompile
        self._original = AsyncCompile.__dict__.get("cpp_pybinding")
        if self._original is None:
            self._owner = None
            return
        original = self._original

        def cpp_pybinding(async_compile, *args, **kwargs):
            self.count += 1
            return original(async_compile, *args, **kwargs)

        AsyncCompile.cpp_pybinding = cpp_pybinding

    def remove(self) -> None:
        if self._owner is not None:
            self._owner.cpp_pybinding = self._original
            self._owner = None


def _ticker(counter: _KernelCounter, done: threading.Event) -> None:
    from tqdm import tqdm

    if done.wait(SHOW_AFTER_S):
        return
    with tqdm(total=None, desc=BAR_DESCRIPTION, unit=" C++ kernels", initial=counter.count,
              bar_format="{desc}: {elapsed}, {n} C++ kernels") as bar:
        while not done.wait(REFRESH_S):
            bar.update(counter.count - bar.n)
        bar.update(counter.count - bar.n)


def _wrap(module) -> None:
    def make(original):
        def aot_compile(self, *args, **kwargs):
            counter = _KernelCounter()
            done = threading.Event()
            ticker = threading.Thread(target=_ticker, args=(counter, done), name="EdgeCompileProgress",
                                      daemon=True)
            ticker.start()
            try:
                return original(self, *args, **kwargs)
            finally:
                done.set()
                ticker.join()
                counter.remove()

        return aot_compile

    wrap_method_once(module.TorchCompileWithNoGuardsWrapper, "aot_compile", make)
