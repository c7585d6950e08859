"""isa_probe_memo: inductor's ISA load probes remembered across starts, and only while valid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_omni_edge.patches.worker import isa_probe_memo as patch


class FakeISA:
    """Stands in for torch's VecISA: its probe is a counted child process that may fail."""

    def __init__(self):
        self.children = 0
        self.loads = True

    def _probe_load(self, output_path):
        self.children += 1
        return self.loads


@pytest.fixture
def isa(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(patch, "counts", {"remembered": 0, "probed": 0})
    probe = FakeISA()
    cls = type("VecISA", (), {"_probe_load": lambda self, path: probe._probe_load(path)})
    patch._wrap(SimpleNamespace(VecISA=cls))
    patch._wrap(SimpleNamespace(VecISA=cls))  # idempotent
    return SimpleNamespace(probe=probe, isa=cls(), library=_library(tmp_path / "probe.so", b"x" * 10))


def _library(path, content):
    path.write_bytes(content)
    return str(path)


def test_a_remembered_probe_spawns_no_child(isa):
    assert isa.isa._probe_load(isa.library) is True
    assert isa.isa._probe_load(isa.library) is True
    assert isa.probe.children == 1
    assert patch.counts == {"remembered": 1, "probed": 1}
    entry = json.loads(patch.memo_path().read_text())[isa.library]
    assert entry["library"][0] == 10 and entry["python"] == os.path.realpath(sys.executable)


def test_a_rebuilt_library_is_probed_again(isa):
    isa.isa._probe_load(isa.library)
    _library(Path(isa.library), b"y" * 11)
    isa.isa._probe_load(isa.library)
    assert isa.probe.children == 2


@pytest.mark.parametrize("field, value", [("torch", "0.0.0"), ("libtorch_cpu", ["/elsewhere/libtorch_cpu.so", [1, 2]]),
                                          ("cpu", "another CPU"), ("cpu_flags", "sse2"),
                                          ("python", "/other/python")])
def test_another_torch_interpreter_or_cpu_is_probed_again(isa, field, value):
    isa.isa._probe_load(isa.library)
    memo = json.loads(patch.memo_path().read_text())
    memo[isa.library][field] = value
    patch.memo_path().write_text(json.dumps(memo))
    isa.isa._probe_load(isa.library)
    assert isa.probe.children == 2
    assert json.loads(patch.memo_path().read_text())[isa.library] == patch.probe_stamp(isa.library)


def test_a_failed_probe_is_not_remembered(isa):
    isa.probe.loads = False
    assert isa.isa._probe_load(isa.library) is False
    assert not patch.memo_path().exists()
    assert isa.isa._probe_load(isa.library) is False
    assert isa.probe.children == 2


def test_a_corrupt_memo_is_ignored_and_replaced(isa):
    patch.memo_path().parent.mkdir(parents=True)
    patch.memo_path().write_text("{not json")
    assert isa.isa._probe_load(isa.library) is True
    assert isa.probe.children == 1
    assert isa.library in json.loads(patch.memo_path().read_text())
    assert not [p for p in patch.memo_path().parent.iterdir() if p.name.startswith(".")]  # no temp left


def test_an_unwritable_cache_costs_only_the_memo(isa, monkeypatch):
    def refuse(path, data):
        raise PermissionError(13, "read-only", str(path))

    monkeypatch.setattr("vllm_omni_edge.atomic.atomic_write_bytes", refuse)
    assert isa.isa._probe_load(isa.library) is True
    assert isa.isa._probe_load(isa.library) is True
    assert isa.probe.children == 2


def test_the_flag_turns_it_off(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_ISA_PROBE_MEMO", "0")
    assert "probes every ISA" in patch.apply()
    monkeypatch.setenv("VLLM_OMNI_EDGE_ISA_PROBE_MEMO", "maybe")
    from vllm_omni_edge.levers import LeverFlagError

    with pytest.raises(LeverFlagError, match="VLLM_OMNI_EDGE_ISA_PROBE_MEMO"):
        patch.apply()


VALID_ISAS = """
import json, subprocess, sys
from torch._inductor import cpu_vec_isa
children = []  # the probes' child Pythons (not the compiler's version checks)
run = subprocess.run
def counted(cmd, *a, **k):
    if cmd[0] == sys.executable:
        children.append(cmd)
    return run(cmd, *a, **k)
cpu_vec_isa.subprocess.run = counted
if {memo}:
    from vllm_omni_edge.patches.worker import isa_probe_memo
    isa_probe_memo.apply()
isas = [str(i) for i in cpu_vec_isa.valid_vec_isa_list()]
print(json.dumps({{"isas": isas, "children": len(children)}}))
"""


def _valid_isas(cache, memo: bool) -> dict:
    env = dict(os.environ, VLLM_OMNI_EDGE_CACHE=str(cache))
    out = subprocess.run([sys.executable, "-c", VALID_ISAS.format(memo=memo)], env=env, check=True,
                         capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                    reason="inductor probes x86 vector ISAs in a child process on Linux only")
def test_torch_picks_the_same_isas_from_the_memo(tmp_path):
    stock = _valid_isas(tmp_path, memo=False)
    first = _valid_isas(tmp_path, memo=True)
    second = _valid_isas(tmp_path, memo=True)
    assert stock["isas"] and stock["children"] >= len(stock["isas"])
    assert first == stock  # the first start probes as torch does
    assert second == {"isas": stock["isas"], "children": 0}
