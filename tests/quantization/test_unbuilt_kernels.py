"""A missing C++ kernel library is loud: the kernel summary warns, and our front ends build it first."""

from __future__ import annotations

import logging

import pytest

from vllm_omni_edge.cli import serve as serve_cli
from vllm_omni_edge.quantization import evidence
from vllm_omni_edge.quantization.kernels import native

NOT_BUILT = (False, f"{native.NOT_BUILT} and torch 9.9: run `vllm-omni-edge build-kernels`")


@pytest.fixture
def fresh_evidence():
    evidence.reset()
    evidence.logger.propagate, was = True, evidence.logger.propagate
    yield
    evidence.logger.propagate = was
    evidence.reset()


def _one_layer_reports() -> None:
    evidence.expect("l0")
    evidence.record(evidence.LayerChoice(prefix="l0", kind="linear", kernel="int4pack", reason="r",
                                         in_features=64, out_features=16, group_size=32))


@pytest.mark.parametrize("library, warns", [
    (NOT_BUILT, True),
    ((True, "loaded"), False),
    ((False, "x86-64 only (this machine is aarch64)"), False),  # nothing to build there
])
def test_summary_warns_only_when_the_library_is_not_built(library, warns, fresh_evidence, monkeypatch, caplog):
    monkeypatch.setattr(native, "load_library", lambda: library)
    with caplog.at_level(logging.INFO, logger=evidence.logger.name):
        _one_layer_reports()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage().startswith("cpu_int4: 1 layers") for r in caplog.records].count(True) == 1
    if warns:
        assert len(warnings) == 1 and "slower fallback kernels" in warnings[0]
        assert "vllm-omni-edge build-kernels" in warnings[0] and "'linear:int4pack': 1" in warnings[0]
    else:
        assert warnings == []


def test_front_end_builds_a_missing_library_and_says_so(tmp_path, monkeypatch, capsys):
    target = tmp_path / "lib.so"
    monkeypatch.setattr(native, "x86_64", lambda: True)
    monkeypatch.setattr(native, "library_path", lambda: target)
    built = []
    monkeypatch.setattr(native, "build_library", lambda: (built.append(1), target.write_bytes(b"so"))[1])
    assert serve_cli.build_kernels_if_missing() is True
    err = capsys.readouterr().err
    assert built == [1] and "building the C++ kernels" in err and f"built {target.name}" in err
    # Present: nothing built, nothing said.
    assert serve_cli.build_kernels_if_missing() is True
    assert built == [1] and capsys.readouterr().err == ""


def test_front_end_goes_on_with_a_warning_when_the_build_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(native, "x86_64", lambda: True)
    monkeypatch.setattr(native, "library_path", lambda: tmp_path / "lib.so")

    def fail():
        raise native.KernelBuildError("g++ not found")

    monkeypatch.setattr(native, "build_library", fail)
    assert serve_cli.build_kernels_if_missing() is False
    err = capsys.readouterr().err
    assert "warning: the C++ kernels did not build (g++ not found)" in err and "fallback" in err
    assert not (tmp_path / "lib.so").exists()
