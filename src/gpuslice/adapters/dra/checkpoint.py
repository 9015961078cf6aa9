"""The DRA driver's checkpoint: what it prepared, per claim, durable across restarts.

The kubelet may call NodeUnprepareResources in another driver process than the one that
prepared (after a restart or an upgrade), and the kubeletplugin helper keeps nothing for the
driver, so every preparation is recorded here before its effects are made (state
``PrepareStarted``: the devices and shares it will use, so that nothing else is given them)
and again when it is complete (``PrepareCompleted``: what the kubelet was answered). A restart
finds both: a repeated prepare of a started claim finishes it, a completed one is answered
from here.

The file is JSON ``{"version": 1, "checksum": <sha256 of data>, "data": {...}}`` written
atomically (temporary file, fsync, rename, fsync of the directory); a file whose checksum does
not match is refused with an error rather than trusted.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

from gpuslice.adapters.files import write_atomic
from gpuslice.core.errors import GpusliceError

VERSION = 1
STARTED, COMPLETED = "PrepareStarted", "PrepareCompleted"


class CheckpointError(GpusliceError):
    """The checkpoint file is unreadable or corrupt."""


def _digest(data: dict[str, Any]) -> str:
    canon = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canon).hexdigest()


class Checkpoint:
    """Claims by UID: ``{"state", "namespace", "name", "devices": [...], ...}``. Not
    thread-safe: the driver serializes its prepares and unprepares."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.claims: dict[str, dict[str, Any]] = {}
        self._load()

    def _load(self) -> None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise CheckpointError(f"checkpoint {self.path}: {exc}") from None
        try:
            doc = json.loads(raw)
            data = doc["data"]
            ok = doc.get("version") == VERSION and doc.get("checksum") == _digest(data)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise CheckpointError(f"checkpoint {self.path} is corrupt (bad JSON, version or "
                                  "checksum); move it away to start empty, knowing that the "
                                  "claims it held are then unknown to the driver")
        self.claims = dict(data.get("claims") or {})

    def get(self, uid: str) -> dict[str, Any] | None:
        c = self.claims.get(uid)
        return copy.deepcopy(c) if c is not None else None

    def put(self, uid: str, entry: dict[str, Any]) -> None:
        """Record ``entry``: on disk first, then here, so that a failed write (a full disk)
        leaves both as they were (a :class:`CheckpointError` naming the file)."""
        claims = dict(self.claims)
        claims[uid] = copy.deepcopy(entry)
        self._save(claims)
        self.claims = claims

    def drop(self, uid: str) -> None:
        """Forget ``uid``, on disk first (as :meth:`put`)."""
        if uid not in self.claims:
            return
        claims = {k: v for k, v in self.claims.items() if k != uid}
        self._save(claims)
        self.claims = claims

    def _save(self, claims: dict[str, dict[str, Any]]) -> None:
        data = {"claims": claims}
        doc = {"version": VERSION, "checksum": _digest(data), "data": data}
        try:
            write_atomic(self.path, json.dumps(doc, sort_keys=True, indent=1).encode(), 0o600)
        except OSError as exc:
            raise CheckpointError(f"checkpoint {self.path} not written ({exc}); it still "
                                  "holds what it held before") from None
