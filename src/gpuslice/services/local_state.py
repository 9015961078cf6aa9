"""The state file of ``gpuslice up`` (``state.json`` in its state folder): read with every field
checked, and the process it names told apart from a later one that reuses its pid (the start
time /proc gives), so that ``down`` never signals a process gpuslice did not start."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeGuard

from gpuslice.adapters.proc import alive
from gpuslice.core.errors import ValidationError

STATE_FILE = "state.json"


def read_state(state_dir: Path) -> dict[str, Any] | None:
    """The state file of ``state_dir`` (None when there is none), its fields checked: every
    error names the file and the field."""
    path = state_dir / STATE_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValidationError(str(path), "a local-mode state file", str(exc)) from None
    return check_state(path, doc)


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def check_state(path: Path, doc: object) -> dict[str, Any]:
    """``doc`` as a local-mode state file: the fields ``status``, ``down``, ``select`` and
    ``up`` read, checked, so a damaged file is an error naming the field, never a signal sent
    to a process id it happens to hold."""
    if not isinstance(doc, dict):
        raise ValidationError(str(path), "a local-mode state file (a JSON object)",
                              type(doc).__name__)
    pid = doc.get("pid")
    if not _is_int(pid) or pid <= 0:
        raise ValidationError(f"{path}: pid", "a positive process id", pid)
    start = doc.get("pid_start")
    if start is not None and (not _is_int(start) or start < 0):
        raise ValidationError(f"{path}: pid_start", "the process start time (a whole number "
                              ">= 0) or null", start)
    run_id = doc.get("run_id")
    if not isinstance(run_id, str) or not run_id:
        raise ValidationError(f"{path}: run_id", "a non-empty run id", run_id)
    if not isinstance(doc.get("status", ""), str):
        raise ValidationError(f"{path}: status", "a status word", doc.get("status"))
    router = doc.get("router")
    if router is not None and not (isinstance(router, dict)
                                   and isinstance(router.get("url"), str)
                                   and _is_int(router.get("port"))
                                   and _is_int(router.get("admin_port"))):
        raise ValidationError(f"{path}: router", "null or {url, port, admin_port}", router)
    replicas = doc.setdefault("replicas", [])
    if not isinstance(replicas, list):
        raise ValidationError(f"{path}: replicas", "a list of replicas", replicas)
    for i, r in enumerate(replicas):
        if not isinstance(r, dict):
            raise ValidationError(f"{path}: replicas[{i}]", "a mapping", r)
        for key, want in (("name", str), ("service", str), ("gpu_uuid", str),
                          ("gpu_index", int), ("compute_pct", int), ("memory_mib", int)):
            v = r.get(key)
            if not isinstance(v, want) or isinstance(v, bool):
                raise ValidationError(f"{path}: replicas[{i}].{key}",
                                      "a string" if want is str else "a whole number", v)
    mps = doc.setdefault("mps", [])
    if not isinstance(mps, list):
        raise ValidationError(f"{path}: mps", "a list of MPS daemons", mps)
    for i, m in enumerate(mps):
        for key in ("uuid", "pipe_dir", "log_dir"):
            if not isinstance(m, dict) or not isinstance(m.get(key), str) or not m[key]:
                raise ValidationError(f"{path}: mps[{i}].{key}", "a non-empty string",
                                      m.get(key) if isinstance(m, dict) else m)
    return doc


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """The state letter and start time (clock ticks after boot, field 22) of ``/proc/PID/stat``;
    None when there is no such process or no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot); None where that is unknown. With
    the pid it names one process: a pid the kernel reuses has another start time."""
    st = _proc_stat(pid)
    return None if st is None else st[1]


def _gpuslice_cmdline(pid: int) -> bool:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(b"gpuslice" in a for a in args)


def same_process(pid: int, start: int | None) -> bool:
    """Whether ``pid`` is still the running (not zombie) process that started at ``start``
    (:func:`process_start`, as recorded in the state file). A state file without a start time
    (an older gpuslice's) counts only when the process's command line is gpuslice's; where
    there is no /proc at all, a live pid is all there is to go by."""
    if not alive(pid):
        return False
    st = _proc_stat(pid)
    if st is None:
        return start is None and not Path("/proc/self/stat").exists()
    if st[0] in ("Z", "X"):
        return False
    if start is not None:
        return st[1] == start
    return _gpuslice_cmdline(pid)


def up_running(state: dict[str, Any]) -> bool:
    """Whether the ``gpuslice up`` that wrote ``state`` (from :func:`read_state`) still runs: its
    pid alive *and* still that process (not a later one the pid was reused for)."""
    return same_process(state["pid"], state.get("pid_start"))


def signal_same(pid: int, start: int | None, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the process that started at ``start``
    (a pidfd, where there is one, holds that process between the check and the signal);
    False when it is not."""
    import signal

    fd = None
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        except OSError:
            fd = None  # a kernel without pidfds
    try:
        if not same_process(pid, start):
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        if fd is not None:
            os.close(fd)
