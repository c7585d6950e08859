"""Hash torch's and triton's installed code for the compile cache key in the background.

What: wraps ``CPUModelRunner.__init__``: when the model will be compiled and vLLM's key
holds inductor's factors (``VLLM_USE_MEGA_AOT_ARTIFACT``, on with torch >= 2.12), it
starts inductor's own ``triton_key.prefetch()`` and ``torch_key.prefetch()``
(``torch.utils._functools.prefetchable_cache``: the value is computed on torch's
two-thread prefetch pool; the first caller waits for it). The key itself is unchanged.
Why: the compile cache key is computed at the first forward, after the weights are
loaded, and on the start's critical path: ``triton_key`` reads and hashes the 476 MB
``libtriton.so`` (triton comes with xgrammar; it has no CPU backend) and torch's key
hashes torch's Python sources: 0.54 s and 0.19 s here, one core, warm page cache.
Started before the model is built, the hashing (which releases the GIL) overlaps the
load on the second core.
Opt-in, triton's key is also remembered across starts (``<cache>/inductor/compile_keys.json``),
stamped with the size and mtime of every file it hashes (``libtriton.so``, the
``compiler``, ``backends`` and ``language`` sources, ``runtime/cache.py``, the package's
``__init__``) and the interpreter/torch stamp: a start with the same stamp sets the value
(``triton_key.set``) instead of hashing; any other start hashes and writes it. The
expectation was that on a 2-core box the background hashing takes a core from the load
and the server's set-up (py-spy of a warm compiled serve start: 1.1 s busy in ``triton_key``,
0.3 s CPU unprofiled). torch's own key (0.15 s) stays prefetched: stamping its 2,300
sources costs about half of hashing them.
Measured (``2026-12-02-start-up-compile-key-memo``, 5 interleaved passes, quiet Zen 5 box):
no gain resolved, server start to first token 1.03x (0.87-1.38) with the memo: the hash
releases the GIL and the second core was free for it. So it is opt-in.
Flag: ``VLLM_OMNI_EDGE_COMPILE_KEY_MEMO=1`` remembers triton's key (default 0: hashed
every start, as before).
Verified by: tests/test_compile_key_prefetch.py (prefetch started only for a compiled
model with the mega artifact; the key's values are the same as without it; a remembered
key is set without hashing, a changed file or a corrupt memo hashes again); evidence
``compile_keys`` {remembered, hashed} in the start-up grids.
Remove when: torch stops hashing triton on a build without a triton CPU backend, or
vLLM prefetches these itself.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os

from vllm_omni_edge.patches.base import PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported
from vllm_omni_edge.stamped_memo import StampedMemo, environment_stamp

TARGET_MODULE = "vllm.v1.worker.cpu_model_runner"

RECORD = PatchRecord(
    name="compile_key_prefetch",
    target=f"{TARGET_MODULE}.CPUModelRunner.__init__",
    process=Process.WORKER,
    why="The compile cache key hashes libtriton.so (476 MB) and torch's sources on the start's "
    "critical path (0.7 s); prefetched, that overlaps the weight load; triton's, remembered "
    "while its files are unchanged, is not hashed at all.",
    verified_by="tests/test_compile_key_prefetch.py; evidence compile_keys in the start-up grids.",
    remove_when="torch skips triton's hash without a triton CPU backend, or vLLM prefetches the key.",
)

# Whether this process started the prefetch (evidence / tests).
started = False


def wants_inductor_key(vllm_config) -> bool:
    """A compiled model whose AOT cache key includes inductor's system and torch factors."""
    from vllm import envs
    from vllm.config import CompilationMode

    return vllm_config.compilation_config.mode != CompilationMode.NONE and envs.VLLM_USE_MEGA_AOT_ARTIFACT


# Triton keys this process set from the memo or hashed (evidence / tests).
counts = {"remembered": 0, "hashed": 0}
MEMO = StampedMemo("inductor", "compile_keys.json")
# The background hash-and-remember of this process, if one was started (tests wait on it).
pending = None
TRITON_ENTRY = "triton_key"
# What triton.runtime.cache.triton_key reads, relative to the triton package.
_TRITON_TREES = ("compiler", "backends", "language")
_TRITON_FILES = ("__init__.py", os.path.join("runtime", "cache.py"), "_C")


def triton_stamp() -> str | None:
    """A digest of every file triton's key hashes (by size and mtime); None without triton."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.origin:
        return None
    root = os.path.dirname(spec.origin)
    paths = []
    for tree in _TRITON_TREES:
        for folder, _, names in os.walk(os.path.join(root, tree)):
            paths += [os.path.join(folder, name) for name in names if name.endswith((".py", ".so"))]
    for name in _TRITON_FILES:
        path = os.path.join(root, name)
        if os.path.isdir(path):  # _C: libtriton.<ext>
            paths += [os.path.join(path, entry) for entry in os.listdir(path) if entry.startswith("libtriton")]
        else:
            paths.append(path)
    digest = hashlib.sha256(repr(sorted(environment_stamp().items())).encode())
    for path in sorted(paths):
        try:
            st = os.stat(path)
        except OSError:
            return None
        digest.update(f"{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def remembered_triton_key(stamp: str | None):
    """(True, value) when the memo holds triton's key for this stamp, else (False, None)."""
    entry = MEMO.get(TRITON_ENTRY) if stamp is not None else None
    if isinstance(entry, dict) and entry.get("stamp") == stamp and "value" in entry:
        return True, entry["value"]
    return False, None


def _hash_and_remember(triton_key, stamp: str | None) -> None:
    value = triton_key()  # computes under the cache's lock: a caller meanwhile waits for it
    if stamp is not None and (value is None or isinstance(value, str)):
        MEMO.put(TRITON_ENTRY, {"stamp": stamp, "value": value})


def prefetch_inductor_key() -> None:
    from torch._inductor.codecache import torch_key, triton_key
    from torch.utils._functools import _prefetch_executor

    from vllm_omni_edge.levers import compile_key_memo_enabled

    global started, pending
    if compile_key_memo_enabled():
        stamp = triton_stamp()
        found, value = remembered_triton_key(stamp)
        if found:
            try:
                triton_key.set(value)
                counts["remembered"] += 1
            except RuntimeError:  # already computed in this process
                pass
        else:
            counts["hashed"] += 1
            pending = _prefetch_executor.submit(_hash_and_remember, triton_key, stamp)
    else:
        counts["hashed"] += 1
        triton_key.prefetch()
    torch_key.prefetch()
    started = True


def _wrap(module) -> None:
    def make(original):
        def __init__(self, vllm_config, *args, **kwargs):
            if wants_inductor_key(vllm_config):
                prefetch_inductor_key()
            original(self, vllm_config, *args, **kwargs)

        return __init__

    wrap_method_once(module.CPUModelRunner, "__init__", make)


def apply() -> str:
    now = when_imported(TARGET_MODULE, _wrap)
    from vllm_omni_edge.levers import compile_key_memo_enabled

    memo = ", triton's remembered across starts" if compile_key_memo_enabled() else ""
    return "inductor's torch/triton key hashed in the background for a compiled model" + memo + (
        "" if now else " (on import)")
