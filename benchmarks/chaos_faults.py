"""The chaos soak's faults (benchmarks/chaos.py), injected one after another at seeded random
intervals. The kinds come in rounds: each round is every kind once, in a seeded random order,
so that a short run still sees each kind (a 2-minute run sees at least one round).

* ``extender-leader-kill``: SIGKILL the extender replica that holds the Lease; its container
  restarts after 1-6 s (the other replica leads once the Lease lapses, 15 s);
* ``dra-allocator-kill``: SIGKILL the claim allocator that holds its Lease; restarts after
  1-6 s (the drivers drop the allocator's taint when the Lease lapses, and kube-scheduler
  allocates meanwhile);
* ``node-agent-kill``: SIGKILL a device-plugin node's agent; restarts after 1-6 s;
* ``dra-driver-kill``: SIGKILL a DRA node's driver; restarts after 1-6 s;
* ``scheduler-restart``: SIGKILL kube-scheduler and start it again (its queue, cache and
  binds in flight lost);
* ``apiserver-freeze``: SIGSTOP kube-apiserver for 10-30 s, then SIGCONT;
* ``agent-restart-mid-bind``: a pod pinned to one node is created and, while it is being
  bound, that node's agent is SIGKILLed and restarted after 1-3 s; on a DRA node the driver is
  killed while the kubelet's NodePrepareResources for a claim is in flight.

A watchdog restarts any component that exits without being told to (as its controller would)
and records it as a crash."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chaos_kubelet import Kubelet
from chaos_load import Workload
from chaos_parts import Api, Components, lease_holder

KINDS = ("extender-leader-kill", "dra-allocator-kill", "node-agent-kill", "dra-driver-kill",
         "scheduler-restart", "apiserver-freeze", "agent-restart-mid-bind")
DRA_ONLY = ("dra-allocator-kill", "dra-driver-kill")


@dataclass
class Fault:
    at_s: float  # seconds into the churn
    kind: str
    target: str
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Faults:
    dev: Any  # gpuslice.devcluster.DevCluster
    api: Api
    comps: Components
    kubelet: Kubelet
    workload: Workload
    rng: random.Random
    dra: bool
    gap_s: tuple[float, float] = (1.0, 6.0)
    t0: float = field(default_factory=time.monotonic)
    done: list[Fault] = field(default_factory=list)
    crashes: list[dict[str, Any]] = field(default_factory=list)
    down: set[str] = field(default_factory=set)  # killed on purpose, not restarted yet
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _bag: list[str] = field(default_factory=list)
    _mid_bind_dra: bool = False

    @property
    def kinds(self) -> tuple[str, ...]:
        return KINDS if self.dra else tuple(k for k in KINDS if k not in DRA_ONLY)

    def stop(self) -> None:
        self._stop.set()

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(self.kinds, 0)
        for f in self.done:
            out[f.kind] += 1
        return out

    def run(self) -> None:
        """Inject faults until :meth:`stop` (each finished before the next starts)."""
        while not self._stop.wait(self.rng.uniform(*self.gap_s)):
            if not self._bag:
                self._bag = list(self.kinds)
                self.rng.shuffle(self._bag)
            kind = self._bag.pop(0)
            start = time.monotonic()
            fault = Fault(round(start - self.t0, 1), kind, "")
            getattr(self, "_" + kind.replace("-", "_"))(fault)
            fault.seconds = round(time.monotonic() - start, 1)
            with self._lock:
                self.done.append(fault)

    # -- the kinds ------------------------------------------------------------------------

    def _kill_restart(self, name: str, delay: tuple[float, float] = (1.0, 6.0),
                      during: Callable[[], None] | None = None) -> float:
        m = self.comps.procs[name]
        with self._lock:
            self.down.add(name)
        try:
            m.kill()
            if during is not None:
                during()
            pause = self.rng.uniform(*delay)
            self._stop.wait(pause)
            m.start()
        finally:
            with self._lock:
                self.down.discard(name)
        return pause

    def _leader(self, lease: str, names: list[str]) -> str:
        try:
            holder = lease_holder(self.api, lease)
        except Exception:  # the API server away: any replica
            holder = ""
        return holder if holder in names else self.rng.choice(names)

    def _extender_leader_kill(self, f: Fault) -> None:
        f.target = self._leader("gpuslice-extender", list(self.comps.extender_pods))
        f.detail = f"restarted after {self._kill_restart(f.target):.1f} s"

    def _dra_allocator_kill(self, f: Fault) -> None:
        f.target = self._leader("gpuslice-dra-allocator", self.comps.allocators)
        f.detail = f"restarted after {self._kill_restart(f.target):.1f} s"

    def _node_agent_kill(self, f: Fault) -> None:
        node = self.rng.choice(sorted(self.comps.agents))
        f.target = self.comps.agents[node]
        f.detail = f"restarted after {self._kill_restart(f.target):.1f} s"

    def _dra_driver_kill(self, f: Fault) -> None:
        node = self.rng.choice(sorted(self.comps.drivers))
        f.target = self.comps.drivers[node]
        f.detail = f"restarted after {self._kill_restart(f.target):.1f} s"

    def _scheduler_restart(self, f: Fault) -> None:
        f.target = "kube-scheduler"
        self.dev.restart_scheduler(kill=True, wait=False)
        f.detail = "SIGKILL, started again"

    def _apiserver_freeze(self, f: Fault) -> None:
        f.target = "kube-apiserver"
        hold = self.rng.uniform(10.0, 30.0)
        self.dev.freeze_apiserver()
        try:
            self._stop.wait(hold)
        finally:
            self.dev.thaw_apiserver()
        f.detail = f"SIGSTOP for {hold:.1f} s"

    def _agent_restart_mid_bind(self, f: Fault) -> None:
        self._mid_bind_dra = not self._mid_bind_dra and self.dra
        if self._mid_bind_dra:
            node = self.rng.choice(sorted(self.comps.drivers))
            name = self.comps.drivers[node]
            fired = threading.Event()
            m = self.comps.procs[name]

            def kill() -> None:
                with self._lock:
                    self.down.add(name)
                m.kill()
                fired.set()

            self.kubelet.arm(node, kill)
            pod = self.workload.make("dra", "share-10", node)
            hit = fired.wait(45.0)
            if not hit:  # no prepare came: the driver is killed anyway
                self.kubelet.nodes[node].armed = None
                kill()
            f.target = name
            when = "while its claim was being prepared" if hit else \
                "with no prepare in flight (none came in 45 s)"
            f.detail = (f"{pod}: killed {when}; restarted after "
                        f"{self._restart_after(name, (1.0, 3.0)):.1f} s")
            return
        node = self.rng.choice(sorted(n for n in self.comps.agents if "a100" in n)
                               or sorted(self.comps.agents))
        f.target = self.comps.agents[node]
        pod = self.workload.make("dp", "frac", node)

        def settle() -> None:  # the extender's bind of the pod is under way
            self._stop.wait(self.rng.uniform(0.0, 0.3))

        pause = self._kill_restart(f.target, (1.0, 3.0), settle)
        f.detail = f"{pod} pinned to {node} and being bound; agent restarted after {pause:.1f} s"

    def _restart_after(self, name: str, delay: tuple[float, float]) -> float:
        pause = self.rng.uniform(*delay)
        self._stop.wait(pause)
        try:
            self.comps.procs[name].start()
        finally:
            with self._lock:
                self.down.discard(name)
        return pause

    # -- the controllers' part: restart what exited on its own -------------------------------

    def watchdog(self) -> None:
        while not self._stop.wait(1.0):
            self.restart_crashed()

    def restart_crashed(self) -> list[str]:
        restarted = []
        for name, m in list(self.comps.procs.items()):
            with self._lock:
                if name in self.down or m.alive() or m.popen is None:
                    continue
            code = m.popen.poll()
            tail = m.log.read_text(errors="replace").splitlines()[-12:]
            self.crashes.append({"at_s": round(time.monotonic() - self.t0, 1),
                                 "component": name, "exit": code, "log_tail": tail})
            m.start()
            restarted.append(name)
        return restarted
