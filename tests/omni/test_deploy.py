"""CPU deploy YAMLs load through vLLM-Omni's own base_config + platforms mechanism."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_omni_edge.platforms.cpu.deploy import available, cpu_deploy_config


def test_unknown_deploy_name_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no CPU deploy config named 'nope'; available: .*qwen2_5_omni"):
        cpu_deploy_config("nope", tmp_path)


@pytest.mark.parametrize("name", available())
def test_cpu_overlay_resolves_and_applies_for_the_cpu_platform(name, tmp_path):
    import yaml

    from vllm_omni.config.stage_config import _apply_platform_overrides, load_deploy_config

    path = cpu_deploy_config(name, tmp_path)
    base = Path(yaml.safe_load(path.read_text())["base_config"])
    assert base.is_absolute() and base.is_file()
    assert cpu_deploy_config(name, tmp_path) == path  # content-addressed: stable

    deploy = _apply_platform_overrides(load_deploy_config(path), platform="cpu")
    base_stage_ids = {s.stage_id for s in load_deploy_config(base).stages}
    assert {s.stage_id for s in deploy.stages} == base_stage_ids
    for stage in deploy.stages:
        # GPU indices would select non-existent NUMA nodes on CPU.
        assert stage.devices == "cpu", stage.stage_id
        assert stage.enforce_eager is True
        assert 0 < stage.engine_extras["kv_cache_memory_bytes"] <= 1 << 30
        assert stage.env and "VLLM_CPU_OMP_THREADS_BIND" in stage.env


def test_overlay_leaves_other_platforms_alone(tmp_path):
    from vllm_omni.config.stage_config import _apply_platform_overrides, load_deploy_config

    path = cpu_deploy_config("qwen2_5_omni", tmp_path)
    deploy = _apply_platform_overrides(load_deploy_config(path), platform="cuda")
    assert [s.devices for s in deploy.stages] == ["0", "1", "0"]


def test_int4_variant_quantizes_the_llm_stages_only(tmp_path):
    from vllm_omni.config.stage_config import _apply_platform_overrides, load_deploy_config

    path = cpu_deploy_config("qwen2_5_omni_int4", tmp_path)
    deploy = _apply_platform_overrides(load_deploy_config(path), platform="cpu")
    by_id = {s.stage_id: s for s in deploy.stages}
    assert by_id[0].engine_extras["quantization"] == "cpu_int4"  # thinker
    assert by_id[1].engine_extras["quantization"] == "cpu_int4"  # talker
    assert "quantization" not in by_id[2].engine_extras  # code2wav: float32, no vLLM linears
    assert by_id[2].engine_extras["dtype"] == "float32"  # inherited from qwen2_5_omni.yaml
    # Nothing of the variant leaks to another platform.
    cuda = _apply_platform_overrides(load_deploy_config(path), platform="cuda")
    assert all("quantization" not in s.engine_extras for s in cuda.stages)
