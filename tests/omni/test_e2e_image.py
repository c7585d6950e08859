"""Image generation on CPU, end to end: a tiny Stable Diffusion 3 through vLLM-Omni's diffusion stage.

The pipeline is built locally from diffusers' and transformers' real SD3 classes with random
weights (``vllm_omni_edge/omni/tiny_models.py``), so the pictures are noise; the tests check
that the diffusion stage runs on the CPU platform, that the answers are valid PNGs of the
requested size and that bad input gets a clear 4xx. (A one-stage pipeline runs its diffusion
stage inside the API server process, so the stage-death test uses the speech pipeline:
test_e2e_stage_death.py.)
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, vllm_env
from tests.omni.omni_server import OmniServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Edge-sized limit for the server (128 x 128 pixels), so "out of range" is cheap to ask for.
MAX_IMAGE_PIXELS = 128 * 128
# Eager: on CPU a compiled diffusion transformer costs minutes of inductor start-up.
SERVE_ARGS = ("--enforce-eager", "--max-generated-image-size", str(MAX_IMAGE_PIXELS))
START_TIMEOUT_S = 900


@pytest.fixture(scope="session")
def tiny_sd3_model() -> Path:
    from vllm_omni_edge.models.default_model import cache_root
    from vllm_omni_edge.omni.tiny_models import tiny_sd3

    return tiny_sd3(cache_root() / "tiny")


def _png_size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG"
    image.load()  # decodes the whole stream: a truncated PNG fails here
    return image.size


def test_omni_python_api_generates_a_png(tiny_sd3_model, tmp_path):
    png = tmp_path / "out.png"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.omni.omni_image_probe", str(tiny_sd3_model), str(png), "64", "48"],
        cwd=REPO, env=vllm_env(), capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    result = json.loads(Path(f"{png}.json").read_text())
    assert result["images"] == 1 and result["final_output_type"] == "image", result
    assert _png_size(png.read_bytes()) == (64, 48)


def _generate(server: OmniServer, size: str | None = "64x48", timeout: float = 600, **extra) -> httpx.Response:
    body = {"prompt": "a red square on a blue field", "n": 1, "num_inference_steps": 2,
            "guidance_scale": 2.0, "seed": 0, "response_format": "b64_json", **extra}
    if size is not None:
        body["size"] = size
    return httpx.post(server.base_url + "/v1/images/generations", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def image_server(tiny_sd3_model, tmp_path_factory):
    server = OmniServer(tiny_sd3_model, tmp_path_factory.mktemp("omni-image") / "server.log", *SERVE_ARGS,
                        init_timeout_s=START_TIMEOUT_S)
    try:
        server.wait_ready(START_TIMEOUT_S)
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("size", ["64x48", "32x96"])
def test_images_generations_returns_a_png_of_the_requested_size(image_server, size):
    resp = _generate(image_server, size)
    assert resp.status_code == 200, resp.text[-2000:]
    data = resp.json()["data"]
    assert len(data) == 1
    width, height = (int(v) for v in size.split("x"))
    assert _png_size(base64.b64decode(data[0]["b64_json"])) == (width, height)


@pytest.mark.parametrize(
    ("size", "named"),
    [
        ("256x256", "256x256"),  # over the server's --max-generated-image-size
        ("0x64", "0x64"),  # not a positive size
        ("64by64", "WIDTHxHEIGHT"),  # not a size at all
        ("100x100", "multiples of 16"),  # SD3 needs multiples of VAE factor 8 x patch 2
        ("64x40", "64x40"),  # one side off is enough
    ],
)
def test_image_size_out_of_range_is_a_clear_error(image_server, size, named):
    resp = _generate(image_server, size, timeout=120)
    assert 400 <= resp.status_code < 500, resp.text[-2000:]
    assert named in resp.text, resp.text
    assert image_server.health() == 200


def test_unsupported_output_modality_is_a_clear_error(image_server):
    body = {"model": image_server.model_name(), "modalities": ["audio"],
            "messages": [{"role": "user", "content": "a red square"}]}
    resp = httpx.post(image_server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 400, resp.text[-2000:]
    assert "audio" in resp.text.lower() and "unsupported" in resp.text.lower(), resp.text
    assert image_server.health() == 200
