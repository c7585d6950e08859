"""patches/frontend/image_size_multiple.py, without a server."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi import HTTPException

from vllm_omni_edge.patches.frontend.image_size_multiple import check_multiple_too, size_error, size_multiple


def _pipeline_dir(tmp_path, class_name: str, vae_channels: list[int] | None):
    (tmp_path / "vae").mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
    vae = {} if vae_channels is None else {"block_out_channels": vae_channels}
    (tmp_path / "vae" / "config.json").write_text(json.dumps(vae))
    return str(tmp_path)


def test_multiple_is_vae_scale_times_patch(tmp_path):
    # 4 VAE blocks -> scale 8, SD3 patch 2 -> 16 (what the tiny SD3 pipeline's check_inputs asks).
    assert size_multiple(_pipeline_dir(tmp_path, "StableDiffusion3Pipeline", [16, 16, 16, 16])) == 16


def test_multiple_defaults_to_scale_8_without_block_list(tmp_path):
    assert size_multiple(_pipeline_dir(tmp_path, "FluxPipeline", None)) == 16


def test_unknown_pipeline_or_non_directory_is_not_checked(tmp_path):
    assert size_multiple(_pipeline_dir(tmp_path, "SomeOtherPipeline", [1, 1])) is None
    assert size_multiple(str(tmp_path / "missing")) is None
    assert size_multiple("org/hub-name") is None
    assert size_multiple(None) is None


def test_error_names_the_multiple_and_the_size():
    message = size_error(100, 100, 16)
    assert "100x100" in message and "multiples of 16" in message and "96x96" in message
    assert size_error(64, 48, 16) is None
    assert size_error(None, None, 16) is None  # model default size: nothing to check
    assert size_error(8, 64, 16) is not None and "16x64" in size_error(8, 64, 16)


def test_wrapper_raises_400_before_the_original_and_passes_good_sizes(tmp_path):
    model = _pipeline_dir(tmp_path, "StableDiffusion3Pipeline", [16, 16, 16, 16])
    calls = []
    check = check_multiple_too(lambda args, w, h, r=None: calls.append((w, h, r)))
    args = SimpleNamespace(model=model)
    with pytest.raises(HTTPException) as info:
        check(args, 60, 64)
    assert info.value.status_code == 400 and "60x64" in info.value.detail
    assert calls == []
    check(args, 64, 48)
    check(SimpleNamespace(model=None), 60, 60)  # unknown model: vLLM-Omni's own check only
    assert calls == [(64, 48, None), (60, 60, None)]
