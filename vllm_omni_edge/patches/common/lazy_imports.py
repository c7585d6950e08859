"""Defer the media and solver packages a CPU text model never runs; hide triton on CPU torch.

What: a finder first on ``sys.meta_path`` (installed at interpreter start by
``patches/early.py``) does two things.

- Deferred packages (:data:`DEFERRED`): ``import av`` and the like bind a module object
  whose body has not run. The first attribute it does not have (``av.open``, ``from av
  import X``) runs the real body in that same object, parents first, so every name bound
  earlier is the loaded module. Submodules imported while their package is still deferred
  are deferred with it. A few functions importers take by name at import time
  (:data:`DEFERRED_CALLABLES`, ``from scipy.optimize import linear_sum_assignment``) are
  handed out as thin callables that load the package on the first call.
- Hidden packages (:data:`HIDDEN_WITHOUT_GPU`): when the installed torch is a CPU-only
  build, ``sys.modules['triton'] = None``, so ``import triton`` raises ImportError and
  ``importlib.util.find_spec('triton')`` is None.
Why: a CPU text model never decodes media (PyAV, OpenCV, ``scipy.signal``) and never runs a
detection loss (``scipy.optimize`` via transformers' loss table); vLLM and transformers import
them at module level all the same. Triton cannot run
a kernel without a GPU driver; on this wheel vLLM already disables it (no CPU backend),
but ``torch._dynamo`` imports it whole to read one dtype class.
Flag: ``VLLM_OMNI_EDGE_LAZY_IMPORTS=0`` imports everything as vLLM does (the A/B arm).
Verified by: tests/test_lazy_imports.py (fresh interpreters: not loaded after
``from vllm import LLM``, loaded and working on first use, submodules, the callables, the
flag off); tests/e2e/test_lazy_imports_llm.py (LLM() answers with the hook on, the same
greedy text as with it off).
Not deferred, because their importers take classes by name at import time (a stand-in
would break ``isinstance`` and module-level instances): the OpenAI client types
(``vllm.entrypoints.chat_utils``), xgrammar (``vllm.parser.harmony``) and torchvision
(``transformers.image_utils``).
Remove when: vLLM imports its media decoders where they are used, and torch reads
triton's dtype only when triton is used.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
from types import ModuleType

from vllm_omni_edge.levers import LAZY_IMPORTS_ENV, lazy_imports_enabled
from vllm_omni_edge.patches.base import Kind, PatchRecord, Process

RECORD = PatchRecord(
    name="lazy_imports",
    kind=Kind.LEVER,
    upstream="none found",
    target="sys.meta_path (modules av, cv2, scipy.signal, scipy.optimize: body run on first "
    "attribute use; triton hidden when torch is a CPU-only build)",
    process=Process.WORKER,
    why="vLLM and transformers import media decoders (PyAV, OpenCV, scipy.signal) and a "
    "detection-loss solver (scipy.optimize) at module level, and torch._dynamo imports triton "
    "whole; a CPU text model runs none of them, yet they are resident in every process.",
    verified_by="tests/test_lazy_imports.py (fresh interpreters: deferred after "
    "`from vllm import LLM`, loaded and working on first use, flag off imports eagerly); "
    "tests/e2e/test_lazy_imports_llm.py (LLM() greedy text identical on/off). Zen 4 box, "
    "direct probes (docs/edge/memory.md): `from vllm import LLM` RSS 686 -> 515 MiB, PSS about "
    "-105 MiB; SmolLM2 cpu_int4 LLM(max_model_len=2048) + 64 tokens RSS 946 -> 776 MiB, PSS "
    "750-799 -> 670-693 MiB; vllm serve PSS 774 -> 671 MiB.",
    remove_when="vLLM imports media decoders where they are used, and torch._dynamo stops "
    "importing triton to read triton.language.dtype.",
    vllm_versions=("0.30.0",),
)

# Package -> who imports it at module level on the text path, and what for.
DEFERRED: dict[str, str] = {
    "av": "vllm.multimodal.audio (audio and video decoding)",
    "cv2": "vllm.multimodal.video (video frames)",
    "scipy.signal": "vllm.multimodal.audio (audio resampling)",
    "scipy.optimize": "transformers.loss (Hungarian matching of detection losses)",
}
# Names importers take from a deferred module at import time and only ever call.
DEFERRED_CALLABLES: dict[str, frozenset[str]] = {
    "scipy.optimize": frozenset({"linear_sum_assignment"}),
}
HIDDEN_WITHOUT_GPU: tuple[str, ...] = ("triton",)

_lock = threading.RLock()
_loading: set[str] = set()  # names whose real body is running (in any thread, under _lock)
_installed = False


def enabled() -> bool:
    return lazy_imports_enabled()


class DeferredModule(ModuleType):
    """A module whose body has not run yet; a missing attribute runs it."""

    def __getattr__(self, attr: str):
        name = self.__dict__.get("__name__", "")
        callables = DEFERRED_CALLABLES.get(name)
        if callables and attr in callables and not attr.startswith("__"):
            return _deferred_callable(self, attr)
        if attr.startswith("__") and attr.endswith("__") and attr not in ("__all__", "__version__"):
            raise AttributeError(attr)  # probes (copy, pickle, inspect) do not load the body
        load(self)
        if isinstance(self, DeferredModule):  # its own body is running: not there yet
            raise AttributeError(f"partially initialized module {name!r} has no attribute {attr!r}")
        return getattr(self, attr)


def is_deferred(module) -> bool:
    return isinstance(module, DeferredModule)


def load(module: ModuleType) -> ModuleType:
    """Run a deferred module's real body (its deferred parents first); no-op once loaded."""
    with _lock:
        name = module.__dict__["__name__"]
        if not isinstance(module, DeferredModule) or name in _loading:
            return module
        parent = name.rpartition(".")[0]
        if parent and isinstance(sys.modules.get(parent), DeferredModule):
            load(sys.modules[parent])
            if not isinstance(module, DeferredModule):  # the parent's body loaded it
                return module
        spec = module.__spec__
        real_loader = spec.loader.real_loader
        spec.loader = real_loader
        module.__loader__ = real_loader
        _loading.add(name)
        try:
            real_loader.exec_module(module)
        except BaseException:
            module.__class__ = ModuleType
            sys.modules.pop(name, None)  # as a failed import leaves it: retried on next import
            raise
        finally:
            _loading.discard(name)
        if sys.modules.get(name) is not module and sys.modules.get(name) is not None:
            module.__dict__.update(sys.modules[name].__dict__)  # the body replaced itself
            sys.modules[name] = module
        module.__class__ = ModuleType
        return module


def _deferred_callable(module: DeferredModule, attr: str):
    def call(*args, **kwargs):
        return getattr(load(module), attr)(*args, **kwargs)

    call.__name__ = call.__qualname__ = attr
    call.__module__ = module.__name__
    call.__edge_deferred__ = True
    return call


class _DeferredLoader(importlib.abc.Loader):
    def __init__(self, real_loader):
        self.real_loader = real_loader

    def create_module(self, spec):
        return None  # a plain module; exec_module turns it into a DeferredModule

    def exec_module(self, module):
        module.__class__ = DeferredModule


class _Finder(importlib.abc.MetaPathFinder):
    """Hands out deferred specs for :data:`DEFERRED` and submodules of deferred packages."""

    _asking = threading.local()  # names this thread is looking up through the other finders

    def find_spec(self, fullname, path, target=None):
        asking = self._asking.__dict__.setdefault("names", set())
        if fullname in asking or not _should_defer(fullname):
            return None  # a finder that asks the others (import_hook's) must not loop back here
        asking.add(fullname)
        try:
            spec = next((found for finder in sys.meta_path
                         if finder is not self and hasattr(finder, "find_spec")
                         and (found := finder.find_spec(fullname, path, target)) is not None), None)
        finally:
            asking.discard(fullname)
        if spec is None:
            return None
        # Only pure-Python bodies can wait; an extension module loads in create_module,
        # so its deferred package runs first, as an eager import would have it.
        if not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            parent = sys.modules.get(fullname.rpartition(".")[0])
            if isinstance(parent, DeferredModule):
                load(parent)
                if fullname in sys.modules:
                    return _existing_spec(sys.modules[fullname])
            return spec
        spec.loader = _DeferredLoader(spec.loader)
        return spec


class _ExistingLoader(importlib.abc.Loader):
    """Hands the import system a module that a package body imported meanwhile."""

    def __init__(self, module):
        self.module, self.spec = module, module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        module.__spec__ = self.spec


def _existing_spec(module):
    return importlib.machinery.ModuleSpec(module.__name__, _ExistingLoader(module),
                                          is_package=hasattr(module, "__path__"))


def _should_defer(fullname: str) -> bool:
    if fullname in _loading:
        return False  # a body that re-imports itself (cv2's loader) gets the real module
    if fullname in DEFERRED:
        parent = fullname.rpartition(".")[0]
        return not parent or parent not in _loading
    parent = fullname.rpartition(".")[0]
    return bool(parent) and parent not in _loading and isinstance(sys.modules.get(parent), DeferredModule)


_finder = _Finder()


def torch_is_cpu_only() -> bool:
    """Whether the installed torch is built without CUDA, ROCm and XPU, read without importing it."""
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None) if torch is not None else None
    if version is not None:
        return not (getattr(version, "cuda", None) or getattr(version, "hip", None)
                    or getattr(version, "xpu", None))
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    fields: dict = {}
    try:
        with open(os.path.join(spec.submodule_search_locations[0], "version.py")) as f:
            for line in f:
                key, sep, value = line.partition("=")
                key = key.split(":")[0].strip()
                if sep and key in ("cuda", "hip", "xpu"):
                    fields[key] = value.strip()
    except OSError:
        return False
    return set(fields) >= {"cuda", "hip"} and all(v == "None" for v in fields.values())


def install() -> str:
    """Cheap (reads torch/version.py, imports nothing heavy); at interpreter start and by ``apply``."""
    global _installed
    with _lock:
        if _installed:
            return "hook already installed"
        if not enabled():
            _installed = True
            return f"{LAZY_IMPORTS_ENV}=0: packages imported as vLLM does"
        done = []
        if torch_is_cpu_only():
            hidden = [n for n in HIDDEN_WITHOUT_GPU if n not in sys.modules]
            for name in hidden:
                sys.modules[name] = None
            if hidden:
                done.append("hidden (CPU-only torch): " + ", ".join(hidden))
        late = [n for n in DEFERRED if n in sys.modules]
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        done.append("deferred: " + ", ".join(n for n in DEFERRED if n not in late))
        if late:
            done.append("already imported: " + ", ".join(late))
        _installed = True
    return "; ".join(done)


def apply() -> str:
    return install()
