"""The driver's state and decisions (:class:`DraDriver`); the gRPC servicers
(:mod:`.server`) only translate."""

from __future__ import annotations

import logging
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpuslice.adapters.dra.cdi import CdiSpecs
from gpuslice.adapters.dra.checkpoint import COMPLETED, STARTED, Checkpoint
from gpuslice.adapters.kube.fake import DraPort
from gpuslice.adapters.nvml.port import NvmlError, NvmlPort
from gpuslice.core import dra
from gpuslice.core.errors import GpusliceError
from gpuslice.services.dra_driver.claims import ClaimReader
from gpuslice.services.dra_driver.config import APPLICATION_XIDS, ClaimRef, DraConfig
from gpuslice.services.dra_driver.effects import Effects, mps_targets
from gpuslice.services.dra_driver.plan import ClaimPlanner
from gpuslice.services.dra_driver.slices import SlicePublisher, detect_features, pci_of
from gpuslice.services.dra_driver.usage import ClaimShares
from gpuslice.services.dra_gate import lease_fresh
from gpuslice.services.pod_usage import PodsPort, PodUsage

log = logging.getLogger("gpuslice.dra")
USAGE_EVERY_S = 10.0  # as the node agent measures


class DraDriver:
    """The driver's state and decisions; the gRPC servicers (:mod:`.server`) only translate."""

    def __init__(self, cfg: DraConfig, nvml: NvmlPort, api: DraPort,
                 features: dra.Features | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, gate_keeper: Any = None) -> None:
        self.cfg, self.nvml, self.api = cfg, nvml, api
        # releases the pods held by the allocator's scheduling gate once its Lease is stale
        # (a services.dra_gate.GateKeeper, or None: not this driver's job; issue 58)
        self.gate_keeper = gate_keeper
        self.clock = clock
        self.wall = wall  # Lease renew times are wall-clock times
        self.features = features  # None: asked of the API server at start
        self.effects = Effects(cfg, nvml)
        self.mig = self.effects.mig
        self._mps = self.effects.mps  # the MPS control daemons started or adopted
        self.planner = ClaimPlanner(cfg, nvml)
        self.claims = ClaimReader(api, cfg.claim_read_timeout_s, cfg.max_prepares)
        self.cdi = CdiSpecs(cfg.cdi_dir)
        self.checkpoint = Checkpoint(cfg.checkpoint_path)
        self._lock = threading.Lock()  # prepares' effects and unprepares, one at a time
        self._last_error: dict[str, float] = {}
        self._health_cond = threading.Condition()
        self._health_version = 0
        self.plan = dra.PoolPlan([], {})
        self.publisher = SlicePublisher(api, cfg.driver, cfg.node)
        self.problems: list[str] = []
        self.registration: list[tuple[bool, str]] = []  # what the kubelet told us
        self.allocator_fresh = False  # the claim allocator's Lease, when last read
        self._due: dict[str, float] = {}  # periodic work -> next time (self.clock)
        self.usage: PodUsage | None = None  # what pods use of their shares (measure_usage)

    def measure_usage(self, registry: Any, pods: PodsPort, proc_root: Path = Path("/proc"),
                      **kw: Any) -> PodUsage:
        """Measure, every :data:`USAGE_EVERY_S` of :meth:`tick`, what each pod uses of the
        shares this driver prepared, into ``registry`` (``services.pod_usage``, with the
        shares of :class:`.usage.ClaimShares`)."""
        self.usage = PodUsage(self.cfg.node, self.nvml, pods, registry, proc=proc_root,
                              share_of=ClaimShares(lambda: self.checkpoint.claims), **kw)
        return self.usage

    # -- start -----------------------------------------------------------------------------

    def start(self) -> None:
        """Clean CDI specs a crash left (those of checkpointed claims stay), learn what the
        API server serves, publish the slices."""
        gone = self.cdi.remove_stale(set(self.checkpoint.claims))
        if gone:
            log.info("removed %d stale CDI spec(s): %s", len(gone), ", ".join(gone))
        devices = [e for entry in self.checkpoint.claims.values()
                   for e in entry.get("devices") or []]
        adopted = self.effects.adopt_mps(mps_targets(devices))
        if adopted:
            log.info("adopted the MPS daemons of %s", ", ".join(adopted))
        self.restore()
        if self.features is None:
            self.features = detect_features(self.api, self.cfg.driver, self.cfg.node)
        self.allocator_fresh = self._lease_fresh()
        self.publish()

    def restore(self) -> dict[str, str]:
        """At start, make what every prepared claim (its checkpoint entry COMPLETED) needs
        exist again: its CDI spec, MIG instances it made, the MPS daemons of its shares with
        their ceilings, a time-slice it set. A reboot erases all of them (/var/run/cdi is a
        tmpfs, the GPU loses its instances and daemons) while the checkpoint survives, and
        the kubelet, whose own checkpoint says the claims are prepared, may not ask again:
        its pods would then fail on CDI devices that do not resolve. Each effect is
        idempotent, so a restart without a reboot changes nothing. A claim whose effects
        cannot be made again is said loudly (a log line and a Warning Event on the node);
        its entry stays for the kubelet's unprepare. Returns claim UID -> error."""
        failed: dict[str, str] = {}
        restored = 0
        if self.cfg.mps_host and any(
                mps_targets(e.get("devices") or []) for e in self.checkpoint.claims.values()):
            self._wait_for_mps_host()
        with self._lock:
            for uid, entry in sorted(self.checkpoint.claims.items()):
                if entry.get("state") != COMPLETED:
                    continue  # a prepare cut short: the kubelet retries it
                c = ClaimRef(str(entry.get("namespace")), uid, str(entry.get("name")))
                try:
                    devices = [self.effects.make(c, e) for e in entry["devices"]]
                    if devices:
                        self.cdi.write(uid, devices)
                    restored += 1
                except (GpusliceError, ValueError, KeyError, TypeError, OSError) as exc:
                    failed[uid] = str(exc)
        if restored:
            log.info("restored the effects of %d prepared claim(s) (CDI specs, MIG instances, "
                     "MPS daemons)", restored)
        for uid, why in failed.items():
            entry = self.checkpoint.claims[uid]
            msg = (f"claim {entry.get('namespace')}/{entry.get('name')} ({uid}) was prepared "
                   f"before this start but cannot be restored: {why}; its pods' containers "
                   "cannot start until it is unprepared and prepared again")
            log.error("%s", msg)
            self.problems.append(msg)
            self.event("ClaimNotRestored", msg)
        return failed

    def _wait_for_mps_host(self, timeout_s: float = 60.0) -> None:
        """After a reboot the MPS host's pod starts beside this one: give it time to answer
        (its heartbeat) before the shares' daemons are asked of it."""
        from gpuslice.adapters.mps.host import HEARTBEAT_STALE_S, read_heartbeat

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            beat = read_heartbeat(Path(self.cfg.mps_pipe_dir))
            if beat is not None and self.wall() - beat.time <= HEARTBEAT_STALE_S:
                return
            time.sleep(0.5)
        log.warning("no MPS host answered within %g s: the shares' daemons may not start",
                    timeout_s)

    def modes(self) -> dict[str, str]:
        out = {}
        for g in self.nvml.devices():
            out[g.uuid] = self.cfg.modes.get(g.uuid) or self.cfg.modes.get(str(g.index)) or \
                self.cfg.default_mode
        return out

    def compute_plan(self) -> dra.PoolPlan:
        facts = [dra.GpuFacts(g, *pci_of(g.index, self.nvml)) for g in self.nvml.devices()]
        unhealthy = set(self._last_error) | {g.uuid for g in self.nvml.devices() if not g.healthy}
        return dra.pool_slices(facts, self.modes(), self.nvml.driver_version(),
                               self.features or dra.Features(), unhealthy, self.cfg.taints,
                               allocator_taint=self.allocator_fresh)

    # -- the claim allocator's taint (docs/dra-placement.md) ---------------------------------

    def _lease_fresh(self) -> bool:
        """Whether the allocator's Lease was renewed within its duration (coordination/v1
        Lease: ``renewTime`` + ``leaseDurationSeconds``); a Lease we may not read counts as
        stale (the taint is then never put on: pods fall back to the default allocator)."""
        if self.cfg.allocator_lease is None:
            return False
        ns, name = self.cfg.allocator_lease
        try:
            lease = self.api.get_lease(ns, name)
        except GpusliceError as exc:
            msg = f"cannot read the allocator's Lease {ns}/{name}: {exc}"
            if msg not in self.problems:
                log.warning("%s", msg)
                self.problems.append(msg)
            return False
        self._keep_gates(lease)
        return lease_fresh(lease, self.wall())

    def _keep_gates(self, lease: dict[str, Any] | None) -> None:
        """The gate keeper's round with the Lease just read (best effort: a failure is
        logged, and the next read tries again)."""
        if self.gate_keeper is None:
            return
        try:
            self.gate_keeper.step(lease)
        except GpusliceError as exc:
            log.warning("releasing pods held by the allocator's gate: %s (retried)", exc)

    def check_allocator(self) -> bool:
        """Read the allocator's Lease; republish when it turned fresh or stale (returned)."""
        fresh = self._lease_fresh()
        if fresh == self.allocator_fresh:
            return False
        log.info("claim allocator lease %s: %s the allocator taint",
                 "fresh" if fresh else "stale", "adding" if fresh else "removing")
        self.allocator_fresh = fresh
        self.publish()
        return True

    def resync(self) -> bool:
        """Compare the pool in the API server with ours and repair it (slices deleted by the
        kubelet at its start or by anyone else, changed behind our back); returned: written."""
        if not self.publisher.publish(self.plan.slices):
            return False
        if self.publisher.dropped:
            self.publish()  # re-detects the features and publishes what is served
        return True

    def tick(self, poll_s: float) -> None:
        """One round of the background loop: health events for up to ``poll_s``, then the
        Lease, the pool and the pods' usage when due. API errors are logged and retried next
        round (the Go helper's ``HandleError`` with recoverable errors)."""
        try:
            self.health_step(poll_s)
        except GpusliceError as exc:
            log.warning("publishing after a health change: %s (retried)", exc)
            self._due.pop("resync", None)
        now = self.clock()
        work: list[tuple[str, float, Callable[[], object]]] = [
            ("lease", self.cfg.lease_poll_s, self.check_allocator),
            ("resync", self.cfg.resync_s, self.resync)]
        if self.usage is not None:
            work.append(("usage", USAGE_EVERY_S, self.usage.step))
        for what, every, fn in work:
            if now < self._due.get(what, 0.0):
                continue
            self._due[what] = now + every
            try:
                fn()
            except GpusliceError as exc:
                log.warning("%s: %s (retried)", what, exc)

    def publish(self) -> None:
        self._publish()
        if self.publisher.dropped:
            # a feature gate went off since the start (the Go helper reports this as a
            # DroppedFieldsError to HandleError): ask again and publish what is served
            msg = (f"the API server stored slices {', '.join(self.publisher.dropped)} without "
                   "some of their fields (a DRA feature gate was turned off?); detecting the "
                   "served features again")
            log.warning("%s", msg)
            self.event("DroppedFields", msg)
            self.features = detect_features(self.api, self.cfg.driver, self.cfg.node)
            self._publish()

    def _publish(self) -> None:
        plan = self.compute_plan()
        self.plan = plan
        # the health streams first: they need no API server, which may not answer now
        with self._health_cond:
            self._health_version += 1
            self._health_cond.notify_all()
        for w in plan.warnings:
            if w not in self.problems:
                log.warning("%s", w)
                self.problems.append(w)
                self.event("DeviceModelFallback", w)
        self.publisher.publish(plan.slices)

    def event(self, reason: str, message: str) -> None:
        """A Warning Event on this node (best effort: the log has it too)."""
        try:
            node_uid = (self.api.get_node(self.cfg.node).get("metadata") or {}).get("uid", "")
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self.api.create_event("default", {
                "apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{self.cfg.node}.{uuidlib.uuid4().hex[:16]}",
                             "namespace": "default"},
                "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": self.cfg.node,
                                   "uid": node_uid},
                "reason": reason, "message": message[:1024], "type": "Warning",
                "source": {"component": "gpuslice-dra-driver", "host": self.cfg.node},
                "firstTimestamp": now, "lastTimestamp": now, "count": 1})
        except GpusliceError as exc:
            log.warning("could not record event %s: %s", reason, exc)

    # -- prepare ---------------------------------------------------------------------------

    def prepare(self, claims: list[ClaimRef]) -> dict[str, list[dict[str, Any]] | str]:
        """Claim UID -> its devices (``request_names``, ``pool``, ``device``, ``cdi``,
        ``share_id``) or an error message."""
        out: dict[str, list[dict[str, Any]] | str] = {}
        order: list[ClaimRef] = []
        for i, c in enumerate(claims):
            missing = [f for f in ("namespace", "uid", "name") if not getattr(c, f)]
            if missing:
                out[c.uid] = (f"claims[{i}].{missing[0]}: required (dra/v1 api.proto: "
                              "namespace, uid and name are all REQUIRED)")
            elif c.uid not in out and all(o.uid != c.uid for o in order):
                order.append(c)  # a claim listed twice gets one answer
        # the API calls first, outside the lock (the Go helper's getResourceClaims before
        # serializeGRPCIfEnabled), all within one deadline (claims.py)
        fetched = self.claims.read(order)
        with self._lock:
            for c in order:
                claim = fetched[c.uid]
                if isinstance(claim, GpusliceError):
                    out[c.uid] = self._failed("prepare", c, claim)
                    continue
                try:
                    out[c.uid] = self._prepare_one(c, claim)
                except (GpusliceError, ValueError, KeyError, TypeError) as exc:
                    out[c.uid] = self._failed("prepare", c, exc)
        return out

    @staticmethod
    def _failed(what: str, c: ClaimRef, exc: Exception) -> str:
        msg = str(exc) if isinstance(exc, GpusliceError) else f"{type(exc).__name__}: {exc}"
        log.warning("%s %s/%s (%s): %s", what, c.namespace, c.name, c.uid, msg)
        return f"claim {c.namespace}/{c.name}: {msg}"

    def _prepare_one(self, c: ClaimRef, claim: dict[str, Any]) -> list[dict[str, Any]]:
        done = self.checkpoint.get(c.uid)
        if done is not None and done.get("state") == COMPLETED:
            return list(done["answer"])  # idempotent: what the kubelet was answered before
        allocation = claim["status"]["allocation"]
        entries = self.planner.plan(c, allocation, self.plan, self.checkpoint.claims)
        # reserve before any effect: a restart finds these devices taken by this claim
        self.checkpoint.put(c.uid, {"state": STARTED, "namespace": c.namespace,
                                    "name": c.name, "devices": entries})
        cdi_devices, answer = [], []
        for e in entries:
            cdi_devices.append(self.effects.make(c, e))
            answer.append({"request_names": [e["request"].split("/", 1)[0]],
                           "pool": e["pool"], "device": e["device"],
                           "cdi": [cdi_devices[-1].qualified()],
                           "share_id": e.get("shareID", "")})
        if cdi_devices:
            self.cdi.write(c.uid, cdi_devices)
        self.checkpoint.put(c.uid, {"state": COMPLETED, "namespace": c.namespace,
                                    "name": c.name, "devices": entries, "answer": answer})
        return answer

    def ensure_mps(self, target: str) -> None:
        """The MPS control daemon of GPU (or MIG instance) ``target`` runs (one already
        running there is adopted)."""
        self.effects.ensure_mps(target)

    def stop_mps(self) -> list[str]:
        """Quit the MPS control daemons this driver started or adopted; their targets. For
        local runs (``gpuslice demo --dra``) only: the DaemonSet leaves them running for the
        containers that use them."""
        return self.effects.stop_mps()

    def close(self) -> None:
        """Stop reading claims (a read under way ends within its deadline)."""
        self.claims.close()

    # -- unprepare -------------------------------------------------------------------------

    def unprepare(self, claims: list[ClaimRef]) -> dict[str, str]:
        """Claim UID -> "" (done, also for a claim never prepared here) or an error. No API
        server call: the checkpoint holds what was prepared."""
        out: dict[str, str] = {}
        with self._lock:
            for c in claims:
                try:
                    self._unprepare_one(c)
                    out[c.uid] = ""
                except (GpusliceError, ValueError, KeyError, OSError) as exc:
                    log.warning("unprepare %s/%s (%s): %s", c.namespace, c.name, c.uid, exc)
                    out[c.uid] = f"claim {c.namespace}/{c.name}: {exc}"
        return out

    def _unprepare_one(self, c: ClaimRef) -> None:
        entry = self.checkpoint.get(c.uid)
        if entry is not None:
            others = [x for uid, o in self.checkpoint.claims.items() if uid != c.uid
                      for x in o["devices"]]
            self.effects.undo(entry, others)
        self.cdi.remove(c.uid)
        self.checkpoint.drop(c.uid)

    # -- health ----------------------------------------------------------------------------

    def health_step(self, timeout_s: float) -> bool:
        """Take NVML events for up to ``timeout_s``; recover GPUs that stayed quiet; republish
        when something changed (returned)."""
        try:
            events = self.nvml.events(timeout_s)
        except NvmlError as exc:
            log.warning("NVML events: %s", exc)
            events = []
        changed = False
        for ev in events:
            if ev.xid in APPLICATION_XIDS:
                continue
            changed |= ev.uuid not in self._last_error
            self._last_error[ev.uuid] = self.clock()
        now = self.clock()
        for gpu, at in list(self._last_error.items()):
            if now - at >= self.cfg.quiet_s:
                del self._last_error[gpu]
                changed = True
        if changed:
            self.publish()
        return changed

    def device_health(self) -> list[tuple[str, str, bool]]:
        """(pool, device, healthy) of every device of the current plan, and of the devices
        prepared for claims that the plan no longer publishes (an unhealthy GPU's, left out
        of the slices without taints): the pods using them must see them unhealthy."""
        bad = set(self._last_error) | {g.uuid for g in self.nvml.devices() if not g.healthy}
        devices = {name: ref.gpu_uuid for name, ref in self.plan.devices.items()}
        for entry in list(self.checkpoint.claims.values()):  # a snapshot: prepares go on
            for x in entry.get("devices") or []:
                devices.setdefault(str(x["device"]), str(x["gpu"]))
        return [(self.cfg.node, name, gpu not in bad) for name, gpu in sorted(devices.items())]

    def watch_health(self, active: Callable[[], bool]) -> Iterator[list[tuple[str, str, bool]]]:
        """The complete device health list now, whenever it changes, and again every
        ``health_resend`` seconds: the kubelet marks a device Unknown once its last report is
        older than its ``health_check_timeout_seconds`` (kubernetes pkg/kubelet/cm/dra/
        healthinfo.go, ``getHealthInfo``), so a quiet stream must still speak."""
        seen = -1
        last = -float("inf")
        while active():
            with self._health_cond:
                due = last + self.cfg.health_resend - self.clock()
                if seen == self._health_version and due > 0:
                    self._health_cond.wait(min(0.5, due))
                    continue
                seen = self._health_version
            last = self.clock()
            yield self.device_health()
