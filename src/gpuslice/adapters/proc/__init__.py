"""Child processes that never outlive their parent: replicas, routers, started by the demo and
by local mode. Each child carries a run id in its environment (``GPUSLICE_RUN``) so a later
command (``gpuslice down``, a test) can find exactly the processes of one run.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpuslice.core.errors import GpusliceError

RUN_ENV = "GPUSLICE_RUN"


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running(pid: int) -> bool:
    """:func:`alive`, and not a zombie no one has reaped yet (that one counts as gone)."""
    if not alive(pid):
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def spawn(args: list[str], run_id: str, **kw: Any) -> subprocess.Popen[str]:
    """A child process marked with the run's id in its environment, that dies with this
    process (see :mod:`gpuslice.adapters.proc.child`)."""
    env = {**os.environ, RUN_ENV: run_id, **kw.pop("env", {})}
    wrapped = [sys.executable, "-m", "gpuslice.adapters.proc.child", str(os.getpid()), *args]
    return subprocess.Popen(wrapped, env=env, text=True, **kw)


def wait_line(p: subprocess.Popen[str], key: str, timeout_s: float = 20.0,
              stream: str = "stdout") -> str:
    """The first line of ``p``'s stdout (or stderr) that contains ``key``; raises when the
    process ends or ``timeout_s`` passes first."""
    f = p.stdout if stream == "stdout" else p.stderr
    assert f is not None
    sel = selectors.DefaultSelector()
    sel.register(f, selectors.EVENT_READ)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not sel.select(timeout=0.2):
            if p.poll() is not None:
                break
            continue
        line = f.readline()
        if not line:
            break
        if key in line:
            return line
    raise GpusliceError(f"process {p.args!r} did not report {key!r} (exit status {p.poll()})")


def read_ready(p: subprocess.Popen[str], timeout_s: float = 20.0) -> int:
    """The port a fake replica prints as ``ready PORT``."""
    return int(wait_line(p, "ready ", timeout_s).split()[1])


def terminate(p: subprocess.Popen[str] | None, timeout_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``; waits for the exit either way."""
    if p is None or p.poll() is not None:
        return
    p.terminate()
    try:
        p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout_s)


def processes_of(run_id: str) -> list[int]:
    """PIDs of the live processes started for run ``run_id`` (Linux /proc; empty elsewhere)."""
    found = []
    marker = f"{RUN_ENV}={run_id}".encode()
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if marker in env.split(b"\0"):
            found.append(int(d.name))
    return found
