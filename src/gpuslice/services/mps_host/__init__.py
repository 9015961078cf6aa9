"""``gpuslice mps-host``: the home of a node's MPS control daemons (its own DaemonSet).

An MPS client fails its next CUDA call when its control daemon goes (measured on an H200,
docs/gpu-results.md), and a daemon goes with the container it was started in: the kernel
kills every process of a PID namespace when its first process exits, and the runtime kills
what is left in a container's cgroup. Started by the node agent or the DRA driver, the
daemons would die, and every MPS-served replica on the node with them, at each upgrade or
crash of those components. So neither starts them: each writes what it wants
(:mod:`gpuslice.adapters.mps.host`: a record per daemon with its server-side ceiling) and
this process, in a DaemonSet that an upgrade does not roll (``updateStrategy: OnDelete``,
as NVIDIA's MPS control daemon runs beside its device plugin), starts and keeps each wanted
daemon, restarts one that died with its ceiling, and writes a heartbeat the owners read. It
talks to no API server and changes seldom; docs/node-agent.md says what replacing it costs
and how to do it safely (drain the node first).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gpuslice.adapters.mps import CONTROL, MpsDaemon, MpsError
from gpuslice.adapters.mps.host import Heartbeat, Want, read_wants, write_heartbeat
from gpuslice.adapters.proc import running
from gpuslice.core.errors import note_once

log = logging.getLogger("gpuslice.mps_host")


class MpsHost:
    """Keeps a daemon running for every record under ``root``."""

    def __init__(self, root: str | Path, binary: str = CONTROL, *, poll_s: float = 0.25,
                 check_s: float = 5.0, beat_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.root = Path(root)
        self.binary = binary
        self.poll_s, self.check_s, self.beat_s = poll_s, check_s, beat_s
        self.clock, self.wall = clock, wall
        self.started: dict[str, int] = {}  # target -> PID of the daemon started here
        self.restarts: dict[str, int] = {}
        self.problems: list[str] = []
        self._checked: dict[str, float] = {}
        self._unapplied: set[str] = set()  # started here, their ceiling not applied yet
        self._beat_at = float("-inf")
        self._stop = threading.Event()

    def daemon(self, target: str) -> MpsDaemon:
        return MpsDaemon(target, self.root / target, self.root / f"{target}.log",
                         binary=self.binary)

    def _alive(self, d: MpsDaemon) -> bool:
        """Cheap between full checks: its PID (from its PID file) runs and its socket is
        there; every ``check_s`` (and whenever that fails) it must answer a command."""
        pid = d.pid()
        now = self.clock()
        cheap = pid is not None and running(pid) and (d.pipe_dir / "control").exists()
        if cheap and now - self._checked.get(d.uuid, float("-inf")) < self.check_s:
            return True
        self._checked[d.uuid] = now
        return d.healthy()

    def step(self) -> list[str]:
        """One pass: start each wanted daemon that does not answer, with its ceiling.
        Returns the targets started."""
        problems: list[str] = []
        wants = read_wants(self.root, problems)
        for p in problems:
            if note_once(self.problems, p):
                log.warning("%s", p, extra={"event": "bad-record"})
        out = []
        for want in wants:
            d = self.daemon(want.target)
            if self._alive(d):
                if want.target in self._unapplied:
                    self._apply(d, want)
                continue
            again = want.target in self.started
            try:
                d.start()
            except MpsError as exc:
                if note_once(self.problems, f"{want.target}: {exc}"):
                    log.warning("MPS daemon for %s did not start: %s", want.target, exc,
                                extra={"event": "start-failed", "target": want.target})
                continue
            self.started[want.target] = d.pid() or 0
            self._checked[want.target] = self.clock()
            if again:
                self.restarts[want.target] = self.restarts.get(want.target, 0) + 1
            self._apply(d, want)
            log.info("MPS daemon for %s %s (PID %s) for %s, ceiling %d%% / %s", want.target,
                     "restarted" if again else "started", self.started[want.target],
                     want.owner, want.ceiling.thread_pct,
                     f"{want.ceiling.memory_mib} MiB" if want.ceiling.memory_mib else "no "
                     "memory cap", extra={"event": "restarted" if again else "started",
                                          "target": want.target})
            out.append(want.target)
        wanted = {w.target for w in wants}
        for target in [t for t in self.started if t not in wanted]:
            self.started.pop(target)  # its owner quit it
            self._checked.pop(target, None)
        if out or self.clock() - self._beat_at >= self.beat_s:
            self._beat_at = self.clock()
            try:
                write_heartbeat(self.root, Heartbeat(_own_pid(), self.wall(),
                                                     dict(self.started), dict(self.restarts),
                                                     self.binary))
            except OSError as exc:
                if note_once(self.problems, f"heartbeat: {exc}"):
                    log.warning("cannot write the heartbeat: %s", exc,
                                extra={"event": "heartbeat-failed"})
        return out

    def _apply(self, d: MpsDaemon, want: Want) -> None:
        """The record's ceiling on a daemon started here; one that fails is tried again on
        the next pass (with a full health check first)."""
        try:
            d.apply_ceiling(want.ceiling)
        except MpsError as exc:
            self._unapplied.add(want.target)
            self._checked.pop(want.target, None)
            if note_once(self.problems, f"{want.target}: {exc}"):
                log.warning("MPS daemon for %s: its ceiling is not applied yet: %s",
                            want.target, exc, extra={"event": "ceiling-failed",
                                                     "target": want.target})
            return
        self._unapplied.discard(want.target)

    def run(self) -> None:
        """Pass after pass until :meth:`stop`. The daemons are left running: they go with
        this pod (deleting it is how an operator replaces them, docs/node-agent.md)."""
        while not self._stop.is_set():
            t0 = self.clock()
            try:
                self.step()
            except Exception as exc:  # whatever the file system says: keep the daemons
                log.exception("MPS host pass failed")
                note_once(self.problems, f"pass: {type(exc).__name__}: {exc}")
            self._stop.wait(max(0.0, self.poll_s - (self.clock() - t0)))

    def stop(self) -> None:
        self._stop.set()


def _own_pid() -> int:
    import os

    return os.getpid()
