"""Remember inductor's ``torch_key`` (a hash of torch's installed source) across starts.

What: wraps vLLM's ``get_inductor_factors`` (where ``vllm.compilation.compiler_interface``
defines it and where ``vllm.compilation.caching`` imported it by name), the compile cache key's
summary of torch. Before its first call in a process, a remembered key whose stamp still holds
is handed to torch with ``torch._inductor.codecache.torch_key.set`` (how torch's own compile
workers receive their parent's key); after it, a key torch had to compute is written to
``<cache>/inductor/torch_key.json``. The stamp: torch's package path, its ``*.dist-info/RECORD``
(size and mtime: pip writes it at every install of torch), torch's version and ``libtorch_cpu``,
the interpreter and the CPU (``stamped_memo.environment_stamp``). No stamp (no single RECORD
beside torch) means no memo: torch computes the key as stock.
Why: ``torch_key`` reads and hashes every Python file of torch (pkgutil walk, sha256) once per
process; vLLM asks for it to name its compiled model's cache directory, so every compiled start
pays it, including one that only loads the saved graph. It cannot change while torch's
installation is the same.
Flag: ``VLLM_OMNI_EDGE_TORCH_KEY_MEMO=0`` lets torch hash its source every start (the A/B arm).
A torch file edited in place without reinstalling keeps its old stamp: set the flag to 0 then.
Verified by: tests/test_torch_key_memo.py (a remembered key is set and the hash not run; a new
RECORD, a corrupt file or no RECORD computes it; two real starts agree with torch's own key);
evidence ``torch_key`` (remembered vs computed).
Remove when: torch stores its source hash at install time (as its fbcode build does with
``src_hash.txt``) or vLLM keys its compile cache on torch's version.
"""

from __future__ import annotations

import threading
from pathlib import Path

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported
from vllm_omni_edge.stamped_memo import StampedMemo, environment_stamp, file_stamp

TARGET_MODULES = ("vllm.compilation.compiler_interface", "vllm.compilation.caching")

RECORD = PatchRecord(
    name="torch_key_memo",
    kind=Kind.LEVER,
    target="vllm.compilation.compiler_interface.get_inductor_factors",
    process=Process.WORKER,  # where the compile cache key is computed
    why="vLLM's compile cache key asks torch to hash all of its Python source on every compiled "
    "start; the hash is fixed while torch's installation is.",
    verified_by="tests/test_torch_key_memo.py; evidence torch_key in the start-up grids.",
    remove_when="torch stores its source hash at install time, or vLLM keys on torch's version.",
    upstream="none found",
)

# This process's key: taken from the file, or computed by torch (evidence / tests).
counts = {"remembered": 0, "computed": 0}
MEMO = StampedMemo("inductor", "torch_key.json")
_state = {"checked": False, "remembered": False, "written": False, "stamp": None}
_lock = threading.Lock()


def memo_path() -> Path:
    return MEMO.path


def torch_stamp() -> dict | None:
    """What torch's source hash depends on; None when torch's install record is not found."""
    import torch

    package = Path(torch.__file__).resolve().parent
    records = sorted(package.parent.glob("torch-*.dist-info/RECORD"))
    if len(records) != 1:
        return None
    record = file_stamp(records[0])
    if record is None:
        return None
    return {"package": str(package), "record": [str(records[0]), record], **environment_stamp()}


def _codecache():
    from torch._inductor import codecache

    return codecache


def _before_first_call() -> None:
    """Hand torch the remembered key, once per process, if its stamp holds."""
    with _lock:
        if _state["checked"]:
            return
        _state["checked"] = True
        stamp = _state["stamp"] = torch_stamp()
        entry = MEMO.get(stamp["package"]) if stamp else None
        if not (isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("key"), str)):
            counts["computed"] += 1
            return
        try:
            _codecache().torch_key.set(bytes.fromhex(entry["key"]))
        except AttributeError:  # a torch whose torch_key takes no value from outside: hashed as stock
            counts["computed"] += 1
            return
        except (RuntimeError, ValueError):  # already computed in this process, or a bad entry
            counts["computed"] += 1
            return
        _state["remembered"] = True
        counts["remembered"] += 1


def _after_first_call() -> None:
    """Write the key torch computed (cached in the process by now), if it may be remembered."""
    if _state["remembered"] or _state["written"]:
        return
    _state["written"] = True
    stamp = _state["stamp"]
    if stamp is not None:
        MEMO.put(stamp["package"], {"stamp": stamp, "key": _codecache().torch_key().hex()})


def _wrap(module) -> None:
    def make(original):
        def get_inductor_factors(*args, **kwargs):
            _before_first_call()
            factors = original(*args, **kwargs)
            _after_first_call()
            return factors

        return get_inductor_factors

    wrap_method_once(module, "get_inductor_factors", make, marker="__edge_torch_key_memo__")


def apply() -> str:
    from vllm_omni_edge.levers import torch_key_memo_enabled

    if not torch_key_memo_enabled():
        return "VLLM_OMNI_EDGE_TORCH_KEY_MEMO=0: torch hashes its source at every compiled start"
    now = [when_imported(name, _wrap) for name in TARGET_MODULES]
    return "torch's source hash (inductor's torch_key) remembered across starts" + ("" if all(now) else " (on import)")

