"""The runtime-floor tool on cheap profiles (bare interpreters; seconds, no vLLM)."""

import pytest

from vllm_omni_edge_bench.harness import floor


def test_every_profile_names_known_steps():
    for name, steps in floor.PROFILES.items():
        assert set(steps) <= set(floor.STEPS), name
        script = floor.profile_script(steps)
        compile(script, name, "exec")  # each profile is valid Python
        assert floor.READY in script


def test_a_bare_interpreter_is_measured_from_its_own_smaps(monkeypatch):
    monkeypatch.setattr(floor, "STEPS", {**floor.STEPS, "ballast": "_b = bytearray(64 << 20); _b[::4096] = b'x' * len(_b[::4096])"})
    bare = floor.measure_profile([])
    heavy = floor.measure_profile(["ballast"])
    assert 0 < bare["pss"] and bare["pss_anon"] <= bare["pss"]
    # 64 MiB of touched anonymous memory shows up as anonymous PSS, not file.
    assert heavy["pss_anon"] - bare["pss_anon"] > 60 << 20
    assert abs(heavy["pss_file"] - bare["pss_file"]) < 16 << 20


def test_a_failing_profile_is_an_error_with_its_stderr(monkeypatch):
    monkeypatch.setattr(floor, "STEPS", {"boom": "raise SystemExit('no such runtime')"})
    with pytest.raises(RuntimeError, match="no such runtime"):
        floor.measure_profile(["boom"])


def test_run_interleaves_and_summarises(monkeypatch):
    calls = []

    def fake(steps, timeout_s=300.0):
        calls.append(tuple(steps))
        return {"pss": 100 * (len(calls)), "pss_anon": 60, "pss_file": 40, "uss": 50, "import_s": 1.0}

    monkeypatch.setattr(floor, "measure_profile", fake)
    result = floor.run({"a": [], "b": ["torch"]}, runs=3)
    assert calls == [(), ("torch",)] * 3
    assert result["a"]["pss"] == {"median": 300, "min": 100, "max": 500, "n": 3}
    table = floor.markdown(result)
    assert table.count("\n") == 4 and "| a |" in table and "| b |" in table
