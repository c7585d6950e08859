"""Size + SHA-256 of every file a cpu_int4 checkpoint's weights live in.

The builder writes ``cpu_int4_manifest.json`` as the last file of its atomic
write; loading through ``CpuInt4Config`` checks it, so a truncated copy or an
edited tensor file fails loudly before vLLM starts reading weights. This guards
against accidents (interrupted copies, disk errors), not against an attacker,
who can rewrite the manifest too.

Hashing is done once per file version: a file whose SHA-256 matched is remembered in
the user cache with its size, mtime, ctime, inode and device, and a later start that
finds all five unchanged does not read it again (0.9-1.8 s per start for the 1.4 GB
Qwen2.5-1.5B checkpoint on this box). Any write, copy or rename changes ctime or
inode, so what is skipped is only a re-read of bytes the filesystem says are the
same; ``VLLM_OMNI_EDGE_WEIGHTS_CHECK=always`` hashes every start. Either way a process
checks a file version once (vLLM builds the quantization config twice per start).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST_NAME = "cpu_int4_manifest.json"
VERIFIED_DIR = "verified-weights"  # under the user cache: one record per checked file
_checks = {"hashed": 0, "remembered": 0}  # this process's, for the evidence
# Versions this process already hashed: vLLM builds the quantization config twice per start.
_matched_here: set[str] = set()


class CheckpointIntegrityError(RuntimeError):
    """A cpu_int4 checkpoint's files do not match the manifest written with them."""


def file_record(path: Path) -> dict:
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    return {"bytes": path.stat().st_size, "sha256": digest}


def _file_version(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "inode": st.st_ino, "device": st.st_dev}


def _verified_record_path(path: Path) -> Path:
    from vllm_omni_edge.cache_paths import cache_root

    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return cache_root() / VERIFIED_DIR / f"{key}.json"


def sha256_matches(path: Path, expected_sha256: str) -> bool:
    """Whether ``path`` hashes to ``expected_sha256``; unchanged files verified before are not re-read."""
    from vllm_omni_edge.levers import weights_check_always

    version = {**_file_version(path), "sha256": expected_sha256}
    if json.dumps(version, sort_keys=True) in _matched_here:
        return True
    record_path = _verified_record_path(path)
    if not weights_check_always():
        try:
            if json.loads(record_path.read_text()) == version:
                _checks["remembered"] += 1
                _matched_here.add(json.dumps(version, sort_keys=True))
                return True
        except (OSError, ValueError):
            pass  # no record, or an unreadable one: hash
    _checks["hashed"] += 1
    if file_record(path)["sha256"] != expected_sha256:
        return False
    _matched_here.add(json.dumps(version, sort_keys=True))
    from vllm_omni_edge.atomic import atomic_write_bytes

    try:
        atomic_write_bytes(record_path, json.dumps(version, sort_keys=True).encode())
    except OSError:
        pass  # a read-only cache costs only the memo
    return True


def checks() -> dict[str, int]:
    """Files this process hashed, and files it found unchanged since a match (evidence)."""
    return dict(_checks)


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
        elif not sha256_matches(path, expected["sha256"]):
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
