"""env_validation: vLLM's check of VLLM_* variables accepts ours and still reports the rest."""

from __future__ import annotations

import inspect
import logging
import os
from types import SimpleNamespace

import pytest

from vllm_omni_edge import envs
from vllm_omni_edge.patches.frontend import env_validation as patch

OURS = "VLLM_OMNI_EDGE_STREAM_CHUNK_MS"  # a declared flag
TYPO = "VLLM_OMNI_EDGE_STREAM_CHUNKS_MS"  # not declared
VLLM_UNKNOWN = "VLLM_NOT_A_VLLM_VARIABLE"


@pytest.fixture
def checks(monkeypatch, caplog):
    """vLLM's own validate_environ, and the same behind our wrapper, over a clean environment."""
    import vllm.envs as vllm_envs

    # Records reach caplog once, whether or not vLLM's loggers propagate to the root logger.
    monkeypatch.setattr(vllm_envs.logger, "handlers", [*vllm_envs.logger.handlers, caplog.handler])
    monkeypatch.setattr(vllm_envs.logger, "propagate", False)

    for name in list(os.environ):
        if name.startswith("VLLM_") and name not in vllm_envs.environment_variables:
            monkeypatch.delenv(name)
    vllms = inspect.unwrap(vllm_envs.validate_environ)  # the plugin may have wrapped it in this process
    module = SimpleNamespace(validate_environ=vllms,
                             environment_variables=vllm_envs.environment_variables, logger=vllm_envs.logger)
    patch._wrap(module)
    patch._wrap(module)  # idempotent
    assert module.validate_environ.__wrapped__ is vllms
    return SimpleNamespace(vllm=vllms, ours=module.validate_environ)


def _outcome(check, hard_fail, caplog):
    caplog.clear()
    try:
        check(hard_fail)
    except ValueError as exc:
        return ("raised", str(exc))
    return ("logged", [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING])


def test_our_flag_is_refused_by_vllm_alone_and_accepted_here(checks, monkeypatch, caplog):
    assert OURS in envs.REGISTRY and TYPO not in envs.REGISTRY
    monkeypatch.setenv(OURS, "25")
    caplog.set_level(logging.WARNING)
    assert _outcome(checks.vllm, True, caplog)[0] == "raised"  # the bug this patch fixes
    assert _outcome(checks.ours, True, caplog) == ("logged", [])
    assert _outcome(checks.ours, False, caplog) == ("logged", [])


def test_environments_without_our_variables_get_vllms_own_results(checks, monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    for hard_fail in (False, True):
        assert _outcome(checks.ours, hard_fail, caplog) == _outcome(checks.vllm, hard_fail, caplog)
    monkeypatch.setenv(VLLM_UNKNOWN, "1")
    for hard_fail in (False, True):
        assert _outcome(checks.ours, hard_fail, caplog) == _outcome(checks.vllm, hard_fail, caplog)
    assert _outcome(checks.ours, True, caplog) == (
        "raised", f"Unknown vLLM environment variable detected: {VLLM_UNKNOWN}")


def test_vllms_unknown_names_are_still_reported_beside_ours(checks, monkeypatch, caplog):
    monkeypatch.setenv(OURS, "25")
    monkeypatch.setenv(VLLM_UNKNOWN, "1")
    caplog.set_level(logging.WARNING)
    assert _outcome(checks.ours, True, caplog) == (
        "raised", f"Unknown vLLM environment variable detected: {VLLM_UNKNOWN}")
    assert _outcome(checks.ours, False, caplog) == (
        "logged", [f"Unknown vLLM environment variable detected: {VLLM_UNKNOWN}"])


def test_an_undeclared_name_of_ours_is_reported_with_where_our_flags_are(checks, monkeypatch, caplog):
    monkeypatch.setenv(TYPO, "25")
    caplog.set_level(logging.WARNING)
    kind, message = _outcome(checks.ours, True, caplog)
    assert kind == "raised" and message == f"Unknown vLLM environment variable detected: {TYPO}{patch.HINT}"
    assert "vllm-omni-edge flags" in message
    assert _outcome(checks.ours, False, caplog) == ("logged", [message])


def test_the_plugin_wraps_vllms_module():
    import vllm.envs as vllm_envs

    from vllm_omni_edge.patches import PLUGIN_PATCHES
    from vllm_omni_edge.patches.base import apply_patch_module

    assert "vllm_omni_edge.patches.frontend.env_validation" in PLUGIN_PATCHES
    assert apply_patch_module("vllm_omni_edge.patches.frontend.env_validation").status == "applied"
    assert getattr(vllm_envs.validate_environ, "__edge_wrapped__", False)


@pytest.mark.e2e
def test_llm_starts_under_vllms_strict_environment_check(default_model, tmp_path):
    from tests.e2e.probe import run_probe

    # run_probe sets our evidence directory variable; reserved_cores sets its marker in the child.
    run = run_probe(default_model, tmp_path / "evidence", {"fail_on_environ_validation": True},
                    VLLM_OMNI_EDGE_STREAM_CHUNK_MS="25")
    assert run.returncode == 0, run.log
    assert "Paris" in run.text
    assert "Unknown vLLM environment variable" not in run.log
    [frontend] = [p for p in run.processes if p["role"] == "frontend"]
    assert frontend["patches"]["env_validation"] == "applied"
