import importlib.metadata
import json
import subprocess

from vllm_omni_edge_bench.harness import provenance
from tests.harness.conftest import FIXTURES


def test_cpuinfo_model_counts_and_kernel_flags():
    info = provenance.parse_cpuinfo((FIXTURES / "cpuinfo_2core_amx.txt").read_text())
    assert info["model_name"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert (info["vendor"], info["family"], info["model"]) == ("GenuineIntel", 6, 143)
    assert info["logical_cpus"] == 2 and info["physical_cores"] == 2
    assert info["kernel_flags"]["amx_tile"] and info["kernel_flags"]["avx512_bf16"]
    assert not info["kernel_flags"]["avx_vnni"]
    assert "sse2" in info["flags"]


def test_cpuinfo_without_family_or_model_says_none():
    info = provenance.parse_cpuinfo("processor\t: 0\nmodel name\t: Some CPU\nmodel\t\t: unknown\n")
    assert info["model_name"] == "Some CPU" and info["family"] is None and info["model"] is None


def test_relevant_env_keeps_runtime_knobs_and_redacts_secrets():
    env = provenance.relevant_env({
        "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2", "ATEN_CPU_CAPABILITY": "avx2",
        "HF_TOKEN": "hf_secret", "VLLM_API_KEY": "k", "HOME": "/root", "PATH": "/bin",
    })
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["HF_TOKEN"] == "<redacted>" and env["VLLM_API_KEY"] == "<redacted>"
    assert "HOME" not in env and "PATH" not in env


def git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def test_git_state_reports_sha_and_dirty(tmp_path):
    assert provenance.git_state(tmp_path)["sha"] is None  # not a repository: no SHA, and a note
    git(tmp_path, "init", "-q")
    (tmp_path / "f").write_text("1")
    git(tmp_path, "add", "f")
    git(tmp_path, "commit", "-qm", "x")
    clean = provenance.git_state(tmp_path)
    assert len(clean["sha"]) == 40 and clean["dirty"] is False
    (tmp_path / "f").write_text("2")
    assert provenance.git_state(tmp_path)["dirty"] is True


def test_collect_is_complete_and_serialisable(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    record = provenance.collect("name: x\n", argv=["edge-harness", "run", "g.yaml"])
    json.dumps(record)  # goes to provenance.json as is
    assert record["grid_text"] == "name: x\n"
    assert record["command"][1:] == ["edge-harness", "run", "g.yaml"]
    assert record["started"] and record["finished"] is None
    assert record["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    for name in provenance.PACKAGES:
        assert name in record["packages"]
    assert record["packages"]["torch"] == importlib.metadata.version("torch")
    assert record["packages"]["vllm-cpu"] == importlib.metadata.version("vllm-cpu")
    cpu = record["cpu"]
    assert cpu["model_name"] and cpu["logical_cpus"] >= 1 and cpu["affinity"]
    assert cpu["torch_cpu_capability"] in {"DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX"}
    assert record["memory"]["total_bytes"] > 0
    assert set(record["git"]) >= {"sha", "dirty"}
