"""Write a directory or file so that readers see all of it or none of it."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(final: Path):
    """Yield a temporary sibling directory; rename it to ``final`` on success.

    An existing ``final`` is replaced only after the new one is complete. On any
    error the temporary directory is removed and ``final`` is left untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
    try:
        yield tmp
        for entry in tmp.rglob("*"):
            if entry.is_file():
                with open(entry, "rb+") as fh:
                    os.fsync(fh.fileno())
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(path: Path):
    """Yield a temporary sibling path to write; it replaces ``path`` on success (mode 0644).

    On any error the temporary file is removed and ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)
