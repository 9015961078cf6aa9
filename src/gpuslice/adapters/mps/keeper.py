"""The MPS control daemons one component owns (the node agent's or the DRA driver's), kept so
that they outlive the component: the one implementation both use.

Each daemon serves one GPU or MIG instance (``target``) with its pipe directory
``<root>/<target>`` and its log directory ``<root>/<target>.log``. Beside them the owner
keeps a small record, ``<root>/<target>.want`` (:mod:`gpuslice.adapters.mps.host`): that the
daemon is wanted, by whom, and the server-side ceiling its clients are held to. The record is
what makes a restart lose nothing:

* an owner that restarts (an upgrade, a crash, ``kill -9``) adopts the daemons whose records
  name it, with their ceilings, their health watch and their quit when the last share goes;
* with ``host=True`` the daemons are started by ``gpuslice mps-host`` (its own DaemonSet,
  which upgrades do not roll: :mod:`gpuslice.services.mps_host`) from these records, not by
  the owner, so that they do not live in the owner's container and die with it. Without it
  (local mode, the demo, tests) the owner starts them itself.

The record sits beside the pipe directory, not in it: the pipe directory is mounted into
client containers, which must not be able to raise their own ceiling.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

from gpuslice.adapters.mps import CONTROL, Ceiling, MpsDaemon, MpsError, ensure_ceiling
from gpuslice.adapters.mps.host import (
    Want,
    check_host,
    read_want,
    read_wants,
    remove_want,
    write_want,
)

UNKNOWN_OWNER = "unknown"


class MpsDaemons:
    """The daemons of one owner (``"node-agent"`` or ``"dra-driver"``) under ``root``."""

    def __init__(self, root: str | Path, owner: str, *, binary: str = CONTROL,
                 host: bool = False, start_timeout_s: float = 15.0) -> None:
        self.root = Path(root)
        self.owner = owner
        self.binary = binary
        self.host = host
        self.start_timeout_s = start_timeout_s
        self.daemons: dict[str, MpsDaemon] = {}  # target -> its daemon, started or adopted
        self.ceilings: dict[str, Ceiling] = {}  # target -> the limits its servers hold
        self.lock = threading.RLock()
        self.restarts = 0

    def daemon(self, target: str) -> MpsDaemon:
        d = self.daemons.get(target)
        if d is None:
            d = MpsDaemon(target, self.root / target, self.root / f"{target}.log",
                          binary=self.binary)
            self.daemons[target] = d
        return d

    def adopt(self) -> list[str]:
        """Take over the daemons whose records name this owner (left by an earlier instance
        of it): their ceilings as recorded. Returns their targets."""
        found = []
        with self.lock:
            for want in read_wants(self.root):
                if want.owner != self.owner:
                    continue
                self.daemon(want.target)
                self.ceilings[want.target] = want.ceiling
                found.append(want.target)
        return found

    def ensure(self, target: str, thread_pct: int = 100, memory_mib: int | None = None) -> bool:
        """The daemon of ``target`` runs and its servers hold every client to a ceiling that
        covers one of ``thread_pct`` percent and ``memory_mib`` MiB (None: uncapped), the
        largest share handed out on it (:func:`gpuslice.adapters.mps.ensure_ceiling`).
        A daemon another owner keeps (its record names it: the node agent's, for the DRA
        driver) is used and stays that owner's. Returns whether it was started now."""
        with self.lock:
            d = self.daemon(target)
            record = read_want(self.root, target)
            was = self.ceilings.get(target) or (record.ceiling if record else None)
            if not self.host:
                ceiling, started = ensure_ceiling(d, was, thread_pct, memory_mib)
            else:
                started = not d.healthy()
                if was is None and not started:  # a running daemon without a record
                    was = adopted_ceiling(d)
                ceiling = (was or Ceiling(thread_pct, memory_mib)).widened(thread_pct,
                                                                           memory_mib)
            # a daemon found running without a record is no one's to quit (started before
            # records, or by hand): it keeps serving after the last share of ours
            owner = record.owner if record else (self.owner if started else UNKNOWN_OWNER)
            if record is None or record.ceiling != ceiling:
                # the record first: a host starts the daemon from it, with this ceiling
                write_want(self.root, Want(target, owner, ceiling))
            if self.host:
                if started:
                    self._wait_for_host(d)
                if started or ceiling != was:
                    d.apply_ceiling(ceiling, was=None if started else was)
            self.ceilings[target] = ceiling
            return started

    def owns(self, target: str) -> bool:
        """Whether ``target``'s daemon is this owner's to quit (its record names it)."""
        record = read_want(self.root, target)
        return record is not None and record.owner == self.owner

    def _wait_for_host(self, d: MpsDaemon) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if d.healthy():
                return
            time.sleep(0.05)
        why = check_host(self.root)
        raise MpsError(f"MPS daemon for {d.uuid} not started within "
                       f"{self.start_timeout_s:g} s: {why}")

    def quit(self, target: str) -> bool:
        """Forget ``target``'s daemon and quit it if it answers (its record goes first, so
        that no host starts it again), then remove its pipe and log folders: no client is
        left (a daemon with clients does not quit, and keeps them); whether it was running."""
        with self.lock:
            d = self.daemon(target)
            remove_want(self.root, target)
            running = d.healthy()
            if running:
                d.quit()
            for folder in (d.pipe_dir, d.log_dir):
                shutil.rmtree(folder, ignore_errors=True)
            self.daemons.pop(target, None)
            self.ceilings.pop(target, None)
            return running

    def quit_all(self) -> list[str]:
        """Quit every daemon this owner started or adopted; the targets that were running.
        A daemon that does not quit (clients attached) raises after the others are done."""
        done, problems = [], []
        for target in sorted(self.daemons):
            try:
                if self.quit(target):
                    done.append(target)
            except MpsError as exc:
                problems.append(str(exc))
        if problems:
            raise MpsError("; ".join(problems))
        return done

    def watch(self) -> list[str]:
        """Restart each daemon that stopped answering, with its ceiling (its running clients
        lost their server with it; new clients need the daemon). With a host the host
        restarts it: nothing is done here. Returns the targets restarted."""
        if self.host:
            return []
        restarted = []
        with self.lock:
            daemons = list(self.daemons.items())
        for target, d in daemons:
            if d.healthy():
                continue
            with self.lock:
                d.start()
                ceiling = self.ceilings.get(target)
                if ceiling is not None:
                    d.apply_ceiling(ceiling)
            self.restarts += 1
            restarted.append(target)
        return restarted


def adopted_ceiling(d: MpsDaemon) -> Ceiling:
    """The ceiling a daemon found running without a record holds its next server to: its
    default thread percentage and pinned memory limit."""
    return Ceiling(d.default_thread_pct(), d.default_memory_mib())
