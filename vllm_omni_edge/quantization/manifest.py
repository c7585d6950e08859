"""Size + SHA-256 of every file a cpu_int4 checkpoint's weights live in.

The builder writes ``cpu_int4_manifest.json`` as the last file of its atomic
write; loading through ``CpuInt4Config`` checks it, so a truncated copy or an
edited tensor file fails loudly before vLLM starts reading weights. This guards
against accidents (interrupted copies, disk errors), not against an attacker,
who can rewrite the manifest too.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST_NAME = "cpu_int4_manifest.json"


class CheckpointIntegrityError(RuntimeError):
    """A cpu_int4 checkpoint's files do not match the manifest written with them."""


def file_record(path: Path) -> dict:
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    return {"bytes": path.stat().st_size, "sha256": digest}


def write_manifest(directory: Path, files: list[str], info: dict) -> Path:
    directory = Path(directory)
    record = {**info, "files": {name: file_record(directory / name) for name in sorted(files)}}
    path = directory / MANIFEST_NAME
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


def read_manifest(directory: Path) -> dict | None:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointIntegrityError(f"{path} is not valid JSON: {exc}") from exc


def verify_manifest(directory: Path) -> dict | None:
    """Check every listed file; return the manifest, or None if there is none."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        return None
    problems = []
    for name, expected in manifest.get("files", {}).items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != expected["bytes"]:
            problems.append(
                f"{name} has {size} bytes, the manifest says {expected['bytes']} "
                "(truncated or replaced)"
            )
        elif file_record(path)["sha256"] != expected["sha256"]:
            problems.append(
                f"{name} does not match its SHA-256 in the manifest (modified after it was built)"
            )
    if problems:
        raise CheckpointIntegrityError(
            f"cpu_int4 checkpoint {directory} failed its integrity check ({MANIFEST_NAME}): "
            + "; ".join(problems)
            + ". Rebuild it with `vllm-omni-edge quantize`."
        )
    return manifest
