"""transformers_import_memo: transformers' import-time scans remembered across starts."""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_omni_edge.patches.common import transformers_import_memo as patch


@pytest.fixture
def cache(tmp_path, monkeypatch):
    import transformers  # noqa: F401  (its first import here would fill the memos of this cache)

    monkeypatch.setenv("VLLM_OMNI_EDGE_CACHE", str(tmp_path))
    monkeypatch.setattr(patch, "counts", {name: {"remembered": 0, "computed": 0}
                                          for name in (patch.DISTRIBUTIONS, patch.MODELS)})
    return tmp_path


def _import_utils():
    import transformers.utils.import_utils as module

    return module


def _memo_module():
    """A stand-in for transformers' module holding transformers' own (unwrapped, uncached) function."""
    real = _import_utils()
    return SimpleNamespace(__file__=real.__file__, define_import_structure=inspect.unwrap(real.define_import_structure))


def test_packages_distributions_is_the_same_and_remembered(cache, monkeypatch):
    original = inspect.unwrap(importlib.metadata.packages_distributions)
    monkeypatch.setattr(importlib.metadata, "packages_distributions", original)
    patch._wrap_packages_distributions()
    patch._wrap_packages_distributions()  # idempotent
    assert importlib.metadata.packages_distributions.__wrapped__ is original
    first = importlib.metadata.packages_distributions()
    assert first == original() and patch.record()[patch.DISTRIBUTIONS] == {"remembered": 0, "computed": 1}
    assert importlib.metadata.packages_distributions() == first
    assert patch.record()[patch.DISTRIBUTIONS] == {"remembered": 1, "computed": 1}
    assert patch._memo_path(patch.DISTRIBUTIONS).is_file() and patch._memo_path(patch.DISTRIBUTIONS).parent == cache / "imports"


def test_a_newly_installed_distribution_is_a_new_key(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    before = patch.distributions_key([str(site)])
    (site / "example-1.0.dist-info").mkdir()
    assert patch.distributions_key([str(site)]) != before
    assert patch.distributions_key([str(tmp_path / "missing"), str(site)]) == patch.distributions_key([str(site)])
    empty = tmp_path / "scripts"  # a directory without distributions (a script's, the working one)
    empty.mkdir()
    assert patch.distributions_key([str(empty), str(site)]) == patch.distributions_key([str(site)])


def test_the_models_structure_is_the_same_and_remembered(cache):
    module = _memo_module()
    original = module.define_import_structure
    patch._wrap_define_import_structure(module)
    patch._wrap_define_import_structure(module)  # idempotent
    assert module.define_import_structure.__wrapped__ is original
    models = Path(module.__file__).resolve().parent.parent / "models"
    expected = original(models, prefix="models")
    before = patch.record()[patch.MODELS]
    computed = module.define_import_structure(models, prefix="models")
    remembered = module.define_import_structure(models, prefix="models")
    assert computed == expected and remembered == expected
    after = patch.record()[patch.MODELS]
    assert (after["remembered"] - before["remembered"], after["computed"] - before["computed"]) == (1, 1)
    remembered[frozenset()]["models.extra"] = {"X"}  # transformers adds to what it gets
    assert "models.extra" not in module.define_import_structure(models, prefix="models")[frozenset()]


def test_the_models_package_asks_unprefixed_and_is_answered_from_the_same_scan(cache):
    """transformers.models' own __init__ asks for its file with no prefix (on its first import)."""
    module = _memo_module()
    original = module.define_import_structure
    patch._wrap_define_import_structure(module)
    models = Path(module.__file__).resolve().parent.parent / "models"
    package = models / "__init__.py"
    expected = original(str(package))
    assert expected and all(not name.startswith("models.") for modules in expected.values() for name in modules)
    module.define_import_structure(models, prefix="models")  # transformers/__init__: computed, written
    assert module.define_import_structure(str(package)) == expected
    assert patch.record()[patch.MODELS] == {"remembered": 1, "computed": 1}
    fresh = _memo_module()  # another process, the package first: read from the memo on disk
    patch._wrap_define_import_structure(fresh)
    assert fresh.define_import_structure(str(package)) == expected
    assert patch.record()[patch.MODELS] == {"remembered": 2, "computed": 1}


def test_other_calls_go_to_transformers(cache):
    module = _memo_module()
    calls = []
    module.define_import_structure = lambda path, prefix=None: calls.append((path, prefix)) or {}
    patch._wrap_define_import_structure(module)
    model_init = Path(module.__file__).resolve().parent.parent / "models" / "qwen2" / "__init__.py"
    module.define_import_structure(model_init)
    module.define_import_structure("/elsewhere/models", prefix="models")
    assert calls == [(model_init, None), ("/elsewhere/models", "models")]
    assert patch.record()[patch.MODELS] == {"remembered": 0, "computed": 0}


def test_a_changed_tree_or_a_damaged_memo_recomputes(cache, monkeypatch):
    calls = []
    module = _memo_module()
    module.define_import_structure = lambda path, prefix=None: calls.append(1) or {frozenset(): {"models.a": {"A"}}}
    patch._wrap_define_import_structure(module)
    models = Path(module.__file__).resolve().parent.parent / "models"
    module.define_import_structure(models, prefix="models")
    module.define_import_structure(models, prefix="models")
    assert len(calls) == 1
    monkeypatch.setattr(patch, "tree_key", lambda root, version: "another")
    module = _memo_module()  # a new process's module: the changed key is read from disk
    module.define_import_structure = lambda path, prefix=None: calls.append(1) or {frozenset(): {"models.a": {"A"}}}
    patch._wrap_define_import_structure(module)
    module.define_import_structure(models, prefix="models")
    assert len(calls) == 2
    patch._memo_path(patch.MODELS).write_text("{damaged")
    module = _memo_module()
    module.define_import_structure = lambda path, prefix=None: calls.append(1) or {frozenset(): {"models.a": {"A"}}}
    patch._wrap_define_import_structure(module)
    assert module.define_import_structure(models, prefix="models") == {frozenset(): {"models.a": {"A"}}}
    assert len(calls) == 3
    assert json.loads(patch._memo_path(patch.MODELS).read_text())["key"] == "another"


def test_a_file_of_the_tree_is_part_of_the_key(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "m.py").write_text("x = 1\n")
    before = patch.tree_key(tmp_path, "5.0")
    assert patch.tree_key(tmp_path, "5.1") != before
    (tmp_path / "a" / "m.py").write_text("x = 22\n")
    assert patch.tree_key(tmp_path, "5.0") != before


def test_a_fresh_interpreter_answers_from_the_memos(tmp_path):
    code = ("import transformers\n"
            "from transformers import Qwen2Config\n"
            "from vllm_omni_edge.patches.common import transformers_import_memo as m\n"
            "r = m.record()\n"
            "print(sum(c['remembered'] for c in r.values()), sum(c['computed'] for c in r.values()),\n"
            "      Qwen2Config().model_type)\n")
    env = {**__import__("os").environ, "VLLM_OMNI_EDGE_CACHE": str(tmp_path)}
    env.pop("VLLM_OMNI_EDGE_IMPORT_MEMO", None)
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    # The models package (imported by Qwen2Config) is answered from the scan transformers/__init__ made.
    assert [r.stdout.split() for r in runs] == [["1", "2", "qwen2"], ["3", "0", "qwen2"]]
    off = subprocess.run([sys.executable, "-c", code], env={**env, "VLLM_OMNI_EDGE_IMPORT_MEMO": "0"},
                         capture_output=True, text=True, check=True)
    assert off.stdout.split() == ["0", "0", "qwen2"]


def test_the_flag_leaves_transformers_alone(monkeypatch):
    monkeypatch.setattr(patch, "_installed", False)
    monkeypatch.setenv("VLLM_OMNI_EDGE_IMPORT_MEMO", "0")
    assert "=0" in patch.install()
    assert patch.install() == "memos already installed"


def test_another_transformers_major_is_left_alone(monkeypatch):
    module = _memo_module()
    original = module.define_import_structure
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.0", raising=False)
    monkeypatch.setattr(patch, "skipped", [])
    patch._wrap_define_import_structure(module)
    assert module.define_import_structure is original
    assert patch.skipped == ["transformers 4.57.0: its import structure is not remembered (written for 5.x)"]
