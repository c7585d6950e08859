"""Remember where inductor's precompiled C++ header is instead of preprocessing it every start.

What: wraps ``torch._inductor.codecache._precompile_header``, which ``CppCodeCache.load_async``
calls for each compiled C++ kernel library it is asked for, before it looks on disk for
the library. The function runs the compiler's preprocessor over the header (``g++ -E``
on ``cpp_prefix.h`` and everything it includes, a child process) and hashes the output
with ``openssl``, only to name the ``.gch`` file. Its answer (that path) is written to
``<cache>/inductor/precompiled_headers.json``, keyed by the header and the command line,
and stamped with what the preprocessed text depends on: the header file in torch's
include directory (size, mtime), torch and the interpreter, the compiler binary (real
path, size, mtime), this CPU. A later call with the same key and stamp whose ``.gch``
still exists answers from the file; anything else runs torch's function.
Why: a start that loads vLLM's saved compiled model still makes inductor load each
kernel library, and every load preprocesses the header first, although the library is
already built and the header is only needed to compile a new one: 0.2 s of the engine's
critical path of a warm compiled SmolLM2 start on this Zen 5 box (py-spy, one start),
two ``cc1plus`` children per start in the AMX box's start-up grids.
Flag: ``VLLM_OMNI_EDGE_PCH_MEMO=0`` preprocesses every time (the A/B arm).
Verified by: tests/test_precompiled_header_memo.py (a remembered header spawns nothing; a
changed header, compiler or command line, or a missing ``.gch``, runs torch's function
again; the answer is torch's own path); evidence ``precompiled_headers`` (remembered vs
preprocessed) in the start-up grids.
Remove when: torch skips the header for a library that is already built, or caches the
preprocessed hash itself (torch 2.13's ``_precompile_header``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported
from vllm_omni_edge.stamped_memo import StampedMemo, environment_stamp, file_stamp

TARGET_MODULE = "torch._inductor.codecache"

RECORD = PatchRecord(
    name="precompiled_header_memo",
    kind=Kind.LEVER,
    target=f"{TARGET_MODULE}._precompile_header",
    process=Process.WORKER,  # where compiled kernels are loaded
    why="Every compiled start preprocesses inductor's C++ prefix header in a child g++ just to "
    "name its .gch, even when every kernel library is already built (0.2 s here).",
    verified_by="tests/test_precompiled_header_memo.py; evidence precompiled_headers in the start-up grids.",
    remove_when="torch skips the header for an already-built library or caches its preprocessed hash.",
    upstream="none found",
)

# Calls in this process: answered from the file, or run by torch (evidence / tests).
counts = {"remembered": 0, "preprocessed": 0}
MEMO = StampedMemo("inductor", "precompiled_headers.json")


def memo_key(header: str, hashable_cmd_line: str, compile_command: dict) -> str:
    def stable(value) -> str:
        # A VecISA's repr holds a function address; its type and name are what it means.
        if value is None or isinstance(value, (str, int, float, bool, tuple, list)):
            return repr(value)
        return f"{type(value).__qualname__}:{value}"

    return json.dumps([header, hashable_cmd_line, sorted((k, stable(v)) for k, v in compile_command.items())])


def header_stamp(header: str, hashable_cmd_line: str) -> dict:
    """What the preprocessed header depends on (None parts: cannot be stat'ed, never equal)."""
    import torch

    compiler = shutil.which(hashable_cmd_line.split()[0]) if hashable_cmd_line.strip() else None
    compiler = os.path.realpath(compiler) if compiler else None
    return {
        "header": file_stamp(Path(torch.__file__).parent / "include" / header),
        "compiler": [compiler, file_stamp(compiler) if compiler else None],
        **environment_stamp(),
    }


def _wrap(module) -> None:
    def make(original):
        def _precompile_header(header, hashable_cmd_line, **compile_command):
            key = memo_key(header, hashable_cmd_line, compile_command)
            stamp = header_stamp(header, hashable_cmd_line)
            entry = MEMO.get(key)
            if (isinstance(entry, dict) and entry.get("stamp") == stamp and None not in stamp["compiler"]
                    and stamp["header"] is not None and os.path.exists(f"{entry.get('path')}.gch")):
                counts["remembered"] += 1
                return entry["path"]
            counts["preprocessed"] += 1
            path = original(header, hashable_cmd_line, **compile_command)
            if os.path.exists(f"{path}.gch"):
                MEMO.put(key, {"stamp": stamp, "path": path})
            return path

        return _precompile_header

    wrap_method_once(module, "_precompile_header", make)


def apply() -> str:
    from vllm_omni_edge.levers import pch_memo_enabled

    if not pch_memo_enabled():
        return "VLLM_OMNI_EDGE_PCH_MEMO=0: inductor preprocesses its C++ header every start"
    now = when_imported(TARGET_MODULE, _wrap)
    return "inductor's precompiled-header path remembered across starts" + ("" if now else " (on import)")
