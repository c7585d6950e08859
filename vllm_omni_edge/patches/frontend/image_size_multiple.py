"""Answer an image size the diffusion pipeline cannot make with HTTP 400, not 500.

What: wraps the size check vLLM-Omni's API server runs on every parsed image size
(``api_server._check_max_generated_image_size``, called by ``/v1/images/generations`` and
``/v1/images/edits``) so that it also rejects a width or height that is not a multiple of
what the served pipeline needs, with a 400 that names the multiple and the size asked.
The multiple is read from the served diffusers checkpoint, by the same formula the
pipeline's own ``check_inputs`` uses (``PIPELINE_PATCH_FACTOR``); pipelines not listed
there are left alone.
Why: the pipeline raises a plain ``ValueError`` ("`height` and `width` have to be divisible
by 16 ..."), but vLLM-Omni's diffusion runner keeps only its text and the engine re-raises
it as ``RuntimeError``, so the API server answered ``"size": "60x60"`` on the tiny SD3
server with a 500 (seen on this box, 2026-11-30) after queueing the request.
Verified by: tests/omni/test_e2e_image.py::test_image_size_out_of_range_is_a_clear_error
("100x100" is a 400 naming 16 and the size; /health 200 after) and
tests/omni/test_image_size_multiple.py (the rule, without a server).
Remove when: vLLM-Omni keeps a pipeline's input ``ValueError`` a 4xx through its engine,
or checks the size multiple itself.
"""

from __future__ import annotations

import functools
import json
from http import HTTPStatus
from pathlib import Path

from vllm_omni_edge.patches.base import Kind, PatchRecord, Process, wrap_method_once
from vllm_omni_edge.patches.import_hook import when_imported

TARGET_MODULE = "vllm_omni.entrypoints.openai.api_server"
CHECK_NAME = "_check_max_generated_image_size"

RECORD = PatchRecord(
    name="image_size_multiple",
    kind=Kind.OMNI,
    target=f"{TARGET_MODULE}.{CHECK_NAME}",
    process=Process.FRONTEND,
    why="A width/height the diffusion pipeline cannot make (e.g. 60x60 for SD3, which needs "
    "multiples of 16) failed inside the pipeline and came back as a 500.",
    verified_by="tests/omni/test_e2e_image.py::test_image_size_out_of_range_is_a_clear_error; "
    "tests/omni/test_image_size_multiple.py.",
    remove_when="vLLM-Omni keeps the pipeline's input ValueError a 4xx, or checks the multiple itself.",
    vllm_versions=("0.30.0",),
    package="vllm-omni",
    upstream="none found",
)

# diffusers pipeline class -> the latent patch factor its vLLM-Omni check_inputs multiplies
# the VAE scale factor by (vllm_omni/diffusion/models/sd3/pipeline_sd3.py: patch_size = 2;
# flux/pipeline_flux.py: vae_scale_factor * 2). Both compute the VAE scale factor as
# 2 ** (len(vae.block_out_channels) - 1), default 8.
PIPELINE_PATCH_FACTOR = {
    "StableDiffusion3Pipeline": 2,
    "FluxPipeline": 2,
}


def apply() -> str:
    now = when_imported(TARGET_MODULE, _wrap)
    return "image sizes checked against the pipeline's multiple" + ("" if now else " (on import)")


@functools.lru_cache(maxsize=8)
def size_multiple(model: str | None) -> int | None:
    """The multiple width and height must be for the diffusers pipeline in ``model`` (a local
    directory), or None when unknown (not a directory, not a listed pipeline, unreadable)."""
    if not model:
        return None
    root = Path(model)
    try:
        pipeline_class = json.loads((root / "model_index.json").read_text()).get("_class_name")
        factor = PIPELINE_PATCH_FACTOR.get(pipeline_class)
        if factor is None:
            return None
        vae_path = root / "vae" / "config.json"
        vae = json.loads(vae_path.read_text()) if vae_path.is_file() else {}
    except (OSError, ValueError, AttributeError):
        return None
    channels = vae.get("block_out_channels")
    vae_scale_factor = 2 ** (len(channels) - 1) if channels else 8
    return vae_scale_factor * factor


def size_error(width: int | None, height: int | None, multiple: int | None) -> str | None:
    """The 400's message when ``width x height`` is not a multiple of ``multiple``, else None."""
    if multiple is None or width is None or height is None:
        return None
    if width % multiple == 0 and height % multiple == 0:
        return None
    near_w, near_h = max(multiple, width - width % multiple), max(multiple, height - height % multiple)
    return (
        f"Invalid size {width}x{height}: this model's width and height must be multiples of "
        f"{multiple}. The nearest smaller size is {near_w}x{near_h}."
    )


def served_model(app_state_args) -> str | None:
    return getattr(app_state_args, "model", None)


def check_multiple_too(original):
    def check(app_state_args, width, height, resolution=None):
        message = size_error(width, height, size_multiple(served_model(app_state_args)))
        if message is not None:
            from fastapi import HTTPException

            raise HTTPException(status_code=HTTPStatus.BAD_REQUEST.value, detail=message)
        return original(app_state_args, width, height, resolution)

    return check


def _wrap(module) -> None:
    # The routes call the name through api_server's globals, so rebinding it there is enough.
    wrap_method_once(module, CHECK_NAME, check_multiple_too)
