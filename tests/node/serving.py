"""Replicas serving under open-loop load on the real node, and what a day-two step may not
change: the node tier's upgrade tests (test_upgrade.py, test_upgrade_dra.py).

* :class:`Load`: ``gpuslice router`` as a host process in front of the replicas' pod IPs, and
  requests sent at a fixed rate whatever the answers (open loop), counted as answered,
  failed (no HTTP answer) and 5xx.
* :class:`Snapshot`: the MPS daemons (target -> PID, from their records and PID files on the
  host), the replicas' container restarts and UIDs, and the MPS host's pod.
* :func:`pids_of_pod`: the host processes of a pod (its cgroup names it), to kill one with
  SIGKILL as a crash or an OOM kill would.
"""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuslice.adapters.mps.host import read_wants
from gpuslice.adapters.proc import running
from gpuslice.adapters.proc.pods import pod_of
from gpuslice.devcluster import wait_until
from tests.node.helpers import NodeEnv, kubectl_json

MPS_ROOT = Path("/run/gpuslice/mps")  # the chart's sharing.mps.pipeDir on the host


def pids_of_pod(uid: str, needle: str = "") -> list[int]:
    """Host PIDs of the processes in pod ``uid`` whose command line contains ``needle``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        found = pod_of(int(entry))
        if found is None or found.pod_uid != uid:
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if needle in cmd:
            out.append(int(entry))
    return sorted(out)


def kill_pod_process(env: NodeEnv, namespace: str, selector: str, needle: str) -> str:
    """SIGKILL the main process of the (first) pod of ``selector``; its name."""
    pod = kubectl_json(env, "get", "pods", "-n", namespace, "-l", selector)["items"][0]
    pids = pids_of_pod(pod["metadata"]["uid"], needle)
    assert pids, f"no process of {pod['metadata']['name']} runs {needle!r}"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return str(pod["metadata"]["name"])


def restarts_of(env: NodeEnv, namespace: str, selector: str) -> int:
    pods = kubectl_json(env, "get", "pods", "-n", namespace, "-l", selector)["items"]
    return sum(c.get("restartCount", 0) for p in pods
               for c in p["status"].get("containerStatuses") or [])


@dataclass(frozen=True)
class Snapshot:
    daemons: dict[str, int]  # MPS target -> daemon PID
    restarts: int  # the replicas' container restarts
    replicas: tuple[str, ...]  # the replicas' pod UIDs
    mps_host: tuple[str, ...]  # the MPS host's pod UIDs

    @classmethod
    def take(cls, env: NodeEnv, app_ns: str, app_selector: str) -> Snapshot:
        daemons = {}
        for want in read_wants(MPS_ROOT):
            try:
                pid = int((MPS_ROOT / want.target / "nvidia-cuda-mps-control.pid")
                          .read_text().strip())
            except (OSError, ValueError):
                pid = 0
            daemons[want.target] = pid if pid and running(pid) else 0
        pods = kubectl_json(env, "get", "pods", "-n", app_ns, "-l", app_selector)["items"]
        host = kubectl_json(env, "get", "pods", "-n", "gpuslice-system", "-l",
                            "app.kubernetes.io/name=gpuslice-mps-host")["items"]
        return cls(daemons,
                   sum(c.get("restartCount", 0) for p in pods
                       for c in p["status"].get("containerStatuses") or []),
                   tuple(sorted(p["metadata"]["uid"] for p in pods)),
                   tuple(sorted(p["metadata"]["uid"] for p in host)))


@dataclass
class Counts:
    sent: int = 0
    answered: int = 0
    failed: int = 0  # no HTTP answer (refused, reset, timed out)
    status_5xx: int = 0
    errors: list[str] = field(default_factory=list)

    def row(self) -> dict[str, int]:
        return {"sent": self.sent, "answered": self.answered, "failed": self.failed,
                "5xx": self.status_5xx}


class Load:
    """The router over the replicas and an open-loop load through it."""

    def __init__(self, folder: Path, service: str, replicas: dict[str, str],
                 rate_per_s: float = 25.0) -> None:
        self.service, self.rate = service, rate_per_s
        cfg = folder / "router.json"
        cfg.write_text(json.dumps({"policy": "sed", "services": [{
            "name": service, "replicas": [{"name": n, "url": f"http://{ip}:8080"}
                                          for n, ip in sorted(replicas.items())]}]}))
        self.log = folder / "router.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuslice.cli", "router", "--config", str(cfg), "--listen",
             "127.0.0.1:0", "--admin", "127.0.0.1:0", "--log-format", "json"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.port = int(self._listening()["port"])
        self.counts = Counts()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _listening(self, timeout_s: float = 30.0) -> dict[str, Any]:
        assert self.proc.stderr is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stderr, selectors.EVENT_READ)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if sel.select(timeout=0.2):
                line = self.proc.stderr.readline()
                if '"listening"' in line:
                    threading.Thread(target=self._drain, daemon=True).start()
                    return dict(json.loads(line))
                if not line:
                    break
        raise AssertionError("the router did not start")

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        with self.log.open("w") as out:
            for line in self.proc.stderr:
                out.write(line)

    def ready(self, timeout_s: float = 60.0) -> None:
        """Until a request is answered 200 by every replica path (the router's health
        checks have found them)."""
        import urllib.request

        def ok() -> bool:
            try:
                req = urllib.request.Request(self.url, data=b"{}", method="POST")
                with urllib.request.urlopen(req, timeout=5) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        wait_until("the router answering", ok, timeout_s, every_s=0.5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v2/models/{self.service}/infer"

    def start(self) -> None:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        import aiohttp

        c = self.counts
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async def one(i: int) -> None:
                try:
                    async with session.post(self.url, data=b'{"inputs": []}',
                                            headers={"X-Request-Id": str(i)}) as r:
                        await r.read()
                        if r.status >= 500:
                            c.status_5xx += 1
                            c.errors.append(f"{time.strftime('%H:%M:%S')} #{i}: {r.status}")
                        else:
                            c.answered += 1
                except (aiohttp.ClientError, TimeoutError) as exc:
                    c.failed += 1
                    c.errors.append(f"{time.strftime('%H:%M:%S')} #{i}: {exc!r}")

            tasks = set()
            t0, i = time.monotonic(), 0
            while not self._stop.is_set():
                due = t0 + i / self.rate
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                c.sent += 1
                task = asyncio.ensure_future(one(i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
            if tasks:
                await asyncio.wait(tasks)

    def stop(self) -> Counts:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        return self.counts
