"""The kubelet's part in the chaos soak (benchmarks/chaos.py), on kwok nodes that have none.

Every workload pod carries the finalizer :data:`FINALIZER`, which stands for the kubelet
still running the pod's containers: a deleted pod stays (terminating, still holding its GPUs)
until this stand-in has finished with it, as a real pod stays until its kubelet has stopped
its containers. On a device-plugin node it lets the pod go after a random 0-3 s (a container's
stop); on a DRA node it plays the kubelet's DRA manager (tests/dra/kubelet.py: registration,
``NodePrepareResources`` once the pod is bound with its claims allocated and reserved for it,
``NodeUnprepareResources`` when it is deleted, for every claim whose prepare was tried, as the
kubelet's claim info cache has it (pkg/kubelet/cm/dra/manager.go: the claim is cached before
the call, and ``unprepareResources`` unprepares what is cached), then the pod goes), retrying
a call that failed as the kubelet does (a driver being restarted, the API server away).

:meth:`Kubelet.arm` makes the next prepare on a node kill that node's driver while the call is
in flight (the fault "a node's agent restarted mid-bind")."""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos_parts import Api

FINALIZER = "chaos.gpuslice.io/kubelet"
DRIVER = "gpu.gpuslice.io"


def reg_socket(root: Path) -> Path:
    return root / "k" / "plugins_registry" / f"{DRIVER}-reg.sock"


@dataclass
class NodeSide:
    """One DRA node's driver as the kubelet sees it."""

    node: str
    root: Path
    client: Any = None  # tests.dra.kubelet.DraClient once registered
    armed: Callable[[], None] | None = None  # kill the driver during the next prepare
    retry_at: float = 0.0  # after a failed call, the kubelet waits a second
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(2))

    def drop(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
        self.client = None


class Kubelet:
    def __init__(self, api: Api, ns: str, dra_roots: dict[str, Path], rng: random.Random,
                 ) -> None:
        self.api, self.ns, self.rng = api, ns, rng
        self.nodes = {n: NodeSide(n, r) for n, r in dra_roots.items()}
        # pod UID -> its claims, from the first NodePrepareResources tried (the kubelet's
        # claim info cache, checkpointed before the call: a claim whose prepare failed or was
        # cut by the driver's death is unprepared all the same when its pod goes)
        self.cached: dict[str, list[tuple[str, str, str]]] = {}
        self.prepared: set[str] = set()  # pod UIDs whose claims are prepared
        self.busy: dict[str, Future[None]] = {}  # pod UID -> a call under way
        self.stop_at: dict[str, float] = {}  # pod UID -> when its containers have stopped
        self.counts = {"prepared": 0, "unprepared": 0, "released": 0, "prepare_errors": 0,
                       "unprepare_errors": 0, "killed_mid_prepare": 0,
                       "prepare_cut_by_kill": 0}
        self.errors: list[str] = []  # the last few call errors, for the record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kubelet")
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        for side in self.nodes.values():
            side.pool.shutdown(wait=True, cancel_futures=True)
            side.drop()

    def arm(self, node: str, kill: Callable[[], None]) -> None:
        self.nodes[node].armed = kill

    def _note(self, what: str, exc: BaseException) -> None:
        details = getattr(exc, "details", None)  # a gRPC error's own message
        text = str(details() if callable(details) else exc) or repr(exc)
        text = text.splitlines()[0][:240]
        with self._lock:
            self.errors = [*self.errors[-19:], f"{time.strftime('%H:%M:%S')} {what}: {text}"]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pods = self.api.pods(self.ns)
                claims = {c["metadata"]["name"]: c for c in self.api.items(
                    f"/apis/resource.k8s.io/v1/namespaces/{self.ns}/resourceclaims")}
            except Exception as exc:  # the API server away: try again
                self._note("list", exc)
                self._stop.wait(1.0)
                continue
            for p in pods:
                with contextlib.suppress(Exception):
                    self._pod(p, claims)
            live = {p["metadata"]["uid"] for p in pods}
            for uid in [u for u in self.cached if u not in live]:
                self.cached.pop(uid, None)  # gone without our unprepare: cannot happen
                self.prepared.discard(uid)
            self._stop.wait(0.4)

    def _pod(self, p: dict[str, Any], claims: dict[str, dict[str, Any]]) -> None:
        meta, uid = p["metadata"], p["metadata"]["uid"]
        node = (p.get("spec") or {}).get("nodeName") or ""
        fut = self.busy.get(uid)
        if fut is not None and not fut.done():
            return
        side = self.nodes.get(node)
        if meta.get("deletionTimestamp"):
            if FINALIZER not in (meta.get("finalizers") or []):
                return
            if side is not None and self.cached.get(uid):
                if time.monotonic() >= side.retry_at:
                    self.busy[uid] = side.pool.submit(self._unprepare, side, p)
                return
            at = self.stop_at.setdefault(uid, time.monotonic() + (
                self.rng.uniform(0.0, 3.0) if node and side is None else 0.0))
            if time.monotonic() >= at:
                self._release(p)
            return
        if side is None or uid in self.prepared or time.monotonic() < side.retry_at:
            return
        refs = []
        for st in (p.get("status") or {}).get("resourceClaimStatuses") or []:
            c = claims.get(st.get("resourceClaimName") or "")
            if c is None or not (c.get("status") or {}).get("allocation") or uid not in {
                    r.get("uid") for r in (c["status"].get("reservedFor") or [])}:
                return  # the kubelet waits for the claim (the pod would not start)
            refs.append((c["metadata"]["namespace"], c["metadata"]["uid"],
                         c["metadata"]["name"]))
        if refs:
            self.busy[uid] = side.pool.submit(self._prepare, side, uid, refs)

    def _client(self, side: NodeSide) -> Any:
        from tests.dra.kubelet import DraClient, register

        if side.client is None:
            side.client = DraClient(register(reg_socket(side.root)))
        return side.client

    def _prepare(self, side: NodeSide, uid: str, refs: list[tuple[str, str, str]]) -> None:
        kill = None
        self.cached.setdefault(uid, refs)
        try:
            client = self._client(side)
            kill, side.armed = side.armed, None
            if kill is not None:  # the driver dies while this call is in flight
                threading.Timer(self.rng.uniform(0.0, 0.02), kill).start()
                self.counts["killed_mid_prepare"] += 1
            got = client.prepare(refs)
            bad = [f"{u}: {a.error}" for u, a in got.items() if a.error]
            if bad:
                raise RuntimeError("; ".join(bad))
            self.prepared.add(uid)
            self.counts["prepared"] += 1
        except Exception as exc:  # the kubelet retries a failed prepare
            self.counts["prepare_errors"] += 1
            if kill is not None:  # the call did not finish before the driver died
                self.counts["prepare_cut_by_kill"] += 1
            self._note(f"prepare on {side.node}", exc)
            side.retry_at = time.monotonic() + 1.0
            side.drop()

    def _unprepare(self, side: NodeSide, p: dict[str, Any]) -> None:
        uid = p["metadata"]["uid"]
        try:
            got = self._client(side).unprepare(self.cached[uid])
            bad = [f"{u}: {e}" for u, e in got.items() if e]
            if bad:
                raise RuntimeError("; ".join(bad))
            self.cached.pop(uid, None)
            self.prepared.discard(uid)
            self.counts["unprepared"] += 1
            self._release(p)
        except Exception as exc:
            self.counts["unprepare_errors"] += 1
            self._note(f"unprepare on {side.node}", exc)
            side.retry_at = time.monotonic() + 1.0
            side.drop()

    def _release(self, p: dict[str, Any]) -> None:
        """The containers have stopped: the finalizer off, the pod goes."""
        meta = p["metadata"]
        rest = [f for f in meta.get("finalizers") or [] if f != FINALIZER]
        body = [{"op": "test", "path": "/metadata/resourceVersion",
                 "value": meta["resourceVersion"]},
                {"op": "replace", "path": "/metadata/finalizers", "value": rest}]
        with contextlib.suppress(Exception):  # changed meanwhile: the next pass sees it
            self.api.call("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/"
                          f"{meta['name']}", body, "application/json-patch+json")
            self.counts["released"] += 1
            self.stop_at.pop(meta["uid"], None)


def leaks(dra_roots: dict[str, Path], agent_roots: dict[str, Path]) -> list[tuple[str, str]]:
    """What the node side still holds once every pod is gone: (rule, what). The DRA drivers'
    checkpoint entries and CDI specs, MPS control daemons that still run (a pipe folder whose
    pid file names a live process, or a ``control`` socket left), and the node agents' own
    MPS and CDI folders (never used on kwok nodes: no Allocate)."""
    out: list[tuple[str, str]] = []
    for node, root in sorted(dra_roots.items()):
        ck = root / "k" / "plugins" / DRIVER / "checkpoint.json"
        if ck.exists():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                for uid in (json.loads(ck.read_text())["data"].get("claims") or {}):
                    out.append(("leaked-checkpoint-entry", f"{node}: claim {uid} in {ck}"))
        for spec in sorted((root / "cdi").glob("*claim_*.json")):
            out.append(("leaked-cdi-spec", f"{node}: {spec}"))
        out += [("leaked-mps-daemon", f"{node}: {d}") for d in mps_daemons(root / "mps")]
    for node, root in sorted(agent_roots.items()):
        out += [("leaked-mps-daemon", f"{node}: {d}") for d in mps_daemons(root / "mps")]
        out += [("leaked-cdi-spec", f"{node}: {p}") for p in sorted((root / "cdi").glob("*"))]
    return out


def mps_daemons(folder: Path) -> list[str]:
    """The MPS control daemons that still answer under ``folder`` (one pipe folder each)."""
    out = []
    for pipe in sorted(p for p in folder.glob("*") if p.is_dir()):
        pid_file = pipe / "nvidia-cuda-mps-control.pid"
        pid = 0
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text().strip())
        if pid and Path(f"/proc/{pid}").exists():
            out.append(f"{pipe.name} (pid {pid})")
        elif (pipe / "control").exists() and not pid_file.exists():
            out.append(f"{pipe.name} (control file left)")
    return out


def end_daemons(folder: Path) -> list[int]:
    """SIGTERM the stand-in MPS daemons the soak's drivers started under ``folder`` (by the
    pid each wrote), so that nothing of the run outlives it; their pids."""
    import os
    import signal

    ended = []
    for pid_file in folder.glob("*/nvidia-cuda-mps-control.pid"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if str(folder).encode() in cmdline or b"mps" in cmdline:
                os.kill(pid, signal.SIGTERM)
                ended.append(pid)
    return ended
