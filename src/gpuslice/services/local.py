"""Local mode: inference services on the GPUs of one machine, without Kubernetes.

``gpuslice up services.yaml`` places a slice per replica on the local GPUs
(:func:`gpuslice.core.local.place_local`), starts one MPS control daemon per GPU in use (private
pipe and log directories under the state directory), launches each replica's command with the
environment of its slice, puts the router in front on one port, restarts replicas that crash
(with back-off), and on SIGINT/SIGTERM stops everything: replicas, router, MPS daemons. The
state directory's ``state.json`` (rewritten atomically on every change) is what
``gpuslice status`` and ``gpuslice down`` read.

The services file is the planner's (``name``, ``model``, ``rate``, ``slo_ms``) with what local
mode needs added per service::

    health_path: /v2/health/ready        # optional, for every replica
    services:
      - name: resnet50
        model: resnet50
        slo_ms: 100                      # router admission control (optional)
        command: ["python", "server.py", "--port", "{port}"]
        replicas: 2                      # default 1
        compute: 30                      # MPS thread % per replica (default: a fair share)
        memory: 8G                       # pinned memory cap per replica (default: fair share)
        gpu: 0                           # optional: pin to a GPU index or UUID
        env: {OMP_NUM_THREADS: "2"}

``{python}`` in a command is the Python running gpuslice.
Each replica gets ``PORT`` (also substituted for ``{port}`` in its command), ``GPUSLICE_SERVICE``,
``GPUSLICE_REPLICA``, ``CUDA_VISIBLE_DEVICES`` (GPU or MIG instance UUID), and with MPS
``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_MPS_LOG_DIRECTORY``, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp

from gpuslice.adapters.mps import MpsDaemon, pinned_mem_limit
from gpuslice.adapters.nvml.port import NvmlPort
from gpuslice.adapters.proc import alive, spawn, terminate
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.local import (
    LocalGpu,
    LocalSlice,
    NoRoom,
    place_local,
)
from gpuslice.core.model import PRIORITIES
from gpuslice.core.routing_config import parse_router_config
from gpuslice.services.local_config import LocalConfig, LocalService
from gpuslice.services.local_state import (
    STATE_FILE,
    process_start,
    read_state,
    same_process,
    signal_same,
    up_running,
)

log = logging.getLogger("gpuslice.local")



def local_gpus(nvml: NvmlPort) -> list[LocalGpu]:
    """The GPUs (and MIG instances) of this machine as local mode sees them."""
    out: list[LocalGpu] = []
    for g in nvml.devices():
        if not g.healthy:
            continue
        try:
            used, util = nvml.usage(g.uuid)
        except GpusliceError:
            used, util = 0, 0
        if g.mig_enabled:
            out.extend(LocalGpu(m.uuid, g.index, f"{g.model} {m.profile}", m.memory_mib)
                       for m in g.mig)
        else:
            out.append(LocalGpu(g.uuid, g.index, g.model, g.memory_mib, used, util))
    return out


def default_state_dir() -> Path:
    env = os.environ.get("GPUSLICE_STATE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpuslice"


def held_slices(state: dict[str, Any] | None) -> list[LocalSlice]:
    """The slices a running local mode holds (none when it is not running)."""
    if state is None or not up_running(state):
        return []
    return [LocalSlice(r["name"], r["service"], r["gpu_uuid"], r["gpu_index"],
                       r["compute_pct"], r["memory_mib"]) for r in state["replicas"]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Replica:
    slice: LocalSlice
    service: LocalService
    port: int = 0
    proc: subprocess.Popen[str] | None = None
    log: IO[str] | None = None
    restarts: int = 0
    status: str = "starting"
    ready: bool = False
    next_start: float = 0.0
    started_at: float = 0.0
    gen: int = 0  # the router knows it as "<replica>#<gen>"
    draining: bool = False

    @property
    def router_name(self) -> str:
        return f"{self.slice.replica}#{self.gen}"


OVERRIDE_FILE = "layout-override"


class LocalRuntime:
    def __init__(self, cfg: LocalConfig, nvml: NvmlPort, state_dir: Path, *, port: int = 8080,
                 admin_port: int = 0, host: str = "127.0.0.1", mps: bool = True,
                 mps_binary: str = "nvidia-cuda-mps-control", run_id: str = "",
                 simulated: int | None = None, admin_host: str | None = None) -> None:
        self.cfg, self.nvml, self.dir = cfg, nvml, state_dir
        self.simulated = simulated  # --fake-gpus N: N simulated GPUs, said everywhere
        self.port, self.admin_port, self.host = port, admin_port, host
        self.admin_host = admin_host or host
        self.mps, self.mps_binary = mps, mps_binary
        self.run_id = run_id or os.urandom(6).hex()
        # with the pid, which process wrote the state: `down` signals only that one
        self.pid_start = process_start(os.getpid())
        self.replicas: list[Replica] = []
        self.daemons: dict[str, MpsDaemon] = {}
        self.router: Any = None
        self.events: list[str] = []
        self._session: aiohttp.ClientSession | None = None
        self.layout: str | None = None  # the slice profile in force
        self.layout_status = ""
        self._blocked: str | None = None  # a layout that did not fit (until the wish changes)
        self._gen = 0

    # -- state -------------------------------------------------------------------------------

    def state(self, status: str) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "pid": os.getpid(), "pid_start": self.pid_start,
            "status": status,
            "simulated": self.simulated,
            "router": None if self.router is None else {
                "url": f"http://{self.host}:{self.router.port}",
                "port": self.router.port, "admin_port": self.router.admin_port,
                "admin_host": self.admin_host},
            "replicas": [{**asdict(r.slice), "name": r.slice.replica, "port": r.port,
                          "router_name": r.router_name,
                          "pid": None if r.proc is None else r.proc.pid,
                          "restarts": r.restarts,
                          "status": "draining" if r.draining else r.status,
                          "log": str(self.dir / "logs" / f"{r.slice.replica}.log")}
                         for r in self.replicas],
            "mps": [{"uuid": u, "pipe_dir": str(d.pipe_dir), "log_dir": str(d.log_dir)}
                    for u, d in self.daemons.items()],
            "layout": {"active": self.layout, "status": self.layout_status,
                       "layouts": sorted(self.cfg.layouts)},
            "events": self.events[-50:],
        }

    def write_state(self, status: str) -> None:
        tmp = self.dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(self.state(status), indent=1))
        tmp.replace(self.dir / STATE_FILE)

    def note(self, text: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')} {text}")
        log.info(text, extra={"simulated_gpus": self.simulated} if self.simulated else None)

    # -- life cycle --------------------------------------------------------------------------

    def plan(self) -> list[LocalSlice]:
        gpus = local_gpus(self.nvml)
        if not gpus:
            raise GpusliceError(f"no GPU to run on: {self.nvml.why_empty() or 'none healthy'}")
        return place_local(gpus, self.cfg.wants(self.layout))

    def _env(self, r: Replica) -> dict[str, str]:
        s = r.slice
        env = {**r.service.env, "PORT": str(r.port), "GPUSLICE_SERVICE": s.service,
               "GPUSLICE_REPLICA": s.replica, "CUDA_VISIBLE_DEVICES": s.gpu_uuid}
        d = self.daemons.get(s.gpu_uuid)
        if d is not None:
            env.update(CUDA_MPS_PIPE_DIRECTORY=str(d.pipe_dir),
                       CUDA_MPS_LOG_DIRECTORY=str(d.log_dir),
                       CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(s.compute_pct),
                       CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=pinned_mem_limit(s.memory_mib))
            if PRIORITIES[r.service.priority] != "0":
                env["CUDA_MPS_CLIENT_PRIORITY"] = PRIORITIES[r.service.priority]
        return env

    def _start(self, r: Replica) -> None:
        r.port = _free_port()
        cmd = [c.replace("{port}", str(r.port)).replace("{python}", sys.executable)
               for c in r.service.command]
        logs = self.dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        if r.log is None:
            r.log = open(logs / f"{r.slice.replica}.log", "a", buffering=1)  # noqa: SIM115
        try:
            r.proc = spawn(cmd, self.run_id, env=self._env(r), stdout=r.log,
                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        except OSError as exc:
            raise GpusliceError(f"replica {r.slice.replica}: cannot run {cmd[0]!r}: "
                                f"{exc}") from None
        r.status, r.ready, r.started_at = "starting", False, time.monotonic()

    async def _probe(self, r: Replica) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(f"http://127.0.0.1:{r.port}{self.cfg.health_path}",
                                         timeout=aiohttp.ClientTimeout(total=1.0)) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    def router_config(self) -> Any:
        services = []
        for s in self.cfg.services:
            reps = [{"name": r.router_name, "url": f"http://127.0.0.1:{r.port}",
                     "gpu": r.slice.gpu_uuid, "slice": f"{r.slice.compute_pct}%",
                     "weight": r.slice.compute_pct, "draining": r.draining}
                    for r in self.replicas if r.service is s and r.ready]
            svc: dict[str, Any] = {"name": s.name, "models": [s.name, s.model],
                                   "replicas": reps}
            if s.slo_ms is not None:
                svc["slo_ms"] = s.slo_ms
            services.append(svc)
        return parse_router_config({"policy": "sed", "services": services,
                                    "health": {"path": self.cfg.health_path,
                                               "interval_s": 1.0}}, need_urls=False)

    async def start(self) -> None:
        from gpuslice.services.router import start_router

        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / OVERRIDE_FILE).unlink(missing_ok=True)
        self.layout = self.wanted_layout()
        if self.simulated:
            names = ", ".join(sorted({g.name for g in self.nvml.devices()}))
            self.note(f"{self.simulated} SIMULATED GPU(s) ({names}): no CUDA and no MPS caps, "
                      "the replicas run on the CPU")
        if self.layout is not None:
            self.note(f"slice profile {self.layout}")
        slices = self.plan()
        for sl in slices:
            self.note(f"{sl.replica}: GPU {sl.gpu_index} ({sl.gpu_uuid}), {sl.compute_pct}% "
                      f"compute, {sl.memory_mib} MiB")
        for uuid in sorted({sl.gpu_uuid for sl in slices}):
            await self._ensure_daemon(uuid)
        by_name = {s.name: s for s in self.cfg.services}
        self.replicas = [Replica(sl, by_name[sl.service]) for sl in slices]
        self._session = aiohttp.ClientSession()
        for r in self.replicas:
            self._start(r)
        self.write_state("starting")
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        while not all(r.ready for r in self.replicas):
            await self._check(restart=False)
            if time.monotonic() > deadline:
                slow = [r.slice.replica for r in self.replicas if not r.ready]
                raise GpusliceError(f"replicas not ready after {self.cfg.ready_timeout_s:.0f} "
                                    f"s: {slow}; see their logs in {self.dir / 'logs'}")
            dead = [r for r in self.replicas if r.proc is not None and r.proc.poll() is not None]
            if dead:
                r = dead[0]
                raise GpusliceError(f"replica {r.slice.replica} exited with status "
                                    f"{r.proc.returncode if r.proc else '?'} while starting; "
                                    f"see {self.dir / 'logs' / (r.slice.replica + '.log')}")
            await asyncio.sleep(0.2)
        self.router = await start_router(self.router_config(), host=self.host, port=self.port,
                                         admin_host=self.admin_host,
                                         admin_port=self.admin_port)
        self.note(f"router on http://{self.host}:{self.router.port} (admin port "
                  f"{self.router.admin_port})")
        self.write_state("running")

    async def _ensure_daemon(self, uuid: str) -> None:
        if not self.mps or uuid in self.daemons:
            return
        n = len(self.daemons)
        d = MpsDaemon(uuid, self.dir / "mps" / f"g{n}", self.dir / "mps" / f"g{n}-log",
                      binary=self.mps_binary)
        await asyncio.get_running_loop().run_in_executor(None, d.start)
        self.daemons[uuid] = d
        self.note(f"MPS control daemon for {uuid} (pipe {d.pipe_dir})")

    def wanted_layout(self) -> str | None:
        """The override written by ``gpuslice switch``, else the window of now, else the
        default (None without layouts)."""
        raw = None
        with contextlib.suppress(OSError):
            raw = (self.dir / OVERRIDE_FILE).read_text().strip() or None
        if raw is not None and raw not in self.cfg.layouts:
            self.layout_status = f"unknown layout {raw!r} asked for; keeping {self.layout}"
            raw = None
        t = time.gmtime()
        return self.cfg.layout_at(t.tm_hour * 60 + t.tm_min, raw)

    async def transition(self, target: str) -> None:
        """Move every replica whose slice differs under ``target`` to its new slice, one at a
        time (:meth:`_replace`). A layout that does not fit changes nothing and is reported; a
        replacement that never answers rolls the replicas already moved back to their old
        slices, the same way, so the machine is left wholly in the old layout."""
        try:
            gpus = local_gpus(self.nvml)
            new = {sl.replica: sl for sl in place_local(gpus, self.cfg.wants(target))}
        except (NoRoom, ValidationError) as exc:
            self._blocked = target
            self.layout_status = f"layout {target} does not fit, nothing changed: {exc}"
            self.note(self.layout_status)
            self.write_state("running")
            return
        self.note(f"switching to slice profile {target}")
        moved: list[tuple[LocalSlice, Replica]] = []  # (old slice, the replica now serving)
        for old in [r for r in self.replicas if new[r.slice.replica] != r.slice]:
            self.layout_status = f"switching to {target}: replacing {old.slice.replica}"
            self.write_state("running")
            rep = await self._replace(old, new[old.slice.replica])
            if rep is None:
                back = 0
                for was, now in reversed(moved):
                    if await self._replace(now, was) is not None:
                        back += 1
                self._blocked = target
                self.layout_status = (f"switch to {target} stopped: the new {old.slice.replica} "
                                      f"did not become ready; {back} of {len(moved)} moved "
                                      f"replica(s) rolled back, {self.layout} stays")
                self.note(self.layout_status)
                self.write_state("running")
                return
            moved.append((old.slice, rep))
        self.layout = target
        self.layout_status = f"{target}: {len(moved)} replica(s) moved"
        self.note(self.layout_status)
        self.write_state("running")

    async def _replace(self, old: Replica, sl: LocalSlice) -> Replica | None:
        """Start a replica of ``old`` on ``sl``, wait until it answers, let ``old`` drain in
        the router and stop it; None (``old`` untouched) when the new one never answers."""
        await self._ensure_daemon(sl.gpu_uuid)
        self._gen += 1
        rep = Replica(sl, old.service, gen=self._gen, log=old.log)
        self._start(rep)
        self.replicas.append(rep)
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        while not await self._probe(rep):
            if time.monotonic() > deadline or (rep.proc and rep.proc.poll() is not None):
                terminate(rep.proc)
                self.replicas.remove(rep)
                return None
            await asyncio.sleep(0.1)
        rep.ready, rep.status = True, "running"
        old.draining = True
        self.router.router.apply(self.router_config())
        await self._drained(old)
        self.replicas.remove(old)
        old.log = None  # the log file is the new replica's now
        terminate(old.proc)
        self.router.router.apply(self.router_config())
        return rep

    async def _drained(self, r: Replica, timeout_s: float = 60.0) -> None:
        """Until the router has no request in flight on ``r``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            svc = self.router.router.services.get(r.service.name)
            i = None if svc is None else svc.index(r.router_name)
            if i is None or svc.views[i].outstanding == 0:
                return
            await asyncio.sleep(0.05)

    async def _check(self, restart: bool = True) -> bool:
        """Probe and restart replicas; True when the set of ready replicas changed."""
        changed = False
        now = time.monotonic()
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is not None:
                if r.status != "crashed":
                    self.note(f"{r.slice.replica} exited with status {r.proc.returncode}")
                    r.status, r.ready = "crashed", False
                    r.next_start = now + min(30.0, 0.5 * 2 ** min(r.restarts, 6))
                    changed = True
                if restart and now >= r.next_start:
                    r.restarts += 1
                    self._start(r)
                    self.note(f"{r.slice.replica} restarted (restart {r.restarts})")
                continue
            if not r.ready and await self._probe(r):
                r.ready, r.status = True, "running"
                changed = True
        return changed

    async def supervise(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
            if stop.is_set():
                break
            if await self._check():
                cfg = self.router_config()
                if all(s.replicas for s in cfg.services):
                    self.router.router.apply(cfg)
                self.write_state("running")
            want = self.wanted_layout()
            if want is not None and want not in (self.layout, self._blocked):
                await self.transition(want)
            elif want == self.layout:
                self._blocked = None

    async def close(self) -> None:
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.terminate()
        for r in self.replicas:
            await asyncio.get_running_loop().run_in_executor(None, terminate, r.proc, 5.0)
            if r.log is not None:
                r.log.close()
            r.status = "stopped"
        if self.router is not None:
            await self.router.close()
        if self._session is not None:
            await self._session.close()
        for uuid, d in self.daemons.items():
            try:
                await asyncio.get_running_loop().run_in_executor(None, d.quit)
            except GpusliceError as exc:
                self.note(f"MPS daemon for {uuid}: {exc}")
        (self.dir / STATE_FILE).unlink(missing_ok=True)
        self.note("stopped: replicas, router and MPS daemons")


async def run_local(rt: LocalRuntime) -> None:
    """``gpuslice up`` in the foreground: until SIGINT or SIGTERM."""
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        starting = asyncio.create_task(rt.start())
        stopping = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting in done:
            starting.result()  # raise a start-up error
            await rt.supervise(stop)
        else:
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
        stopping.cancel()
    finally:
        await rt.close()


def stop_local(state_dir: Path, timeout_s: float = 20.0) -> list[str]:
    """``gpuslice down``: stop the local mode of ``state_dir`` and anything it left behind.
    Returns what was done, one line each."""
    import signal

    from gpuslice.adapters.proc import processes_of

    state = read_state(state_dir)
    if state is None:
        return ["nothing running (no state in " + str(state_dir) + ")"]
    done = []
    pid, start = state["pid"], state.get("pid_start")
    if signal_same(pid, start, signal.SIGTERM):
        deadline = time.monotonic() + timeout_s
        while same_process(pid, start) and time.monotonic() < deadline:
            time.sleep(0.1)
        if signal_same(pid, start, signal.SIGKILL):
            done.append(f"gpuslice up (pid {pid}) did not stop in {timeout_s:.0f} s: killed")
        else:
            done.append(f"stopped gpuslice up (pid {pid})")
    elif alive(pid):
        done.append(f"gpuslice up (pid {pid}) is gone (stale state): pid {pid} is another "
                    "process now, left alone")
    # whatever survived a crash of `up`: its replicas (found by run id) and MPS daemons
    for child in processes_of(state["run_id"]):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
            done.append(f"killed leftover process {child}")
    for m in state.get("mps", []):
        d = MpsDaemon(str(m["uuid"]), Path(m["pipe_dir"]), Path(m["log_dir"]))
        if d.healthy():
            try:
                d.quit()
                done.append(f"quit leftover MPS daemon for {m['uuid']}")
            except GpusliceError as exc:
                done.append(f"MPS daemon for {m['uuid']}: {exc}")
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    return done or ["nothing was running; removed the stale state"]


async def replica_throughput(admin_url: str, window_s: float) -> dict[str, float]:
    """Requests/s answered per replica over ``window_s`` (the router's counters)."""
    from gpuslice.adapters.http.metrics import request_rates

    return await request_rates(admin_url, window_s, by="replica", ok_only=True)
