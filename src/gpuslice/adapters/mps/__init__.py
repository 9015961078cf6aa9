"""NVIDIA MPS: control daemons, one per GPU (or MIG instance), each with its own pipe and log
directories. The only package that runs ``nvidia-cuda-mps-control``.

The control tool's exit status does not report errors (an unknown command prints
``Unknown command "..."`` and exits 0), so every command's output is parsed.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from gpuslice.adapters.proc import running
from gpuslice.core.errors import GpusliceError

CONTROL = "nvidia-cuda-mps-control"
SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
# MPS clients and their control daemon exchange shared memory through /dev/shm, so a client in
# a container (its own IPC namespace and /dev/shm) must see the daemon's: the host directory
# below is the node agent's (and DRA driver's) /dev/shm in their DaemonSets, and is mounted at
# /dev/shm in every MPS client container, as NVIDIA's device plugin (internal/plugin/mps.go)
# and DRA driver (a tmpfs "shm" directory per daemon) do. Without it a client in a pod does
# not reach the daemon unless the pod runs with hostIPC.
CLIENT_SHM = "/dev/shm"
SHM_DIR = "/run/gpuslice/mps-shm"
# the host root of the per-GPU (per-MIG-instance) pipe directories, ``<PIPE_DIR>/<UUID>``, and
# where a client container sees its daemon's (its CUDA_MPS_PIPE_DIRECTORY)
PIPE_DIR = "/run/gpuslice/mps"
PIPE_IN_CONTAINER = "/run/gpuslice/mps"
PID_FILE = "nvidia-cuda-mps-control.pid"  # the control daemon writes it in its pipe directory


def client_mounts(pipe_root: str, target: str, shm_dir: str) -> list[tuple[str, str]]:
    """(host path, container path) of what an MPS client of the daemon serving ``target`` (a
    GPU or MIG instance UUID) needs mounted: the daemon's pipe directory, and the daemons'
    /dev/shm unless ``shm_dir`` is empty."""
    mounts = [(os.path.join(pipe_root, target), PIPE_IN_CONTAINER)]
    if shm_dir:
        mounts.append((shm_dir, CLIENT_SHM))
    return mounts


def ensure_client_mounts(pipe_root: str, target: str, shm_dir: str) -> list[tuple[str, str]]:
    """:func:`client_mounts`, their host folders made first: a bind mount whose source is
    missing fails the container's start (runc: "stat ...: no such file or directory")."""
    mounts = client_mounts(pipe_root, target, shm_dir)
    for host, _ in mounts:
        os.makedirs(host, exist_ok=True)
    return mounts


def pinned_mem_limit(*mib: int) -> str:
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` for a client whose ``CUDA_VISIBLE_DEVICES`` lists
    the devices in this order: ``0=<MiB>M,1=<MiB>M,...`` (the variable takes
    ``<ordinal|UUID>=<limit>`` items; the ordinal is the form measured on the GPU)."""
    return ",".join(f"{i}={int(m)}M" for i, m in enumerate(mib))


def parse_memory_mib(value: str) -> int | None:
    """MiB of an MPS memory value as the control tool prints and takes it (``8192M``,
    ``2G``, ``1.5G``; a bare number is bytes); None for anything else (no limit set)."""
    v = value.strip().upper().removesuffix("B")
    try:
        if v.endswith("G"):
            return int(float(v[:-1]) * 1024)
        if v.endswith("M"):
            return int(float(v[:-1]))
        n = int(v)
    except ValueError:
        return None
    return n // (1 << 20) if n > 0 else None


class MpsError(GpusliceError):
    """An MPS control command failed; the message quotes the tool's output."""


UNCAPPED_MIB = 1 << 20  # a pinned memory limit above any GPU's memory (1 TiB): no cap


@dataclass(frozen=True)
class Ceiling:
    """The most any client of one MPS server may take: the server-side limits. A client's own
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` / ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` only lower
    the server's (protocols.md 3.1-3.2), so a process that rewrites its own environment
    cannot rise above this. MPS (v2) sets limits per server, and all clients of one UID share
    one server, so the ceiling is the largest share handed out on that GPU: exact when the
    shares are equal, and a bound on what a client can take otherwise."""

    thread_pct: int = 100
    memory_mib: int | None = None  # None: no memory cap

    def widened(self, thread_pct: int, memory_mib: int | None) -> Ceiling:
        mem = (None if self.memory_mib is None or memory_mib is None
               else max(self.memory_mib, memory_mib))
        return Ceiling(max(self.thread_pct, thread_pct), mem)


@dataclass(frozen=True)
class MpsDaemon:
    """One control daemon: the GPU (or MIG instance) UUID it serves and its directories."""

    uuid: str
    pipe_dir: Path
    log_dir: Path
    binary: str = CONTROL

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(CUDA_VISIBLE_DEVICES=self.uuid, CUDA_MPS_PIPE_DIRECTORY=str(self.pipe_dir),
                   CUDA_MPS_LOG_DIRECTORY=str(self.log_dir))
        return env

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the daemon in the background and wait until it answers."""
        # the daemon listens on unix sockets in the pipe directory; their paths are limited
        longest = self.pipe_dir.resolve() / "control_privileged"
        if len(str(longest).encode()) > SOCKET_PATH_MAX:
            raise MpsError(f"MPS pipe directory {self.pipe_dir} is too long for its sockets "
                           f"({len(str(longest).encode())} bytes for {longest.name}, at most "
                           f"{SOCKET_PATH_MAX}): choose a shorter state or pipe directory")
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._remove_stale_pid_file()
        # the forked daemon may keep inherited pipes open: its start-up output goes to a file
        err_path = self.log_dir / "start.err"
        try:
            with open(err_path, "wb") as err:
                subprocess.run([self.binary, "-d"], env=self._env(), check=False,
                               stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                               timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"MPS daemon for {self.uuid} did not start: {exc} (is the NVIDIA "
                           f"driver with MPS installed and {self.binary} on PATH?)") from None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.healthy():
                return
            time.sleep(0.05)
        said = err_path.read_text(errors="replace").strip()[-500:]
        raise MpsError(f"MPS daemon for {self.uuid} does not answer on {self.pipe_dir} "
                       f"({'it said: ' + said + '; ' if said else ''}see "
                       f"{self.log_dir / 'control.log'})")

    def _remove_stale_pid_file(self) -> None:
        """A daemon that was killed leaves its PID file in the pipe directory; a new one
        started there may take it for a running instance. Removed when that PID is gone."""
        pid_file = self.pipe_dir / PID_FILE
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            return
        if not running(pid):
            pid_file.unlink(missing_ok=True)

    def command(self, text: str, timeout_s: float = 10.0) -> str:
        """Send one command; its output, or MpsError when the output says it failed."""
        try:
            out = subprocess.run([self.binary], input=text + "\n", env=self._env(),
                                 capture_output=True, text=True, timeout=timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"MPS command {text!r} for {self.uuid}: {exc}") from None
        reply = (out.stdout + out.stderr).strip()
        lowered = reply.lower()
        if lowered.startswith("unknown command") or "cannot find mps control daemon" in lowered \
                or "error" in lowered.split("\n")[0]:
            raise MpsError(f"MPS command {text!r} for {self.uuid} failed: {reply}")
        return reply

    def default_thread_pct(self, timeout_s: float = 2.0) -> int:
        """The thread percentage the next server starts with."""
        reply = self.command("get_default_active_thread_percentage", timeout_s=timeout_s)
        try:
            return round(float(reply.split()[0]))
        except (ValueError, IndexError):
            raise MpsError(f"MPS daemon for {self.uuid} answered {reply!r} to "
                           "get_default_active_thread_percentage") from None

    def default_memory_mib(self, timeout_s: float = 2.0) -> int | None:
        """The pinned memory limit the next server starts with (MiB; None when none is
        set). The getter prints the value as set (``8192M``, ``2G``)."""
        reply = self.command("get_default_device_pinned_mem_limit 0", timeout_s=timeout_s)
        return parse_memory_mib(reply.split()[0] if reply.split() else "")

    def healthy(self) -> bool:
        """The daemon answers its health query with a percentage (as NVIDIA's plugin checks)."""
        try:
            self.default_thread_pct()
        except MpsError:
            return False
        return True

    def servers(self) -> list[int]:
        """PIDs of the running MPS servers (``get_server_list`` prints nothing when none)."""
        reply = self.command("get_server_list")
        return [int(x) for x in reply.split() if x.isdigit()]

    def set_default_limits(self, thread_pct: int | None = None,
                           memory_mib: int | None = None) -> None:
        """Defaults for the next server: thread percentage and pinned memory limit."""
        if thread_pct is not None:
            if not 1 <= thread_pct <= 100:
                raise MpsError(f"thread percentage must be 1..100, got {thread_pct}")
            reply = self.command(f"set_default_active_thread_percentage {thread_pct}")
            if not reply or float(reply.split()[0]) != float(thread_pct):
                raise MpsError(f"MPS did not take thread percentage {thread_pct}: {reply!r}")
        if memory_mib is not None:
            self.command(f"set_default_device_pinned_mem_limit 0 {memory_mib}M")

    def apply_ceiling(self, ceiling: Ceiling, *, was: Ceiling | None = None) -> None:
        """Hold every client to ``ceiling``: the defaults of the next server and the limits of
        the running ones (which apply to the clients that connect from now on). ``was`` is the
        ceiling applied before: a memory cap lifted since is raised past any GPU's memory."""
        memory = ceiling.memory_mib
        if memory is None and was is not None and was.memory_mib is not None:
            memory = UNCAPPED_MIB
        self.set_default_limits(ceiling.thread_pct, memory)
        for pid in self.servers():
            reply = self.command(f"set_active_thread_percentage {pid} {ceiling.thread_pct}")
            if not reply or float(reply.split()[0]) != float(ceiling.thread_pct):
                raise MpsError(f"MPS server {pid} did not take thread percentage "
                               f"{ceiling.thread_pct}: {reply!r}")
            if memory is not None:
                self.command(f"set_device_pinned_mem_limit {pid} 0 {memory}M")

    def pid(self) -> int | None:
        try:
            return int((self.pipe_dir / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return None

    def quit(self, timeout_s: float = 10.0) -> None:
        """Stop the daemon (and its server) and wait until it is gone: it no longer answers,
        its process (from its PID file) has exited, and its sockets and PID file are removed
        (whatever the daemon left of them: seen left behind on an H200 once its server had
        had clients)."""
        pid = self.pid()
        self.command("quit", timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.healthy() and (pid is None or not running(pid)):
                for f in [*self.pipe_dir.glob("control*"), self.pipe_dir / PID_FILE]:
                    f.unlink(missing_ok=True)
                return
            time.sleep(0.05)
        raise MpsError(f"MPS daemon for {self.uuid} did not quit")


def ensure_ceiling(d: MpsDaemon, was: Ceiling | None, thread_pct: int = 100,
                   memory_mib: int | None = None) -> tuple[Ceiling, bool]:
    """Daemon ``d`` runs (started when it does not answer) and its servers hold every client
    to a ceiling that covers one of ``thread_pct`` percent and ``memory_mib`` (None:
    uncapped): ``was`` (the ceiling this process set on it before, kept across the daemon's
    restarts) widened as needed; a daemon found running with none set by this process keeps
    what its default thread percentage lets in. The one rule of the node agent's device
    plugin and of the DRA driver's shares; returns the ceiling now in force and whether the
    daemon was started here."""
    started = not d.healthy()
    if started:
        d.start()
    if was is None and not started:  # adopted: keep what its last owner let in
        was = Ceiling(d.default_thread_pct(), d.default_memory_mib())
    ceiling = (was or Ceiling(thread_pct, memory_mib)).widened(thread_pct, memory_mib)
    if started or ceiling != was:
        d.apply_ceiling(ceiling, was=None if started else was)
    return ceiling, started
