"""The files between the owners of MPS daemons (node agent, DRA driver) and the MPS host
(``gpuslice mps-host``), all in the pipe root (``/run/gpuslice/mps`` on the host):

* ``<target>.want``: the owner wants a daemon for ``target`` (a GPU or MIG instance UUID)
  and holds its servers to ``ceiling``. JSON ``{"target", "owner", "thread_pct",
  "memory_mib"}``, replaced atomically (written, synced, renamed): a crash leaves the old
  record or the new one, never half of one.
* ``.mps-host.json``: the host's heartbeat: its PID, the wall-clock time of its last pass,
  the daemons it started (target -> PID) and how often each was restarted.

Files, not a socket: either side may restart at any time and finds the other's intent on
disk, and a record outlives both (the ceiling a restarted owner adopts).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuslice.adapters.files import write_atomic
from gpuslice.adapters.mps import Ceiling

WANT_SUFFIX = ".want"
HEARTBEAT = ".mps-host.json"
HEARTBEAT_STALE_S = 10.0  # a host that has not written its heartbeat for this long is gone


@dataclass(frozen=True)
class Want:
    target: str
    owner: str
    ceiling: Ceiling

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "owner": self.owner,
                "thread_pct": self.ceiling.thread_pct, "memory_mib": self.ceiling.memory_mib}


def _valid_target(target: str) -> bool:
    return bool(target) and "/" not in target and not target.startswith(".") \
        and target not in ("..",)


def write_want(root: Path, want: Want) -> None:
    if not _valid_target(want.target):
        raise ValueError(f"MPS target: expected a GPU or MIG instance UUID, got "
                         f"{want.target!r}")
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(root / f"{want.target}{WANT_SUFFIX}", json.dumps(want.to_json()).encode())


def remove_want(root: Path, target: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (root / f"{target}{WANT_SUFFIX}").unlink()


def parse_want(text: str) -> Want:
    """A record's content; ValueError naming the field for anything else."""
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError("expected a JSON object")
    target, owner = raw.get("target"), raw.get("owner")
    if not isinstance(target, str) or not _valid_target(target):
        raise ValueError(f"target: expected a GPU or MIG instance UUID, got {target!r}")
    if not isinstance(owner, str) or not owner:
        raise ValueError(f"owner: expected a component name, got {owner!r}")
    pct, mem = raw.get("thread_pct"), raw.get("memory_mib")
    if not isinstance(pct, int) or isinstance(pct, bool) or not 1 <= pct <= 100:
        raise ValueError(f"thread_pct: expected 1..100, got {pct!r}")
    if mem is not None and (not isinstance(mem, int) or isinstance(mem, bool) or mem < 1):
        raise ValueError(f"memory_mib: expected MiB >= 1 or null, got {mem!r}")
    return Want(target, owner, Ceiling(pct, mem))


def read_want(root: Path, target: str) -> Want | None:
    """``target``'s record; None when there is none (or it cannot be read)."""
    try:
        want = parse_want((root / f"{target}{WANT_SUFFIX}").read_text())
    except (OSError, ValueError):
        return None
    return want if want.target == target else None


def read_wants(root: Path, problems: list[str] | None = None) -> list[Want]:
    """Every valid record under ``root``, by target; one that cannot be read is skipped (and
    said in ``problems``, when given)."""
    out = []
    try:
        names = sorted(p for p in os.listdir(root) if p.endswith(WANT_SUFFIX)
                       and not p.startswith("."))
    except OSError:
        return []
    for name in names:
        try:
            want = parse_want((root / name).read_text())
        except FileNotFoundError:
            continue  # removed meanwhile
        except (OSError, ValueError) as exc:
            if problems is not None:
                problems.append(f"{root / name}: {exc}")
            continue
        if f"{want.target}{WANT_SUFFIX}" != name:
            if problems is not None:
                problems.append(f"{root / name}: target {want.target!r} is not its name")
            continue
        out.append(want)
    return out


@dataclass
class Heartbeat:
    pid: int
    time: float
    started: dict[str, int] = field(default_factory=dict)  # target -> daemon PID
    restarts: dict[str, int] = field(default_factory=dict)
    binary: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "time": self.time, "started": self.started,
                "restarts": self.restarts, "binary": self.binary}


def write_heartbeat(root: Path, beat: Heartbeat) -> None:
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(root / HEARTBEAT, json.dumps(beat.to_json(), sort_keys=True).encode())


def read_heartbeat(root: Path) -> Heartbeat | None:
    try:
        raw = json.loads((root / HEARTBEAT).read_text())
        return Heartbeat(int(raw["pid"]), float(raw["time"]),
                         {str(k): int(v) for k, v in dict(raw.get("started") or {}).items()},
                         {str(k): int(v) for k, v in dict(raw.get("restarts") or {}).items()},
                         str(raw.get("binary") or ""))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def check_host(root: Path, now: float | None = None) -> str:
    """Why a daemon the host should start is not there, as a sentence for an error."""
    beat = read_heartbeat(root)
    if beat is None:
        return (f"no MPS host has written {root / HEARTBEAT}: is the gpuslice-mps-host "
                "DaemonSet running on this node, with the same pipe directory?")
    age = (time.time() if now is None else now) - beat.time
    if age > HEARTBEAT_STALE_S:
        return (f"the MPS host (PID {beat.pid}) last wrote {root / HEARTBEAT} {age:.0f} s "
                "ago: is its pod running (kubectl -n gpuslice-system get pods -l "
                "app.kubernetes.io/name=gpuslice-mps-host)?")
    return (f"the MPS host (PID {beat.pid}) is running but the daemon does not answer: see "
            "its log and the daemon's control.log")
