"""Run a patch when its target module is first imported, not before.

Worker-side targets (``vllm.v1.worker.*``) are never imported by the front end;
importing them there just to patch them would cost it ~0.6 s and ~18 MiB (measured
with USS on this box). So those patches wait for the import (``when_imported``).
A few must run just *before* a module's body does (``before_imported``), e.g. to
declare op schemas the module's own code registers fakes for.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Callable

_callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}  # after the body runs
_before: dict[str, list[Callable[[ModuleType], None]]] = {}  # before it runs
_lock = threading.Lock()


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of watched modules."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _callbacks and fullname not in _before:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original_exec = loader.exec_module

        def exec_module(module):
            with _lock:
                before = _before.pop(fullname, [])
            for callback in before:
                callback(module)
            original_exec(module)
            with _lock:
                callbacks = _callbacks.pop(fullname, [])
            for callback in callbacks:
                callback(module)

        loader.exec_module = exec_module
        return spec


_finder = _PostImportFinder()


def when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> bool:
    """Call ``callback(module)`` now if imported (returns True), else after its import."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return True
    _register(_callbacks, module_name, callback)
    return False


def before_imported(module_name: str, callback: Callable[[ModuleType], None]) -> bool:
    """Call ``callback(module)`` just before the module's body first runs.

    Returns False, calling nothing, if the module is already imported (too late).
    """
    if module_name in sys.modules:
        return False
    _register(_before, module_name, callback)
    return True


def _register(table: dict, module_name: str, callback: Callable[[ModuleType], None]) -> None:
    with _lock:
        table.setdefault(module_name, []).append(callback)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


class InstallOnce:
    """An interpreter-start hook's guard: installed at most once, and only with its flag on.

    :meth:`refusal` is None the first time with the flag on; else why not (already installed,
    the flag off, or its bad value named: at interpreter start a raise would skip the other
    hooks and print a traceback in every Python process; the CLI and ``doctor`` refuse the
    value with this same message)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._installed = False

    def refusal(self, enabled: Callable[[], bool], off: str) -> str | None:
        from vllm_omni_edge import envs

        with self._lock:
            if self._installed:
                return "already installed"
            self._installed = True
        try:
            on = enabled()
        except envs.FlagError as err:
            return f"{off}: {err}"
        return None if on else f"{off} (flag)"
