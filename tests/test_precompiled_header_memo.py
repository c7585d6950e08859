"""precompiled_header_memo: inductor's header path remembered across starts, and only while valid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from vllm_omni_edge.patches.worker import precompiled_header_memo as patch

HEADER = "torch/csrc/inductor/cpp_prefix.h"  # the header inductor precompiles for CPU kernels


@pytest.fixture
def pch(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(patch, "counts", {"remembered": 0, "preprocessed": 0})
    calls = []

    def precompile(header, hashable_cmd_line, **compile_command):  # stands in for torch's
        calls.append((header, hashable_cmd_line))
        path = tmp_path / "headers" / f"{len(calls)}.h"
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"#include <{header}>\n")
        (tmp_path / "headers" / f"{len(calls)}.h.gch").write_bytes(b"pch")
        return str(path)

    module = SimpleNamespace(_precompile_header=precompile)
    patch._wrap(module)
    patch._wrap(module)  # idempotent
    return SimpleNamespace(calls=calls, call=module._precompile_header, headers=tmp_path / "headers")


CMD = "g++ i -O3 -o o"


def test_a_remembered_header_is_not_preprocessed_again(pch):
    first = pch.call(HEADER, CMD, min_optimize=False)
    assert pch.call(HEADER, CMD, min_optimize=False) == first
    assert len(pch.calls) == 1 and patch.counts == {"remembered": 1, "preprocessed": 1}
    (entry,) = json.loads(patch.MEMO.path.read_text()).values()
    assert entry["path"] == first and entry["stamp"]["header"] is not None


def test_another_command_line_or_option_is_its_own_entry(pch):
    pch.call(HEADER, CMD, min_optimize=False)
    pch.call(HEADER, CMD + " -march=native", min_optimize=False)
    pch.call(HEADER, CMD, min_optimize=True)
    assert len(pch.calls) == 3


def test_a_changed_stamp_runs_torchs_function_again(pch, monkeypatch):
    pch.call(HEADER, CMD)
    real = patch.header_stamp
    monkeypatch.setattr(patch, "header_stamp", lambda *a: {**real(*a), "torch": "another torch"})
    pch.call(HEADER, CMD)
    assert len(pch.calls) == 2


def test_a_missing_gch_runs_torchs_function_again(pch):
    first = pch.call(HEADER, CMD)
    os.unlink(first + ".gch")
    pch.call(HEADER, CMD)
    assert len(pch.calls) == 2


def test_an_unknown_compiler_or_header_is_never_answered_from_the_memo(pch):
    for _ in range(2):
        pch.call(HEADER, "no-such-compiler-xyz i -o o")
        pch.call("torch/no/such/header.h", CMD)
    assert len(pch.calls) == 4 and patch.counts["remembered"] == 0


def test_the_flag_turns_it_off(monkeypatch):
    from vllm_omni_edge.levers import LeverFlagError

    monkeypatch.setenv("VLLM_OMNI_EDGE_PCH_MEMO", "0")
    assert "preprocesses its C++ header every start" in patch.apply()
    monkeypatch.setenv("VLLM_OMNI_EDGE_PCH_MEMO", "perhaps")
    with pytest.raises(LeverFlagError, match="VLLM_OMNI_EDGE_PCH_MEMO"):
        patch.apply()


# One compiled CPU kernel, loaded from inductor's caches: counts the preprocessor's children.
COMPILED_KERNEL = """
import json, subprocess
import torch
from vllm_omni_edge.patches.worker import precompiled_header_memo as memo
from torch._inductor import cpp_builder
preprocessed = []
run = cpp_builder._run_compile_cmd
def counted(cmd_line, cwd):
    if " -E " in f" {{cmd_line}} ":
        preprocessed.append(cmd_line)
    return run(cmd_line, cwd)
cpp_builder._run_compile_cmd = counted
if {memo}:
    memo.apply()
f = torch.compile(lambda x: (x * 2 + 1).sin().sum(dim=-1), backend="inductor")
x = torch.arange(64, dtype=torch.float32).reshape(8, 8)
out = f(x)
assert torch.allclose(out, (x * 2 + 1).sin().sum(dim=-1))
print(json.dumps({{"preprocessed": len(preprocessed), "counts": memo.counts}}))
"""


def _compiled_kernel(cache, memo: bool) -> dict:
    env = dict(os.environ, VLLM_OMNI_EDGE_CACHE=str(cache))
    out = subprocess.run([sys.executable, "-c", COMPILED_KERNEL.format(memo=memo)], env=env, check=True,
                         capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="inductor precompiles headers with g++ on Linux only")
def test_a_cached_kernel_loads_without_the_preprocessor_once_remembered(tmp_path):
    stock = _compiled_kernel(tmp_path, memo=False)  # also fills inductor's own caches
    first = _compiled_kernel(tmp_path, memo=True)
    second = _compiled_kernel(tmp_path, memo=True)
    assert stock["preprocessed"] >= 1  # torch preprocesses even for a kernel it has built
    assert first["preprocessed"] == stock["preprocessed"] and first["counts"]["remembered"] == 0
    assert second["preprocessed"] == 0
    assert second["counts"] == {"remembered": first["counts"]["preprocessed"], "preprocessed": 0}


def test_the_key_does_not_depend_on_object_addresses():
    class Isa:  # like torch's VecISA: a repr with a function address, a str with its name
        def __str__(self):
            return "avx512 avx512_vnni"

    assert patch.memo_key(HEADER, CMD, {"vec_isa": Isa()}) == patch.memo_key(HEADER, CMD, {"vec_isa": Isa()})
    assert patch.memo_key(HEADER, CMD, {"vec_isa": Isa()}) != patch.memo_key(HEADER, CMD, {"vec_isa": None})
