"""Make ``import torchaudio`` resolve to the fallback package when no real torchaudio exists.

The finder is appended to the END of ``sys.meta_path``: Python asks it only
after every normal finder failed to locate ``torchaudio``, so an installed,
working torchaudio always wins and nothing changes for it.

Served modules are executed from this package's source files under their
``torchaudio...`` names (a fresh module per name, ``__file__`` inside this
package), so ``import torchaudio.functional``, ``from torchaudio.functional
import melscale_fbanks`` and ``from torchaudio import transforms`` behave as
with the real package. The ``torchaudio`` package gets an empty ``__path__``:
only the names listed in ``_SERVED`` exist, so ``torchaudio.compliance`` and
friends still raise ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from pathlib import Path

__all__ = ["TorchaudioFallbackFinder", "install", "is_real_torchaudio_available", "uninstall"]

_PKG_DIR = Path(__file__).resolve().parent
_SERVED = {
    "torchaudio": "__init__.py",
    "torchaudio._io": "_io.py",
    "torchaudio.functional": "functional.py",
    "torchaudio.transforms": "transforms.py",
}
# Attribute set on the finder class: recognises an installed finder even if this
# module was imported twice under different names.
_MARKER = "_vllm_omni_edge_torchaudio_fallback"
_lock = threading.Lock()


def _is_fallback_module(module) -> bool:
    return bool(getattr(module, "__vllm_omni_edge_fallback__", False))


class TorchaudioFallbackFinder(importlib.abc.MetaPathFinder):
    """Serves ``torchaudio``, ``torchaudio.functional``, ``torchaudio.transforms`` from this package."""

    _vllm_omni_edge_torchaudio_fallback = True

    def find_spec(self, fullname, path=None, target=None):
        filename = _SERVED.get(fullname)
        if filename is None:
            return None
        if fullname != "torchaudio" and not _is_fallback_module(sys.modules.get("torchaudio")):
            # A submodule missing from a *real* torchaudio must not be filled in from here.
            return None
        location = str(_PKG_DIR / filename)
        loader = importlib.machinery.SourceFileLoader(fullname, location)
        return importlib.util.spec_from_file_location(
            fullname,
            location,
            loader=loader,
            submodule_search_locations=[] if fullname == "torchaudio" else None,
        )

    def __repr__(self) -> str:
        return f"<TorchaudioFallbackFinder serving torchaudio from {_PKG_DIR}>"


def _is_ours(finder) -> bool:
    return bool(getattr(finder, _MARKER, False))


def _find_real_spec():
    """Ask every other meta-path finder for ``torchaudio`` without importing it."""
    for finder in list(sys.meta_path):
        if _is_ours(finder):
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec("torchaudio", None)
        except Exception:  # a misbehaving third-party finder must not break the check
            continue
        if spec is not None:
            return spec
    return None


def is_real_torchaudio_available() -> bool:
    """True when a torchaudio other than this fallback is imported or findable.

    Uses the finders' ``find_spec`` only; the package is not imported, so a
    real but broken install (for example a torch ABI mismatch) still counts.
    """
    module = sys.modules.get("torchaudio")
    if module is not None:
        return not _is_fallback_module(module)
    return _find_real_spec() is not None


def _real_version() -> str:
    module = sys.modules.get("torchaudio")
    if module is not None and getattr(module, "__version__", None):
        return str(module.__version__)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchaudio")
    except PackageNotFoundError:
        return "(unknown version)"


def install() -> str:
    """Append the fallback finder once; describe which torchaudio ``import torchaudio`` will give."""
    with _lock:
        if not any(_is_ours(f) for f in sys.meta_path):
            sys.meta_path.append(TorchaudioFallbackFinder())
    if is_real_torchaudio_available():
        return f"real torchaudio {_real_version()} importable; fallback finder inactive"
    return f"fallback installed: torchaudio -> {_PKG_DIR} (soundfile + soxr)"


def uninstall() -> None:
    """Remove the finder (for tests); modules already imported stay in ``sys.modules``."""
    with _lock:
        sys.meta_path[:] = [f for f in sys.meta_path if not _is_ours(f)]
