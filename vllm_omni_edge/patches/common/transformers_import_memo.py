"""transformers' two import-time scans remembered across starts, keyed on what they read.

What: installed at interpreter start (``patches/early.py``), two memos on disk under the cache's
``imports/`` directory:

- ``importlib.metadata.packages_distributions()``, which ``transformers.utils.import_utils`` calls
  in its module body (reading every installed distribution's file list): the mapping is kept
  keyed on the ``.dist-info`` / ``.egg-info`` entries of ``sys.path`` (paths and mtimes);
- ``transformers.utils.import_utils.define_import_structure`` for transformers' ``models``
  directory, which ``transformers/__init__`` calls at import and ``transformers.models``' own
  ``__init__`` calls again (unprefixed) when it is first imported (each reading every model
  file's source for its ``__all__``): wrapped when that module has run, before ``transformers/__init__`` binds
  the name; the structure is kept keyed on transformers' version and the directory's ``.py``
  files (paths, sizes, mtimes). Other calls (one model's package, such as ``models/qwen2``) go to
  transformers' function; with a transformers other than 5.x it is not wrapped.

A memo that is missing, unreadable or for another key is recomputed by the original function
and written whole (``atomic.py``); every call returns new objects, as a first call does.
Why: together about half of ``import transformers`` in every process that imports it (``vllm
serve``, ``LLM()``, each vLLM worker), spent re-reading files that change only when packages are
installed.
Flag: ``VLLM_OMNI_EDGE_IMPORT_MEMO=0`` scans at every import, as transformers does (the A/B arm).
Verified by: tests/test_transformers_import_memo.py (the same mapping and structure as the
originals; a fresh interpreter answers from the memos; a changed key or a damaged memo
recomputes; other calls untouched; the flag).
Remove when: transformers stops scanning the installed distributions and its model sources at
import.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
import threading
from pathlib import Path

from vllm_omni_edge.levers import IMPORT_MEMO_ENV, import_memo_enabled
from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "transformers.utils.import_utils"
MARKER = "__edge_import_memo__"
MEMO_DIR = "imports"

RECORD = PatchRecord(
    name="transformers_import_memo",
    kind=Kind.LEVER,
    upstream="none found",
    target="importlib.metadata.packages_distributions; "
    f"{TARGET_MODULE}.define_import_structure (transformers' models directory)",
    process=Process.WORKER,  # every interpreter that imports transformers
    why="transformers' import reads every installed distribution's file list and every model "
    "file's source, at every start, for results that change only when packages are installed.",
    verified_by="tests/test_transformers_import_memo.py (same results as the originals; a fresh "
    "interpreter answers from the memos; a changed key or damaged memo recomputes; the flag).",
    remove_when="transformers stops scanning distributions and model sources at import.",
)

_lock = threading.Lock()
_installed = False
DISTRIBUTIONS, MODELS = "packages_distributions", "transformers_models"
# Per memo: calls answered from it, calls computed (and the memo written).
counts = {DISTRIBUTIONS: {"remembered": 0, "computed": 0}, MODELS: {"remembered": 0, "computed": 0}}


skipped: list[str] = []  # why a memo was not installed in this process


def record() -> dict[str, dict[str, int]]:
    return {name: dict(c) for name, c in counts.items()}


def _memo_path(name: str) -> Path:
    from vllm_omni_edge.cache_paths import cache_root

    # One file per interpreter environment: venvs sharing a cache do not overwrite each other's.
    environment = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    return cache_root() / MEMO_DIR / f"{name}-{environment}.json"


def _read(name: str, key: str):
    try:
        memo = json.loads(_memo_path(name).read_text())
        if memo.get("key") == key:
            return memo["value"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: recompute
    return None


def _write(name: str, key: str, value) -> None:
    from vllm_omni_edge.atomic import atomic_write_bytes

    try:
        atomic_write_bytes(_memo_path(name), json.dumps({"key": key, "value": value}).encode())
    except OSError:
        pass  # a read-only cache costs only the memo


def distributions_key(paths: list[str]) -> str:
    """The installed distributions' metadata entries on ``paths`` (what packages_distributions reads).

    An entry without any (a script's directory, the working directory) is not part of the key.
    """
    digest = hashlib.sha256()
    for entry in paths:
        try:
            with os.scandir(entry or ".") as it:
                names = sorted((e.name, e.stat().st_mtime_ns) for e in it
                               if e.name.endswith((".dist-info", ".egg-info")))
        except OSError:
            continue  # not a directory (a zip, a missing path): nothing of it is read here
        if names:
            digest.update(json.dumps([os.path.abspath(entry or "."), names]).encode())
    return digest.hexdigest()


def tree_key(root: Path, version: str) -> str:
    """transformers' version and the ``.py`` files under ``root`` (paths, sizes, mtimes)."""
    digest = hashlib.sha256(f"{version}\n{root}\n".encode())
    for directory, subdirectories, files in os.walk(root):
        subdirectories.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                st = os.stat(os.path.join(directory, name))
                digest.update(f"{directory}/{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _wrap_packages_distributions() -> None:
    def make(original):
        def packages_distributions():
            key = distributions_key(list(sys.path))
            value = _read(DISTRIBUTIONS, key)
            if value is not None:
                counts[DISTRIBUTIONS]["remembered"] += 1
                return value
            value = original()
            _write(DISTRIBUTIONS, key, value)
            counts[DISTRIBUTIONS]["computed"] += 1
            return value

        return packages_distributions

    wrap_method_once(importlib.metadata, "packages_distributions", make, marker=MARKER)


def encode_structure(structure: dict) -> list:
    return [[sorted(backends), {module: sorted(names) for module, names in modules.items()}]
            for backends, modules in structure.items()]


def decode_structure(encoded: list) -> dict:
    return {frozenset(backends): {module: set(names) for module, names in modules.items()}
            for backends, modules in encoded}


# transformers' major version whose import structure (``define_import_structure`` of its models
# directory at import, frozenset keys) this memo was written for; another one is left alone.
TRANSFORMERS_MAJOR = "5."


def _wrap_define_import_structure(module) -> None:
    version = getattr(sys.modules.get("transformers"), "__version__", "")  # set before it imports utils
    if not version.startswith(TRANSFORMERS_MAJOR):
        skipped.append(f"transformers {version or '?'}: its import structure is not remembered "
                       f"(written for {TRANSFORMERS_MAJOR}x)")
        return
    models = Path(module.__file__).resolve().parent.parent / "models"

    def make(original):
        in_process: list = []  # the encoded structure once read or computed (transformers' __init__ runs twice)

        def define_import_structure(module_path, prefix=None):
            path = Path(module_path).resolve()
            # transformers/__init__ asks for the directory with the "models." prefix; the package's
            # own __init__ (on its first attribute use) for its file, unprefixed: one scan answers both.
            package = prefix is None and path == models / "__init__.py"
            if not package and (prefix != "models" or path != models):
                return original(module_path, prefix)
            if not in_process:
                key = tree_key(models, importlib.metadata.version("transformers"))
                encoded = _read(MODELS, key)
                if encoded is None:
                    encoded = encode_structure(original(module_path, prefix))
                    _write(MODELS, key, encoded)
                    counts[MODELS]["computed"] += 1
                else:
                    counts[MODELS]["remembered"] += 1
                in_process.append(encoded)
            else:
                counts[MODELS]["remembered"] += 1
            structure = decode_structure(in_process[0])  # new objects each call: the caller changes them
            if package:
                start = len("models.")
                structure = {backends: {name[start:]: names for name, names in modules.items()}
                             for backends, modules in structure.items()}
            return structure

        return define_import_structure

    wrap_method_once(module, "define_import_structure", make, marker=MARKER)


def install() -> str:
    """Cheap (imports nothing heavy); at interpreter start and by ``apply``."""
    global _installed
    with _lock:
        if _installed:
            return "memos already installed"
        _installed = True
        if not import_memo_enabled():
            return f"{IMPORT_MEMO_ENV}=0: transformers scans at every import"
        late = "transformers" in sys.modules
        _wrap_packages_distributions()
        when_imported(TARGET_MODULE, _wrap_define_import_structure)
    return ("transformers' import scans remembered across starts"
            + (" (transformers was already imported: from the next start)" if late else ""))


def apply() -> str:
    return install()
