"""Atomic, durable file writes: a temporary file in the same directory, fsync, rename over
the target, fsync of the directory. A reader sees the old content or the new, never a part.
The one writer of the node side's state files (the DRA checkpoint and CDI specs, the node
agent's CDI spec, the MPS records)."""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # named for this write: two writers (in two containers, both PID 1; two threads) never
    # share a temporary file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    sync_dir(path.parent)


def sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_durably(path: Path) -> bool:
    """Remove ``path`` (True) or find it gone (False)."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    sync_dir(path.parent)
    return True
