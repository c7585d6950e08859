"""What `vllm-omni-edge serve FILE.gguf` serves: a checkpoint built once from the file.

The file is identified by its SHA-256 (read with a progress bar), so a renamed or copied
file finds its build and a changed file gets a new one. The build is our GGUF reader's
bf16 conversion quantized to cpu_int4; an architecture the cpu_int4 builder does not take
is served from the bf16 conversion instead, with a log line naming why. Each directory is
written atomically; one whose manifest does not verify is rebuilt.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from vllm_omni_edge.cache_paths import cache_root

logger = logging.getLogger("vllm_omni_edge.gguf_serving")

READ_BLOCK = 1 << 22


class GgufServingError(ValueError):
    """The path given to serve is not a GGUF file we can build from."""


def file_sha256(path: Path, *, show_progress: bool = True) -> str:
    from tqdm import tqdm

    digest = hashlib.sha256()
    with open(path, "rb") as fh, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                      desc=f"checking {path.name}", disable=not show_progress,
                                      leave=False) as bar:
        for block in iter(lambda: fh.read(READ_BLOCK), b""):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def build_dir(path: Path, digest: str, kind: str) -> Path:
    return cache_root() / "gguf" / "served" / f"{path.stem}-{digest[:16]}-{kind}"


def _good(directory: Path, head: str | None = None) -> bool:
    """Complete (directories appear whole), where a cpu_int4 manifest lists files intact, built
    keeping the file's 4-bit codes and its higher-precision matrices at 6 bits, and (``head``) with the
    head format the builder now uses for a GGUF."""
    from vllm_omni_edge.quantization.builder import stale_gguf_build
    from vllm_omni_edge.quantization.manifest import verify_manifest

    if not (directory / "config.json").is_file():
        return False
    try:
        manifest = verify_manifest(directory)
    except Exception as exc:  # damaged or incomplete: rebuilt by the caller
        logger.warning("%s does not verify (%s); building it again", directory, exc)
        return False
    built_head = (manifest or {}).get("head", "int4")
    if head is not None and built_head != head:
        logger.info("%s was built with a %s head, the builder now keeps a %s one; building it again",
                    directory, built_head, head)
        return False
    stale = stale_gguf_build(manifest) if manifest is not None else None
    if stale is not None:
        logger.info("%s is an older build (%s); building it again", directory, stale)
        return False
    return True


def serving_checkpoint(gguf: Path | str, *, show_progress: bool = True) -> Path:
    """The checkpoint directory to serve for ``gguf``, built on first use."""
    from vllm_omni_edge.models.gguf_to_hf import UnsupportedCheckpointError, convert_gguf_to_hf
    from vllm_omni_edge.quantization.builder import build_cpu_int4_checkpoint, default_formats, gguf_ties_head

    path = Path(gguf).expanduser()
    if not path.is_file():
        raise GgufServingError(f"GGUF file not found: {path}")
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise GgufServingError(f"{path} is not a GGUF file (no GGUF magic at its start)")
    digest = file_sha256(path, show_progress=show_progress)
    int4_dir, bf16_dir = build_dir(path, digest, "cpu_int4"), build_dir(path, digest, "bf16")
    try:
        _, head = default_formats(gguf_ties_head(path), None, None)
    except Exception as exc:  # unreadable past the magic: the build below names the problem
        logger.warning("cannot read %s's tensors (%s)", path.name, exc)
        head = None
    for directory, expected_head in ((int4_dir, head), (bf16_dir, None)):
        if _good(directory, expected_head):
            logger.info("serving %s from its build %s", path.name, directory)
            return directory
    logger.info("building %s from %s (once; later starts reuse it)", int4_dir.name, path)
    try:
        build_cpu_int4_checkpoint(path, int4_dir, progress=show_progress, overwrite=True)
        return int4_dir
    except UnsupportedCheckpointError as exc:
        if "architecture" in str(exc) and "GGUF" in str(exc):
            raise  # our GGUF reader refused the file itself: nothing to fall back to
        logger.warning("cpu_int4 cannot take %s (%s); serving its bf16 conversion", path.name, exc)
    convert_gguf_to_hf(path, bf16_dir, manifest={"source": path.name, "source_sha256": digest})
    return bf16_dir
