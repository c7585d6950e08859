"""Let PyPI's torchvision 0.28.0 import beside torch 2.13.0+cpu, without its native ops.

What: before ``torchvision._meta_registrations`` runs, and only when torchvision's
compiled ``_C`` library did not load, declares the schemas of ``torchvision::nms`` and
``torchvision::qnms`` (schema only, no kernel). That module calls
``torch.library.register_fake`` on those two ops unconditionally (its other fake
registrations are guarded by ``torchvision.extension._has_ops()``), so without a schema
``import torchvision`` raises "operator torchvision::nms does not exist".
Why: PyPI ships only CUDA builds of torchvision (no sdist since 0.1.6, so it cannot be
built from source with pip), and their ``_C.so`` links the CUDA torch libraries. The
pure-Python part, which is what transformers and vLLM use (``transforms.v2.functional``:
resize, normalize, crop on tensors), works on CPU torch. transformers 5.14's
``models/qwen2_vl/image_processing_qwen2_vl.py`` imports torchvision at module level, and
vLLM's ``qwen2_vl.py`` imports it; vLLM-Omni's pipeline registry imports that chain
(``auk`` -> ``qwen2_5_omni`` -> ``qwen2_5_omni_thinker`` -> ``qwen2_vl``), so
``import vllm_omni.entrypoints`` fails without torchvision. torchvision's own detection
ops (``nms``, ``roi_align``, ...) and ``torchvision.io`` image decoding stay unavailable and
raise torchvision's own error naming the missing C++ ops.
How it is in force: ``scripts/setup.sh`` writes a ``.pth`` file that calls
:func:`install` at interpreter start-up (the finder costs nothing until torchvision is
imported), so every process of the venv sees it; the patch lists re-apply it
(idempotent) for a venv set up without that file.
Verified by: tests/omni/test_torchvision_native_ops.py (fresh interpreters: torchvision
imports, ``transforms.v2.functional.resize`` matches a bilinear reference, transformers'
Qwen2-VL image processor runs, ``ops.nms`` fails with torchvision's message).
Remove when: a torchvision build for torch 2.13 CPU installs from PyPI (or torchvision
guards those two ``register_fake`` calls with ``_has_ops()``).
"""

from __future__ import annotations

import sys
import threading

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process
from vllm_omni_edge.patches.import_hook import before_imported

RECORD = PatchRecord(
    name="torchvision_native_ops",
    kind=Kind.FIX,
    target="sys.meta_path (module 'torchvision._meta_registrations'); torch.library schemas "
    "torchvision::nms, torchvision::qnms",
    process=Process.WORKER,
    why="PyPI's torchvision 0.28.0 is a CUDA build whose _C.so cannot load beside torch "
    "2.13.0+cpu; torchvision tolerates that except for two unguarded register_fake calls, "
    "and transformers/vLLM import torchvision on vLLM-Omni's import path (Qwen2-VL processor).",
    verified_by="tests/omni/test_torchvision_native_ops.py: import in fresh interpreters, "
    "resize vs a reference, transformers' Qwen2-VL image processor, nms gives torchvision's error.",
    remove_when="a torchvision build for torch 2.13 CPU installs from PyPI, or torchvision "
    "guards register_fake('torchvision::nms'/'qnms') with _has_ops().",
    vllm_versions=("0.30.0",),
    package="vllm-omni",
    upstream="none found",
)

_WATCHED = "torchvision._meta_registrations"
# Schemas copied from torchvision's csrc (ops/nms.cpp, ops/quantized/cpu/qnms_kernel.cpp).
_SCHEMAS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_lock = threading.Lock()
_library = None  # the torch.library.Library holding our schemas; kept alive


def declare_missing_schemas() -> list[str]:
    """Declare the schemas torchvision's fake registrations need, if ``_C`` did not."""
    global _library
    import torch

    declared = []
    with _lock:
        for op, schema in _SCHEMAS.items():
            if _op_exists(op):
                continue
            if _library is None:
                _library = torch.library.Library("torchvision", "FRAGMENT")
            _library.define(op + schema)
            declared.append(f"torchvision::{op}")
    return declared


def _op_exists(op: str) -> bool:
    import torch

    try:
        getattr(torch.ops.torchvision, op)
    except (AttributeError, RuntimeError):
        return False
    return True


_installed = False


def install() -> str:
    """Declare the schemas just before torchvision's fake registrations run; cheap, imports nothing."""
    global _installed
    with _lock:
        if _installed:
            return "hook already installed"
        if _WATCHED in sys.modules:
            return "torchvision already imported; nothing to do"
        before_imported(_WATCHED, lambda _module: declare_missing_schemas())
        _installed = True
    return "hook installed"


def apply() -> str:
    return install()
