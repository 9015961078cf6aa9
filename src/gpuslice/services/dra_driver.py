"""gpuslice's DRA driver (``gpuslice dra-driver``, a node DaemonSet): the kubelet plugin of
Dynamic Resource Allocation for driver ``gpu.gpuslice.io``.

What the Go ``kubeletplugin`` helper does for drivers written in Go is done here:

- **registration**: ``pluginregistration.Registration`` on
  ``<kubelet>/plugins_registry/<driver>-reg.sock`` answers GetInfo with type ``DRAPlugin``, the
  DRA socket, and the versions ``v1.DRAPlugin``, ``v1beta1.DRAPlugin``,
  ``v1alpha1.DRAResourceHealth`` (the kubelet takes the first it supports);
- **the DRA service** (v1 and v1beta1) and the health stream on
  ``<kubelet>/plugins/<driver>/dra.sock``, with gRPC keepalive so that an idle kubelet
  connection is noticed (dra-example-driver#126, kubernetes#133920);
- **prepare / unprepare**, serialized: each claim is read from the API server (its UID must
  match: a claim deleted and recreated under the same name is another claim), only this
  driver's results are handled, every claim gets its own answer or error, a repeated prepare
  gives the same answer and an unprepare of an unknown claim succeeds;
- **a checkpoint** (``adapters.dra.checkpoint``) written before any effect and after the last,
  so that a restart mid-flight neither loses a preparation nor gives its devices twice;
- **CDI specs** (``adapters.dra.cdi``), one per claim, removed on unprepare, stale ones
  removed at start;
- **ResourceSlices** of the node's pool (``core.dra.pool_slices``), republished with a new
  pool generation when the devices or their health change.

The three models' effects on prepare: a **share** (consumable capacity) becomes MPS caps for
its clients (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` from its consumed ``compute``,
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` from its ``memory``) under the GPU's one MPS control
daemon, refused when the shares prepared on that GPU would over-commit it; a **MIG** device
is created through the MIG executor (and destroyed on unprepare); a **whole GPU** is handed
over, exclusive unless its GpuConfig says TimeSlicing or MPS.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpuslice.adapters.dra.cdi import CdiDevice, CdiSpecs, device_name
from gpuslice.adapters.dra.checkpoint import COMPLETED, STARTED, Checkpoint
from gpuslice.adapters.kube.fake import ApiNotFound, DraPort
from gpuslice.adapters.kubelet import dra_health_v1alpha1_pb2 as hpb
from gpuslice.adapters.kubelet import dra_health_v1alpha1_pb2_grpc as hpbg
from gpuslice.adapters.kubelet import dra_v1_pb2 as v1
from gpuslice.adapters.kubelet import dra_v1_pb2_grpc as v1g
from gpuslice.adapters.kubelet import dra_v1beta1_pb2 as v1beta1
from gpuslice.adapters.kubelet import dra_v1beta1_pb2_grpc as v1beta1g
from gpuslice.adapters.kubelet import pluginregistration_v1_pb2 as rpb
from gpuslice.adapters.kubelet import pluginregistration_v1_pb2_grpc as rpbg
from gpuslice.adapters.mps import (
    PIPE_DIR,
    PIPE_IN_CONTAINER,
    SHM_DIR,
    MpsDaemon,
    client_mounts,
    pinned_mem_limit,
)
from gpuslice.adapters.nvml.port import NvmlError, NvmlPort
from gpuslice.core import dra
from gpuslice.core.catalog import MigGeometry
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.mig import MigPlacement, layout_problems
from gpuslice.services.mig_executor import MigExecutor

log = logging.getLogger("gpuslice.dra")

PLUGIN_TYPE = "DRAPlugin"  # pluginregistration/v1 constants.go
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})  # the application's fault, not the GPU's
# server-side keepalive: ping an idle kubelet connection, and accept the kubelet's pings
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
)


@dataclass
class DraConfig:
    node: str
    kubelet_dir: Path = Path("/var/lib/kubelet")
    driver: str = dra.DRIVER
    cdi_dir: Path = Path("/var/run/cdi")
    state_dir: Path | None = None  # default: the plugin directory
    mps_pipe_dir: str = PIPE_DIR  # the node agent's: one daemon per GPU
    mps_shm_dir: str = SHM_DIR  # the daemons' /dev/shm, mounted there in clients ("": none)
    mps_binary: str = "nvidia-cuda-mps-control"
    default_mode: str = dra.WHOLE
    modes: dict[str, str] = field(default_factory=dict)  # GPU index or UUID -> mode
    taints: bool = True  # unhealthy devices tainted (else left out of the slices)
    quiet_s: float = 60.0  # a GPU without a new XID for this long is healthy again
    health_timeout_s: int = 120  # health_check_timeout_seconds in the health stream
    # the complete list is sent again at least this often, so that the kubelet (which marks a
    # device Unknown once its last report is older than the timeout) never does; default a
    # quarter of the timeout
    health_resend_s: float | None = None
    dev_dir: str = "/dev"
    # the claim allocator's Lease (issue 21): while it is fresh our consumable-capacity
    # devices carry its taint; None: never taint
    allocator_lease: tuple[str, str] | None = ("gpuslice-system", "gpuslice-dra-allocator")
    lease_poll_s: float = 2.0  # how often the Lease is read
    resync_s: float = 10.0  # how often the pool is compared with the API server's

    @property
    def health_resend(self) -> float:
        return self.health_resend_s or max(1.0, self.health_timeout_s / 4)

    @property
    def plugin_dir(self) -> Path:
        return self.kubelet_dir / "plugins" / self.driver

    @property
    def dra_socket(self) -> Path:
        return self.plugin_dir / "dra.sock"

    @property
    def registration_socket(self) -> Path:
        return self.kubelet_dir / "plugins_registry" / f"{self.driver}-reg.sock"

    @property
    def checkpoint_path(self) -> Path:
        return (self.state_dir or self.plugin_dir) / "checkpoint.json"


class ClaimError(GpusliceError):
    """This claim cannot be prepared; the message goes back to the kubelet for it alone."""


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str


def parse_modes(items: list[str], field_name: str = "--gpu-mode") -> dict[str, str]:
    """``INDEX_OR_UUID=MODE`` items (``0=share``, ``GPU-abc=mig``)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, mode = item.partition("=")
        if not sep or not key.strip() or mode.strip() not in dra.MODES:
            raise ValidationError(field_name, f"INDEX_OR_UUID=MODE with MODE one of "
                                  f"{', '.join(dra.MODES)}", item)
        out[key.strip()] = mode.strip()
    return out


class DraDriver:
    """The driver's state and decisions; the gRPC servicers below only translate."""

    def __init__(self, cfg: DraConfig, nvml: NvmlPort, api: DraPort,
                 features: dra.Features | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.cfg, self.nvml, self.api = cfg, nvml, api
        self.clock = clock
        self.wall = wall  # Lease renew times are wall-clock times
        self.features = features  # None: asked of the API server at start
        self.mig = MigExecutor(nvml)
        self.cdi = CdiSpecs(cfg.cdi_dir)
        self.checkpoint = Checkpoint(cfg.checkpoint_path)
        self._lock = threading.Lock()  # prepares and unprepares, one at a time
        self._mps: dict[str, MpsDaemon] = {}
        self._last_error: dict[str, float] = {}
        self._health_cond = threading.Condition()
        self._health_version = 0
        self.plan = dra.PoolPlan([], {})
        self.publisher = SlicePublisher(api, cfg.driver, cfg.node)
        self.problems: list[str] = []
        self.registration: list[tuple[bool, str]] = []  # what the kubelet told us
        self.allocator_fresh = False  # the claim allocator's Lease, when last read
        self._due: dict[str, float] = {}  # periodic work -> next time (self.clock)

    # -- start -----------------------------------------------------------------------------

    def start(self) -> None:
        """Clean CDI specs a crash left (those of checkpointed claims stay), learn what the
        API server serves, publish the slices."""
        gone = self.cdi.remove_stale(set(self.checkpoint.claims))
        if gone:
            log.info("removed %d stale CDI spec(s): %s", len(gone), ", ".join(gone))
        if self.features is None:
            self.features = detect_features(self.api, self.cfg.driver, self.cfg.node)
        self.allocator_fresh = self._lease_fresh()
        self.publish()

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
        spec = (lease or {}).get("spec") or {}
        if not spec.get("holderIdentity") or not spec.get("renewTime"):
            return False
        from datetime import datetime

        try:
            renewed = datetime.fromisoformat(str(spec["renewTime"]).replace("Z", "+00:00"))
            duration = float(spec.get("leaseDurationSeconds") or 0)
        except (TypeError, ValueError):
            return False
        return self.wall() < renewed.timestamp() + duration

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
        Lease and the pool when due. API errors are logged and retried next round (the Go
        helper's ``HandleError`` with recoverable errors)."""
        try:
            self.health_step(poll_s)
        except GpusliceError as exc:
            log.warning("publishing after a health change: %s (retried)", exc)
            self._due.pop("resync", None)
        now = self.clock()
        for what, every, fn in (("lease", self.cfg.lease_poll_s, self.check_allocator),
                                ("resync", self.cfg.resync_s, self.resync)):
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
        for w in plan.warnings:
            if w not in self.problems:
                log.warning("%s", w)
                self.problems.append(w)
                self.event("DeviceModelFallback", w)
        self.plan = plan
        self.publisher.publish(plan.slices)
        with self._health_cond:
            self._health_version += 1
            self._health_cond.notify_all()

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
        fetched: dict[str, dict[str, Any]] = {}
        order: list[ClaimRef] = []
        # the API calls first, outside the lock (the Go helper's getResourceClaims before
        # serializeGRPCIfEnabled); a claim listed twice gets one answer
        for i, c in enumerate(claims):
            missing = [f for f in ("namespace", "uid", "name") if not getattr(c, f)]
            if missing:
                out[c.uid] = (f"claims[{i}].{missing[0]}: required (dra/v1 api.proto: "
                              "namespace, uid and name are all REQUIRED)")
                continue
            if c.uid in fetched or c.uid in out:
                continue
            try:
                fetched[c.uid] = self._fetch(c)
                order.append(c)
            except GpusliceError as exc:
                out[c.uid] = self._failed("prepare", c, exc)
        with self._lock:
            for c in order:
                try:
                    out[c.uid] = self._prepare_one(c, fetched[c.uid])
                except (GpusliceError, ValueError, KeyError, TypeError) as exc:
                    out[c.uid] = self._failed("prepare", c, exc)
        return out

    @staticmethod
    def _failed(what: str, c: ClaimRef, exc: Exception) -> str:
        msg = str(exc) if isinstance(exc, GpusliceError) else f"{type(exc).__name__}: {exc}"
        log.warning("%s %s/%s (%s): %s", what, c.namespace, c.name, c.uid, msg)
        return f"claim {c.namespace}/{c.name}: {msg}"

    def _fetch(self, c: ClaimRef) -> dict[str, Any]:
        """The claim from the API server, checked as the kubeletplugin helper checks it
        (draplugin.go, ``getResourceClaims``): it exists, it is the claim the kubelet means
        (same UID, else it "got replaced"), it is allocated."""
        try:
            claim = self.api.get_resource_claim(c.namespace, c.name)
        except ApiNotFound:
            raise ClaimError("not found in the API server") from None
        uid = (claim.get("metadata") or {}).get("uid")
        if uid != c.uid:
            raise ClaimError(f"got replaced: it has UID {uid}, the kubelet asked for {c.uid} "
                             "(the claim was deleted and recreated)")
        if not (claim.get("status") or {}).get("allocation"):
            raise ClaimError("is not allocated")
        return claim

    def _prepare_one(self, c: ClaimRef, claim: dict[str, Any]) -> list[dict[str, Any]]:
        done = self.checkpoint.get(c.uid)
        if done is not None and done.get("state") == COMPLETED:
            return list(done["answer"])  # idempotent: what the kubelet was answered before
        allocation = claim["status"]["allocation"]
        entries = self._plan_claim(c, allocation)
        # reserve before any effect: a restart finds these devices taken by this claim
        self.checkpoint.put(c.uid, {"state": STARTED, "namespace": c.namespace,
                                    "name": c.name, "devices": entries})
        cdi_devices, answer = [], []
        for e in entries:
            cdi_devices.append(self._effect(c, e))
            answer.append({"request_names": [e["request"].split("/", 1)[0]],
                           "pool": e["pool"], "device": e["device"],
                           "cdi": [cdi_devices[-1].qualified()],
                           "share_id": e.get("shareID", "")})
        if cdi_devices:
            self.cdi.write(c.uid, cdi_devices)
        self.checkpoint.put(c.uid, {"state": COMPLETED, "namespace": c.namespace,
                                    "name": c.name, "devices": entries, "answer": answer})
        return answer

    def _configs(self, allocation: dict[str, Any]) -> list[tuple[list[str], dra.Config]]:
        out = []
        for i, cfg in enumerate((allocation.get("devices") or {}).get("config") or []):
            opaque = cfg.get("opaque") or {}
            if opaque.get("driver") != self.cfg.driver:
                continue  # another driver's
            where = f"status.allocation.devices.config[{i}].opaque.parameters"
            try:
                decoded = dra.decode_config(opaque.get("parameters"), where)
            except ValidationError as exc:
                raise ClaimError(f"bad opaque config: {exc}") from None
            out.append((list(cfg.get("requests") or []), decoded))
        return out

    def _plan_claim(self, c: ClaimRef, allocation: dict[str, Any]) -> list[dict[str, Any]]:
        configs = self._configs(allocation)
        results = [r for r in (allocation.get("devices") or {}).get("results") or []
                   if r.get("driver") == self.cfg.driver]
        # what other claims hold; admin-access results hold nothing (resource/v1 types.go,
        # DeviceRequestAllocationResult.AdminAccess: the device may be in use by others)
        others = {uid: {**e, "devices": [x for x in e["devices"] if not x.get("admin")]}
                  for uid, e in self.checkpoint.claims.items() if uid != c.uid}
        entries: list[dict[str, Any]] = []
        for i, r in enumerate(results):
            where = f"status.allocation.devices.results[{i}]"
            if r.get("pool") != self.cfg.node:
                raise ClaimError(f"{where}.pool: {r.get('pool')!r} is not this node's pool "
                                 f"({self.cfg.node})")
            ref = self.plan.devices.get(str(r.get("device")))
            if ref is None:
                raise ClaimError(f"{where}.device: {r.get('device')!r} is not a device this "
                                 "driver publishes on this node")
            applied = dra.config_for(configs, str(r.get("request", "")))
            e: dict[str, Any] = {"request": str(r.get("request", "")), "pool": r["pool"],
                                 "device": r["device"], "type": ref.type,
                                 "gpu": ref.gpu_uuid, "index": ref.gpu_index}
            wrong = [type(x).__name__ for x in applied
                     if not isinstance(x, _CONFIG_FOR[ref.type])]
            if wrong:
                raise ClaimError(f"{where}: a {wrong[0]} does not apply to a {ref.type} device "
                                 f"({r['device']}); use {_CONFIG_FOR[ref.type].__name__}")
            last = applied[-1] if applied else None
            if r.get("adminAccess"):
                # monitoring / management access: the device as it is, no limits, no effects
                e.update(admin=True, shareID=str(r.get("shareID") or ""), profile=ref.profile,
                         start=ref.start, migUUID=ref.mig_uuid)
                entries.append(e)
                continue
            mine = [x for x in entries if not x.get("admin")]
            if ref.type == dra.TYPE_SHARE:
                share = r.get("shareID")
                if not share:
                    raise ClaimError(f"{where}.shareID: missing for a device that allows "
                                     "multiple allocations (DRAConsumableCapacity off in the "
                                     "scheduler?)")
                mps = last.mps if isinstance(last, dra.MpsConfig) else dra.MpsSettings()
                try:
                    caps = dra.share_caps(r.get("consumedCapacity") or {}, ref.memory_mib, mps,
                                          f"{where}.consumedCapacity")
                except ValidationError as exc:
                    raise ClaimError(str(exc)) from None
                held = [dra.ShareCaps(x["threadPct"], x["memoryMiB"])
                        for o in others.values() for x in o["devices"]
                        if x.get("type") == dra.TYPE_SHARE and x["gpu"] == ref.gpu_uuid]
                held += [dra.ShareCaps(x["threadPct"], x["memoryMiB"]) for x in mine
                         if x.get("type") == dra.TYPE_SHARE and x["gpu"] == ref.gpu_uuid]
                problems = dra.share_problems(held, caps, ref.memory_mib)
                if problems:
                    raise ClaimError(f"share {share} of GPU {ref.gpu_index} refused: "
                                     f"{problems[0]}")
                e.update(shareID=share, threadPct=caps.thread_pct, memoryMiB=caps.memory_mib)
            elif ref.type == dra.TYPE_MIG:
                e.update(profile=ref.profile, start=ref.start, migUUID=ref.mig_uuid)
                if isinstance(last, dra.MigConfig):
                    e.update(strategy=last.strategy,
                             mpsPct=last.mps.active_thread_percentage,
                             mpsMiB=last.mps.pinned_memory_mib)
                clash = self._mig_clash(ref, others, mine)
                if clash:
                    raise ClaimError(f"{where}.device {r['device']}: {clash}")
            else:
                holder = next((f"{o['namespace']}/{o['name']}" for o in others.values()
                               for x in o["devices"] if x["device"] == r["device"]), None)
                if holder:
                    raise ClaimError(f"{where}.device {r['device']} is prepared for claim "
                                     f"{holder} already")
                if any(x["device"] == r["device"] for x in mine):
                    raise ClaimError(f"{where}.device {r['device']} is allocated twice in this "
                                     "claim (a whole GPU is one allocation)")
                if isinstance(last, dra.GpuConfig):
                    e.update(strategy=last.strategy, interval=last.interval,
                             mpsPct=last.mps.active_thread_percentage,
                             mpsMiB=last.mps.pinned_memory_mib)
            entries.append(e)
        targets = sorted({t for t in map(_mps_target, entries) if t})
        if len(targets) > 1:
            raise ClaimError(
                f"MPS on {len(targets)} GPUs or MIG devices in one claim ({', '.join(targets)}): "
                "a CUDA process talks to one MPS control daemon (one CUDA_MPS_PIPE_DIRECTORY, "
                "one CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), so a container cannot hold MPS shares "
                "of two GPUs; ask for each GPU's share in its own claim, used by its own "
                "container")
        return entries

    def _mig_clash(self, ref: dra.DeviceRef, others: dict[str, Any],
                   entries: list[dict[str, Any]]) -> str:
        """Why a MIG placement cannot be prepared next to those already held ("" if it can):
        the last line of defense behind the scheduler's counters."""
        geo = self._geometry(ref.gpu_uuid)
        held = [x for o in others.values() for x in o["devices"]] + entries
        layout = [MigPlacement(x["start"], geo.profile(x["profile"])) for x in held
                  if x.get("type") == dra.TYPE_MIG and x["gpu"] == ref.gpu_uuid]
        if any((p.start, p.profile.name) == (ref.start, ref.profile) for p in layout):
            return "this MIG placement is prepared for another claim already"
        problems = layout_problems(geo, [*layout, MigPlacement(ref.start,
                                                               geo.profile(ref.profile))])
        return problems[0] if problems else ""

    def _geometry(self, gpu_uuid: str) -> MigGeometry:
        from gpuslice.core import catalog

        g = next(g for g in self.nvml.devices() if g.uuid == gpu_uuid)
        model = catalog.lookup(g.model)
        assert model is not None and model.mig is not None
        return model.mig

    def _effect(self, c: ClaimRef, e: dict[str, Any]) -> CdiDevice:
        """Make one planned device ready (idempotently) and return its CDI device."""
        minor = self._minor(e["gpu"])
        env = {"GPUSLICE_CLAIM": f"{c.namespace}/{c.name}", "GPUSLICE_DEVICE": e["device"]}
        nodes = tuple(os.path.join(self.cfg.dev_dir, n) for n in
                      ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", f"nvidia{minor}"))
        mounts: tuple[tuple[str, str], ...] = ()
        if e.get("admin"):
            target = e["gpu"]
            if e["type"] == dra.TYPE_MIG:  # the instance when it exists, else its GPU
                inst = e.get("migUUID") or self._mig_uuid(e["gpu"], e["profile"], e["start"],
                                                         missing_ok=True)
                if inst:
                    target = inst
                    nodes += self._cap_nodes(e["gpu"], inst)
            env["CUDA_VISIBLE_DEVICES"] = target
            return CdiDevice(device_name(c.uid, e["device"], e.get("shareID", "")), env,
                             nodes, mounts)
        if e["type"] == dra.TYPE_SHARE:
            self.ensure_mps(e["gpu"])
            # CUDA_VISIBLE_DEVICES names the one GPU, so that the container's CUDA (and the
            # ordinal 0 of the memory limit) is that GPU whatever else the runtime exposes
            env.update(CUDA_VISIBLE_DEVICES=e["gpu"],
                       CUDA_MPS_PIPE_DIRECTORY=PIPE_IN_CONTAINER,
                       CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(e["threadPct"]),
                       CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=pinned_mem_limit(e["memoryMiB"]),
                       GPUSLICE_SHARE=e["shareID"])
            mounts = tuple(client_mounts(self.cfg.mps_pipe_dir, e["gpu"], self.cfg.mps_shm_dir))
            name = device_name(c.uid, e["device"], e["shareID"])
        elif e["type"] == dra.TYPE_MIG:
            if not e.get("migUUID"):  # a partitionable device: its instance is made here
                self.mig.ensure_instance(e["gpu"], e["profile"], e["start"])
            mig_uuid = e.get("migUUID") or self._mig_uuid(e["gpu"], e["profile"], e["start"])
            env["CUDA_VISIBLE_DEVICES"] = mig_uuid
            nodes += self._cap_nodes(e["gpu"], mig_uuid)
            if e.get("strategy") == "MPS":
                mounts = self._mps_env(mig_uuid, e, env)
            name = device_name(c.uid, e["device"])
        else:
            env["CUDA_VISIBLE_DEVICES"] = e["gpu"]
            if e.get("strategy") == "MPS":
                mounts = self._mps_env(e["gpu"], e, env)
            if e.get("strategy") == "TimeSlicing":
                self._set_timeslice(e["gpu"], str(e.get("interval") or "Default"))
            name = device_name(c.uid, e["device"])
        return CdiDevice(name, env, nodes, mounts)

    def _minor(self, gpu: str) -> int:
        """The GPU's device minor from NVML (``/dev/nvidia<minor>``: not its index, which
        differs from it on many servers)."""
        try:
            return self.nvml.minor_number(gpu)
        except NvmlError as exc:
            raise ClaimError(f"GPU {gpu}: no device minor number: {exc}") from None

    def _cap_nodes(self, gpu: str, mig_uuid: str) -> tuple[str, ...]:
        """The MIG device's GPU- and compute-instance capability nodes
        (``/dev/nvidia-caps/nvidia-cap<N>``, from /proc/driver/nvidia/capabilities)."""
        from gpuslice.adapters.nvml.caps import cap_node

        try:
            gi, ci = self.nvml.mig_cap_minors(gpu, mig_uuid)
        except NvmlError as exc:
            raise ClaimError(f"MIG device {mig_uuid}: its capability device nodes are "
                             f"unknown: {exc}") from None
        return cap_node(self.cfg.dev_dir, gi), cap_node(self.cfg.dev_dir, ci)

    def _set_timeslice(self, gpu: str, interval: str) -> None:
        """Apply a GpuConfig's ``sharing.timeSlicing.interval`` to the GPU; a GPU or driver
        that cannot fails the claim, naming the field, instead of ignoring it."""
        from gpuslice.adapters.nvml.port import TIMESLICE_LEVELS

        try:
            self.nvml.set_timeslice(gpu, TIMESLICE_LEVELS[interval])
        except NvmlError as exc:
            raise ClaimError(f"opaque config sharing.timeSlicing.interval {interval!r} cannot "
                             f"be applied to GPU {gpu}: {exc}") from None

    def _mps_env(self, target: str, e: dict[str, Any], env: dict[str, str]
                 ) -> tuple[tuple[str, str], ...]:
        self.ensure_mps(target)
        env["CUDA_MPS_PIPE_DIRECTORY"] = PIPE_IN_CONTAINER
        if e.get("mpsPct"):
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(e["mpsPct"])
        if e.get("mpsMiB"):
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = pinned_mem_limit(e["mpsMiB"])
        return tuple(client_mounts(self.cfg.mps_pipe_dir, target, self.cfg.mps_shm_dir))

    def _mig_uuid(self, gpu: str, profile: str, start: int, missing_ok: bool = False) -> str:
        g = next((g for g in self.nvml.devices() if g.uuid == gpu), None)
        inst = next((m for m in (g.mig if g else ()) if (m.profile, m.start) ==
                     (profile, start)), None)
        if inst is None and missing_ok:
            return ""
        if inst is None:
            raise ClaimError(f"GPU {gpu}: the MIG instance {profile}@{start} was created but "
                             "NVML does not list it")
        return inst.uuid

    def ensure_mps(self, target: str) -> None:
        """The MPS control daemon of GPU (or MIG instance) ``target`` runs: one per GPU,
        shared by every share on it, in the node agent's pipe directory layout; one already
        running there (the node agent's, or a previous driver's) is adopted."""
        d = self._mps.get(target)
        if d is None:
            root = Path(self.cfg.mps_pipe_dir)
            d = MpsDaemon(target, root / target, root / f"{target}.log",
                          binary=self.cfg.mps_binary)
            self._mps[target] = d
        if not d.healthy():
            d.start()

    def stop_mps(self) -> list[str]:
        """Quit the MPS control daemons this driver started or adopted; their targets. For
        local runs (``gpuslice demo --dra``) only: the DaemonSet leaves them running for the
        containers that use them."""
        stopped = []
        for target, d in list(self._mps.items()):
            if d.healthy():
                d.quit()
                stopped.append(target)
            del self._mps[target]
        return stopped

    # -- unprepare -------------------------------------------------------------------------

    def unprepare(self, claims: list[ClaimRef]) -> dict[str, str]:
        """Claim UID -> "" (done, also for a claim never prepared here) or an error."""
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
                      for x in o["devices"] if not x.get("admin")]
            for e in entry["devices"]:
                if e.get("admin"):
                    continue  # admin access made nothing
                if e.get("strategy") == "TimeSlicing" and \
                        e.get("interval", "Default") != "Default":
                    self._set_timeslice(e["gpu"], "Default")  # the next claim's default
                if e.get("type") == dra.TYPE_MIG and not e.get("migUUID") and not any(
                        x.get("type") == dra.TYPE_MIG and x["gpu"] == e["gpu"]
                        and (x["profile"], x["start"]) == (e["profile"], e["start"])
                        for x in others):
                    try:
                        self.mig.remove_instance(e["gpu"], e["profile"], e["start"])
                    except NvmlError as exc:
                        raise ClaimError(f"MIG instance {e['profile']}@{e['start']} on GPU "
                                         f"{e['gpu']} not removed: {exc}") from None
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


def _mps_target(e: dict[str, Any]) -> str:
    """The MPS daemon a prepared device's clients talk to ("" when none)."""
    if e.get("admin"):
        return ""
    if e.get("type") == dra.TYPE_SHARE:
        return str(e["gpu"])
    if e.get("strategy") == "MPS":
        return f"{e['gpu']}/{e['profile']}@{e['start']}" if e.get("type") == dra.TYPE_MIG \
            else str(e["gpu"])
    return ""


_CONFIG_FOR: dict[str, type] = {dra.TYPE_SHARE: dra.MpsConfig, dra.TYPE_MIG: dra.MigConfig,
                                dra.TYPE_GPU: dra.GpuConfig}


def pci_of(index: int, nvml: NvmlPort) -> tuple[str, str]:
    """(PCI bus ID, PCIe root) of GPU ``index`` when the NVML adapter knows them."""
    fn = getattr(nvml, "pci_info", None)
    if fn is None:
        return "", ""
    try:
        bus, root = fn(index)
    except (NvmlError, OSError):
        return "", ""
    return str(bus), str(root)


# -- feature detection and publishing --------------------------------------------------------

def detect_features(api: DraPort, driver: str, node: str) -> dra.Features:
    """Ask the API server (``dryRun=All`` creates of probe slices: nothing is stored) whether
    consumable capacity, partitionable devices and device taints are served; a disabled
    gate's fields come back dropped. A probe the server refuses counts as not served."""
    base = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice"}
    spec = {"driver": driver, "nodeName": node,
            "pool": {"name": node, "generation": 0, "resourceSliceCount": 1}}
    share_probe = {**base, "metadata": {"name": f"{node}-{driver}-probe-share"}, "spec": {
        **spec, "devices": [{
            "name": "probe", "allowMultipleAllocations": True,
            "taints": [{"key": dra.UNHEALTHY_TAINT, "value": "true", "effect": "NoSchedule"}],
            "capacity": {"memory": {"value": "1Gi", "requestPolicy": {
                "default": "1Gi", "validRange": {"min": "1Gi"}}}}}]}}
    counter_probe = {**base, "metadata": {"name": f"{node}-{driver}-probe-counters"}, "spec": {
        **spec, "sharedCounters": [{"name": "probe", "counters": {"c": {"value": "1"}}}]}}
    consumable = taints = partitionable = False
    try:
        got = api.create_resource_slice(share_probe, dry_run=True)
        dev = (got.get("spec", {}).get("devices") or [{}])[0]
        consumable = bool(dev.get("allowMultipleAllocations")) and \
            "requestPolicy" in (dev.get("capacity") or {}).get("memory", {})
        taints = bool(dev.get("taints"))
    except GpusliceError as exc:
        log.warning("probe of consumable capacity refused: %s", exc)
    try:
        got = api.create_resource_slice(counter_probe, dry_run=True)
        partitionable = bool(got.get("spec", {}).get("sharedCounters"))
    except GpusliceError as exc:
        log.warning("probe of partitionable devices refused: %s", exc)
    return dra.Features(consumable, partitionable, taints)


class SlicePublisher:
    """Keeps the node's pool in the API server equal to the wanted slices, as the Go
    ``resourceslice`` controller does (dynamic-resource-allocation
    resourceslice/resourceslicecontroller.go, ``syncPool``): slices are compared by meaning
    (quantities by value, the taints' server-set ``timeAdded`` ignored, as its
    ``DevicesDeepEqual``), unchanged content is left alone, any change is written as a new
    pool generation across all the pool's slices (created, replaced keeping the stored
    ``timeAdded`` of taints that stay, the extra ones deleted), owned by the Node so that they
    go with it. The generation never goes down while the driver runs, even when someone
    deleted every slice of the pool meanwhile."""

    def __init__(self, api: DraPort, driver: str, node: str) -> None:
        self.api, self.driver, self.node = api, driver, node
        self.generation = -1  # the last generation written or seen
        # slices the API server stored other than written (fields of a gate turned off: the
        # Go controller's DroppedFieldsError), from the last publish
        self.dropped: list[str] = []

    def name(self, i: int) -> str:
        """``<node>-<driver>-<i>``: a DNS subdomain of at most 253 characters."""
        tail = f"-{self.driver.replace('.', '-')}-{i}"
        return f"{self.node[:253 - len(tail)].rstrip('.-')}{tail}"

    def publish(self, specs: list[dict[str, Any]]) -> bool:
        """Returns whether anything was written."""
        current = {s["metadata"]["name"]: s for s in self.api.list_resource_slices(
            self.driver, self.node)}
        pools = [s["spec"].get("pool") or {} for s in current.values()]
        top = max((int(p.get("generation", 0)) for p in pools), default=-1)
        same = len(current) == len(specs) and all(
            self.name(i) in current and _same(current[self.name(i)].get("spec") or {},
                                              self._spec(w, 0, len(specs)))
            for i, w in enumerate(specs))
        if same and all(int(p.get("generation", 0)) == top
                        and int(p.get("resourceSliceCount", 0)) == len(specs) for p in pools):
            self.generation = max(self.generation, top)
            return False
        gen = max(top, self.generation) + 1
        owner = self._owner()
        self.dropped = []
        for i, spec in enumerate(specs):
            obj: dict[str, Any] = {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                "metadata": {"name": self.name(i), **owner},
                "spec": self._spec(spec, gen, len(specs))}
            cur = current.pop(self.name(i), None)
            if cur is None:
                stored = self.api.create_resource_slice(obj)
            else:
                _keep_time_added(obj["spec"], cur.get("spec") or {})
                obj["metadata"]["resourceVersion"] = cur["metadata"].get("resourceVersion")
                stored = self.api.update_resource_slice(obj)
            if not _same(stored.get("spec") or {}, obj["spec"]):
                self.dropped.append(self.name(i))
        for stale in current:
            with contextlib.suppress(ApiNotFound):
                self.api.delete_resource_slice(stale)
        self.generation = gen
        return True

    def _spec(self, want: dict[str, Any], gen: int, count: int) -> dict[str, Any]:
        return {"driver": self.driver, "nodeName": self.node,
                "pool": {"name": self.node, "generation": gen, "resourceSliceCount": count},
                **copy.deepcopy(want)}

    def _owner(self) -> dict[str, Any]:
        try:
            node = self.api.get_node(self.node)
        except GpusliceError:
            return {}
        uid = (node.get("metadata") or {}).get("uid")
        if not uid:
            return {}
        return {"ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": self.node,
                                     "uid": uid, "controller": True}]}


def _keep_time_added(new: dict[str, Any], old: dict[str, Any]) -> None:
    """Taints that stay keep the ``timeAdded`` the API server gave them (the controller's
    ``copyTaintTimeAdded``): a republish does not make an old taint look new."""
    stamps = {(d.get("name"), t.get("key"), t.get("value"), t.get("effect")): t["timeAdded"]
              for d in old.get("devices") or [] for t in d.get("taints") or []
              if t.get("timeAdded")}
    for d in new.get("devices") or []:
        for t in d.get("taints") or []:
            stamp = stamps.get((d.get("name"), t.get("key"), t.get("value"), t.get("effect")))
            if stamp and "timeAdded" not in t:
                t["timeAdded"] = stamp


# the ResourceSlice fields this driver writes; others a newer API server may add (defaults,
# fields this driver does not know) are not differences, while a field it dropped is one
_SPEC_FIELDS = ("driver", "nodeName", "pool", "devices", "sharedCounters", "nodeSelector",
                "allNodes", "perDeviceNodeSelection")
_DEVICE_FIELDS = ("name", "attributes", "capacity", "allowMultipleAllocations", "taints",
                  "consumesCounters")


def _project(spec: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in spec.items() if k in _SPEC_FIELDS}
    if isinstance(out.get("devices"), list):
        out["devices"] = [{k: v for k, v in d.items() if k in _DEVICE_FIELDS}
                          for d in out["devices"]]
    return out


def _same(stored: dict[str, Any], want: dict[str, Any]) -> bool:
    """Whether a stored slice spec says what ``want`` says (pool aside), by meaning."""
    import json

    def key(spec: dict[str, Any]) -> str:
        content = {k: v for k, v in spec.items() if k != "pool"}
        return json.dumps(dra.semantic_spec(content), sort_keys=True)

    return key(_project(stored)) == key(_project(want))


# -- gRPC ----------------------------------------------------------------------------------

def _refs(claims: Any) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.uid, c.name) for c in claims]


class _DraServicer:
    """NodePrepareResources / NodeUnprepareResources of one API version (``pb``)."""

    def __init__(self, driver: DraDriver, pb: Any, share_ids: bool) -> None:
        self.driver, self.pb, self.share_ids = driver, pb, share_ids

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        rid = uuidlib.uuid4().hex[:8]
        log.info("[%s] NodePrepareResources %s", rid, [c.uid for c in request.claims])
        resp = self.pb.NodePrepareResourcesResponse()
        for uid, res in self.driver.prepare(_refs(request.claims)).items():
            entry = resp.claims[uid]
            if isinstance(res, str):
                entry.error = res
                continue
            for d in res:
                dev = entry.devices.add(request_names=d["request_names"], pool_name=d["pool"],
                                        device_name=d["device"], cdi_device_ids=d["cdi"])
                if self.share_ids and d.get("share_id"):
                    dev.share_id = d["share_id"]
        return resp

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        rid = uuidlib.uuid4().hex[:8]
        log.info("[%s] NodeUnprepareResources %s", rid, [c.uid for c in request.claims])
        resp = self.pb.NodeUnprepareResourcesResponse()
        for uid, err in self.driver.unprepare(_refs(request.claims)).items():
            resp.claims[uid].error = err
        return resp


class DraV1(_DraServicer, v1g.DRAPluginServicer):
    def __init__(self, driver: DraDriver) -> None:
        super().__init__(driver, v1, share_ids=True)


class DraV1beta1(_DraServicer, v1beta1g.DRAPluginServicer):
    def __init__(self, driver: DraDriver) -> None:
        super().__init__(driver, v1beta1, share_ids=False)


class Health(hpbg.DRAResourceHealthServicer):
    def __init__(self, driver: DraDriver) -> None:
        self.driver = driver

    def NodeWatchResources(self, request: Any, context: Any) -> Iterator[Any]:
        for devices in self.driver.watch_health(context.is_active):
            now = int(time.time())
            yield hpb.NodeWatchResourcesResponse(devices=[hpb.DeviceHealth(
                device=hpb.DeviceIdentifier(pool_name=pool, device_name=name),
                health=hpb.HEALTHY if ok else hpb.UNHEALTHY, last_updated_time=now,
                health_check_timeout_seconds=self.driver.cfg.health_timeout_s)
                for pool, name, ok in devices])


class Registration(rpbg.RegistrationServicer):
    def __init__(self, driver: DraDriver) -> None:
        self.driver = driver

    def GetInfo(self, request: Any, context: Any) -> Any:
        cfg = self.driver.cfg
        return rpb.PluginInfo(type=PLUGIN_TYPE, name=cfg.driver,
                              endpoint=str(cfg.dra_socket.resolve()),
                              supported_versions=list(SUPPORTED_VERSIONS))

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        self.driver.registration.append((request.plugin_registered, request.error))
        if request.plugin_registered:
            log.info("registered with the kubelet")
        else:
            log.error("the kubelet refused the registration: %s", request.error)
            self.driver.problems.append(f"kubelet refused registration: {request.error}")
        return rpb.RegistrationStatusResponse()


class DraServer:
    """The two sockets: the DRA service (and health) first, then registration, so that the
    kubelet finds the service when it follows the registration."""

    def __init__(self, driver: DraDriver, workers: int = 4) -> None:
        self.driver = driver
        self.workers = workers
        self._servers: list[grpc.Server] = []

    def start(self) -> None:
        cfg = self.driver.cfg
        dra_server = self._serve(cfg.dra_socket)
        v1g.add_DRAPluginServicer_to_server(DraV1(self.driver), dra_server)  # type: ignore[no-untyped-call]
        v1beta1g.add_DRAPluginServicer_to_server(DraV1beta1(self.driver), dra_server)  # type: ignore[no-untyped-call]
        hpbg.add_DRAResourceHealthServicer_to_server(Health(self.driver), dra_server)  # type: ignore[no-untyped-call]
        dra_server.start()
        reg = self._serve(cfg.registration_socket)
        rpbg.add_RegistrationServicer_to_server(Registration(self.driver), reg)  # type: ignore[no-untyped-call]
        reg.start()
        self._servers = [dra_server, reg]

    def _serve(self, socket: Path) -> grpc.Server:
        socket.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            socket.unlink()  # a previous run's
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.workers),
                             options=list(KEEPALIVE_OPTIONS))
        if server.add_insecure_port(f"unix://{socket}") == 0:
            raise GpusliceError(f"cannot listen on {socket}")
        return server

    def stop(self) -> None:
        for s in reversed(self._servers):  # registration first: the kubelet stops calling
            s.stop(grace=1.0).wait()
        cfg = self.driver.cfg
        for sock in (cfg.registration_socket, cfg.dra_socket):
            with contextlib.suppress(FileNotFoundError):
                sock.unlink()


def run(driver: DraDriver, stop: threading.Event, poll_s: float = 1.0) -> None:
    """Start, serve and follow health until ``stop`` is set."""
    driver.start()
    server = DraServer(driver)
    server.start()
    try:
        while not stop.is_set():
            driver.tick(poll_s)
    finally:
        server.stop()
