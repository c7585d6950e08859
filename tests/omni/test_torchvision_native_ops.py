"""PyPI's torchvision (a CUDA build) imports beside torch+cpu with our schema shim; its ops say why not."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_omni_edge.patches.common import torchvision_native_ops


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torchvision_transforms_work_and_native_ops_fail_clearly():
    pytest.importorskip("torchvision", reason="torchvision is installed by scripts/setup.sh")
    result = _run(
        "import json, torch, torchvision\n"
        "from torchvision.transforms.v2 import functional as F\n"
        "x = torch.arange(16.).reshape(1, 1, 4, 4)\n"
        "y = F.resize(x, [2, 2], antialias=False)\n"
        "ref = torch.nn.functional.interpolate(x, size=(2, 2), mode='bilinear', align_corners=False)\n"
        "try:\n"
        "    torchvision.ops.nms(torch.rand(3, 4), torch.rand(3), 0.5); err = ''\n"
        "except RuntimeError as e:\n"
        "    err = str(e)\n"
        "print(json.dumps({'version': torchvision.__version__, 'has_ops': torchvision.extension._has_ops(),"
        " 'resize_ok': bool(torch.allclose(y, ref)), 'nms_error': err}))\n"
    )
    assert result["version"].startswith("0.28.0")
    assert result["resize_ok"]
    if not result["has_ops"]:  # a CPU build of torchvision would have them, and nms would work
        assert "Couldn't load custom C++ ops" in result["nms_error"]


def test_transformers_qwen2_vl_image_processor_runs_on_torchvision():
    pytest.importorskip("torchvision", reason="torchvision is installed by scripts/setup.sh")
    result = _run(
        "import json, numpy as np\n"
        "from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor, smart_resize\n"
        "p = Qwen2VLImageProcessor(min_pixels=56*56, max_pixels=112*112)\n"
        "img = (np.random.default_rng(0).random((64, 80, 3)) * 255).astype('uint8')\n"
        "out = p(images=[img], return_tensors='pt')\n"
        "print(json.dumps({'grid': out['image_grid_thw'].tolist(), 'rows': out['pixel_values'].shape[0],"
        " 'resize': list(smart_resize(64, 80, min_pixels=56*56, max_pixels=112*112))}))\n"
    )
    (t, h, w), = result["grid"]
    assert [h * 14, w * 14] == result["resize"] and result["rows"] == t * h * w


def test_install_is_idempotent_and_a_no_op_once_torchvision_is_imported(monkeypatch):
    from vllm_omni_edge.patches import import_hook

    monkeypatch.setattr(import_hook, "_before", {})
    monkeypatch.setattr(torchvision_native_ops, "_installed", False)
    monkeypatch.delitem(sys.modules, "torchvision._meta_registrations", raising=False)
    assert torchvision_native_ops.install() == "hook installed"
    assert list(import_hook._before) == ["torchvision._meta_registrations"]
    assert torchvision_native_ops.install() == "hook already installed"
    assert len(import_hook._before["torchvision._meta_registrations"]) == 1
    monkeypatch.setattr(torchvision_native_ops, "_installed", False)
    monkeypatch.setitem(sys.modules, "torchvision._meta_registrations", object())
    assert "already imported" in torchvision_native_ops.install()


def test_without_the_shim_pypis_torchvision_does_not_import():
    """Guards the patch's reason: if this starts passing, remove the patch."""
    pytest.importorskip("torchvision", reason="torchvision is installed by scripts/setup.sh")
    code = (
        "from vllm_omni_edge.patches import import_hook\n"
        "import_hook._before.clear()  # the .pth installed the hook; take it away\n"
        "import torchvision\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if out.returncode == 0:
        pytest.fail("torchvision imports without the shim: remove patches/common/torchvision_native_ops.py")
    assert "torchvision::nms does not exist" in out.stderr
