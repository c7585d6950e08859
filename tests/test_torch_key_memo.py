"""torch_key_memo: inductor's hash of torch's source remembered across starts, and only while valid."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from torch.utils._functools import prefetchable_cache

from vllm_omni_edge.patches.worker import torch_key_memo as patch

KEY = bytes(range(32))


class FakeTorch:
    """One process's torch: a torch_key cached as torch caches it, whose hash is counted."""

    def __init__(self, cache=prefetchable_cache):
        self.hashes = 0

        @cache
        def torch_key() -> bytes:
            self.hashes += 1
            return KEY

        self.codecache = SimpleNamespace(torch_key=torch_key)
        # vLLM's get_inductor_factors: the key among other factors.
        self.vllm = SimpleNamespace(get_inductor_factors=lambda: ["system", torch_key()])


@pytest.fixture
def start(tmp_path, monkeypatch):
    """A function that makes a new "process" (fresh torch, fresh patch state) and runs vLLM's call."""
    monkeypatch.setenv("VLLM_OMNI_EDGE_CACHE", str(tmp_path / "cache"))
    record = tmp_path / "site-packages" / "torch-9.9.dist-info" / "RECORD"
    record.parent.mkdir(parents=True)
    record.write_text("torch/__init__.py,sha256=x,1\n")
    monkeypatch.setattr(patch, "torch_stamp", lambda: {"package": "/site/torch", "record": [str(record),
                                                       [record.stat().st_size, record.stat().st_mtime_ns]]})

    def run():
        fake = FakeTorch()
        monkeypatch.setattr(patch, "counts", {"remembered": 0, "computed": 0})
        monkeypatch.setattr(patch, "_state", {"checked": False, "remembered": False, "written": False, "stamp": None})
        monkeypatch.setattr(patch, "_codecache", lambda: fake.codecache)
        patch._wrap(fake.vllm)
        patch._wrap(fake.vllm)  # idempotent
        assert fake.vllm.get_inductor_factors() == ["system", KEY]
        assert fake.vllm.get_inductor_factors() == ["system", KEY]
        return fake

    return SimpleNamespace(run=run, record=record)


def test_a_remembered_key_is_set_and_torch_hashes_nothing(start):
    assert start.run().hashes == 1 and patch.counts == {"remembered": 0, "computed": 1}
    assert json.loads(patch.memo_path().read_text())["/site/torch"]["key"] == KEY.hex()
    assert start.run().hashes == 0 and patch.counts == {"remembered": 1, "computed": 0}


def test_a_reinstalled_torch_is_hashed_again(start):
    start.run()
    start.record.write_text("torch/__init__.py,sha256=y,2\n")  # pip rewrote it
    assert start.run().hashes == 1
    assert start.run().hashes == 0


@pytest.mark.parametrize("content", ["{not json", json.dumps({"/site/torch": {"stamp": None, "key": "zz"}})])
def test_a_corrupt_memo_is_ignored_and_replaced(start, content):
    patch.memo_path().parent.mkdir(parents=True)
    patch.memo_path().write_text(content)
    assert start.run().hashes == 1
    assert start.run().hashes == 0


def test_a_key_already_computed_in_the_process_is_left_alone(start, monkeypatch):
    start.run()
    fake = FakeTorch()
    fake.codecache.torch_key()  # something asked torch before vLLM did
    monkeypatch.setattr(patch, "_state", {"checked": False, "remembered": False, "written": False, "stamp": None})
    monkeypatch.setattr(patch, "_codecache", lambda: fake.codecache)
    patch._wrap(fake.vllm)
    assert fake.vllm.get_inductor_factors() == ["system", KEY] and fake.hashes == 1


def test_a_torch_key_that_takes_no_value_is_hashed_as_stock(start, monkeypatch):
    start.run()
    fake = FakeTorch(cache=functools.cache)  # no .set
    monkeypatch.setattr(patch, "counts", {"remembered": 0, "computed": 0})
    monkeypatch.setattr(patch, "_state", {"checked": False, "remembered": False, "written": False, "stamp": None})
    monkeypatch.setattr(patch, "_codecache", lambda: fake.codecache)
    patch._wrap(fake.vllm)
    assert fake.vllm.get_inductor_factors() == ["system", KEY] and fake.hashes == 1
    assert patch.counts == {"remembered": 0, "computed": 1}


def test_no_install_record_means_no_memo(start, monkeypatch):
    monkeypatch.setattr(patch, "torch_stamp", lambda: None)
    start.run()
    assert start.run().hashes == 1
    assert not patch.memo_path().exists()


def test_torch_here_has_one_install_record():
    stamp = patch.torch_stamp()
    assert stamp is not None and stamp["record"][0].endswith("RECORD") and stamp["torch"]


def test_the_flag_turns_it_off(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_TORCH_KEY_MEMO", "0")
    assert "hashes its source" in patch.apply()
    monkeypatch.setenv("VLLM_OMNI_EDGE_TORCH_KEY_MEMO", "maybe")
    from vllm_omni_edge.levers import LeverFlagError

    with pytest.raises(LeverFlagError, match="VLLM_OMNI_EDGE_TORCH_KEY_MEMO"):
        patch.apply()


VLLM_KEY = """
import json
from torch._inductor import codecache
hashes = []  # build_code_hash calls (one per package of torch it walks)
build = codecache.build_code_hash
codecache.build_code_hash = lambda *a, **k: (hashes.append(1), build(*a, **k))[1]
from vllm_omni_edge.patches.worker import torch_key_memo
torch_key_memo.apply()
from vllm.compilation import caching, compiler_interface
factors = caching.get_inductor_factors()
assert compiler_interface.get_inductor_factors() == factors
print(json.dumps({"key": codecache.torch_key().hex(), "hashes": len(hashes), "counts": torch_key_memo.counts}))
"""


def test_two_real_starts_agree_with_torchs_own_key(tmp_path):
    env = dict(os.environ, VLLM_OMNI_EDGE_CACHE=str(tmp_path / "cache"))

    def start() -> dict:
        done = subprocess.run([sys.executable, "-c", VLLM_KEY], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = start(), start()
    assert first["hashes"] > 0 and first["counts"] == {"remembered": 0, "computed": 1}
    assert second["hashes"] == 0 and second["counts"] == {"remembered": 1, "computed": 0}
    assert second["key"] == first["key"]  # the first is torch's own hash of its source
