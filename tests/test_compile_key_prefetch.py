"""compile_key_prefetch: inductor's torch/triton key hashed in the background, same values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_omni_edge.patches.worker import compile_key_prefetch as patch


def config(mode):
    return SimpleNamespace(compilation_config=SimpleNamespace(mode=mode))


def test_only_a_compiled_model_with_the_inductor_key_wants_it(monkeypatch):
    from vllm.config import CompilationMode

    monkeypatch.setenv("VLLM_USE_MEGA_AOT_ARTIFACT", "1")
    assert patch.wants_inductor_key(config(CompilationMode.VLLM_COMPILE))
    assert not patch.wants_inductor_key(config(CompilationMode.NONE))
    monkeypatch.setenv("VLLM_USE_MEGA_AOT_ARTIFACT", "0")
    assert not patch.wants_inductor_key(config(CompilationMode.VLLM_COMPILE))


def test_prefetched_keys_are_the_keys():
    from torch._inductor.codecache import torch_key, triton_key

    direct = (triton_key(), torch_key())
    triton_key.clear()
    torch_key.clear()
    patch.prefetch_inductor_key()
    assert patch.started
    assert (triton_key(), torch_key()) == direct


@pytest.mark.parametrize("wanted", [True, False])
def test_runner_init_starts_the_prefetch_only_when_wanted(monkeypatch, wanted):
    calls = []
    monkeypatch.setattr(patch, "wants_inductor_key", lambda vllm_config: wanted)
    monkeypatch.setattr(patch, "prefetch_inductor_key", lambda: calls.append("prefetch"))

    class Runner:
        def __init__(self, vllm_config, device):
            calls.append("init")

    module = SimpleNamespace(CPUModelRunner=Runner)
    patch._wrap(module)
    patch._wrap(module)  # idempotent
    Runner(config(None), "cpu")
    assert calls == (["prefetch", "init"] if wanted else ["init"])


@pytest.fixture
def memo(tmp_path, monkeypatch):
    """The key memo in a scratch cache; triton's cached key cleared before and after."""
    from torch._inductor.codecache import triton_key

    monkeypatch.setenv("VLLM_OMNI_EDGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("VLLM_OMNI_EDGE_COMPILE_KEY_MEMO", "1")
    monkeypatch.setattr(patch, "counts", {"remembered": 0, "hashed": 0})
    triton_key.clear()
    yield triton_key
    triton_key.clear()


def _settle():
    """Wait for the background hash and its memo write."""
    if patch.pending is not None:
        patch.pending.result()


def test_a_first_start_hashes_and_remembers_the_triton_key(memo):
    from torch._inductor.codecache import triton_key

    patch.prefetch_inductor_key()
    value = triton_key()
    _settle()
    assert patch.counts == {"remembered": 0, "hashed": 1}
    memo.clear()
    assert triton_key() == value  # what stock torch computes
    found, remembered = patch.remembered_triton_key(patch.triton_stamp())
    assert found and remembered == value


def test_a_remembered_key_is_set_not_hashed(memo):
    from torch._inductor.codecache import triton_key

    # A value no hash gives: seeing it back proves the key came from the memo.
    patch.MEMO.put(patch.TRITON_ENTRY, {"stamp": patch.triton_stamp(), "value": "from-the-memo"})
    patch.prefetch_inductor_key()
    assert patch.counts == {"remembered": 1, "hashed": 0}
    assert triton_key() == "from-the-memo"


def test_a_stale_or_corrupt_memo_hashes_again(memo):
    from torch._inductor.codecache import triton_key

    patch.MEMO.put(patch.TRITON_ENTRY, {"stamp": "another triton", "value": "stale"})
    patch.prefetch_inductor_key()
    assert triton_key() != "stale"
    _settle()
    assert patch.counts["hashed"] == 1
    memo.clear()
    patch.MEMO.path.write_text("{not json")
    patch.prefetch_inductor_key()
    assert triton_key() not in (None, "stale")
    assert patch.counts == {"remembered": 0, "hashed": 2}


def test_the_flag_off_hashes_every_start(memo, monkeypatch):
    """Off is the default (opt-in lever)."""
    from torch._inductor.codecache import triton_key

    patch.MEMO.put(patch.TRITON_ENTRY, {"stamp": patch.triton_stamp(), "value": "from-the-memo"})
    monkeypatch.delenv("VLLM_OMNI_EDGE_COMPILE_KEY_MEMO")
    patch.prefetch_inductor_key()
    assert triton_key() != "from-the-memo"
    assert patch.counts == {"remembered": 0, "hashed": 1}


def test_the_stamp_follows_every_hashed_file(tmp_path, monkeypatch):
    root = tmp_path / "triton"
    files = ["__init__.py", "runtime/cache.py", "_C/libtriton.so", "compiler/code_gen.py",
             "backends/nvidia/driver.py", "language/core.py"]
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x")
    spec = SimpleNamespace(origin=str(root / "__init__.py"))
    monkeypatch.setattr(patch.importlib.util, "find_spec", lambda name: spec if name == "triton" else None)
    first = patch.triton_stamp()
    assert first == patch.triton_stamp()
    for name in files:
        (root / name).write_text("xy")  # one byte more: another size
        changed = patch.triton_stamp()
        assert changed != first, name
        first = changed
    (root / "language" / "README.md").write_text("not hashed by triton")
    assert patch.triton_stamp() == first
    (root / "runtime" / "cache.py").unlink()
    assert patch.triton_stamp() is None
    monkeypatch.setattr(patch.importlib.util, "find_spec", lambda name: None)
    assert patch.triton_stamp() is None
