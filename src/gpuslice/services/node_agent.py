"""The node agent: discovery, the device plugin, health, and what the node tells the cluster.

``gpuslice node-agent`` wires the NVML port (real, or ``--fake`` YAML, or null when there is no
driver) to the device plugin, publishes the GPU inventory annotation and GPU-feature-discovery
labels on its Node, and follows NVML health events: an XID marks the GPU unhealthy in
ListAndWatch (and drops it from the inventory); after ``quiet_s`` seconds without a new error it
is healthy again, without restarting the agent.

The labels it publishes are recorded on the node (``gpuslice.io/agent-labels``): those it
added, not those that were there already with the same value (``nvidia.com/gpu.present=true``
that selects the node for the DaemonSet, GPU feature discovery's). A label it no longer
publishes (a MIG profile count after a layout change) is removed; on uninstall
(:mod:`gpuslice.services.node_cleanup`) the recorded ones are.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from gpuslice.adapters.kube.fake import KubePort
from gpuslice.adapters.kube.objects import GPU_MEMORY, GPU_MILLI
from gpuslice.adapters.mps import MpsDaemon
from gpuslice.adapters.mps.host import (
    HEARTBEAT,
    HEARTBEAT_STALE_S,
    check_host,
    read_heartbeat,
    remove_want,
)
from gpuslice.adapters.mps.keeper import MpsDaemons
from gpuslice.adapters.nvml.port import NvmlError, NvmlPort
from gpuslice.core.assignment import Assignment
from gpuslice.core.devices import inventory, node_labels
from gpuslice.core.errors import GpusliceError, note_once
from gpuslice.services.device_plugin import (
    DevicePlugin,
    PluginConfig,
    PluginServer,
    plugin_configs,
)
from gpuslice.services.node_layouts import MigLayouts
from gpuslice.services.pod_usage import PodUsage

INVENTORY = "gpuslice.io/inventory"
# the node labels this agent added (comma-separated keys): what it removes on uninstall
AGENT_LABELS = "gpuslice.io/agent-labels"
# XIDs that are the application's fault, not the GPU's (NVIDIA's device plugin skips them too)
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})

log = logging.getLogger(__name__)


def label_keys(text: str | None) -> set[str]:
    """The keys of a comma-separated list (the :data:`AGENT_LABELS` annotation)."""
    return {k.strip() for k in (text or "").split(",") if k.strip()}


def labels_to_publish(wanted: Mapping[str, str], on_node: Mapping[str, str],
                      recorded: set[str]) -> tuple[dict[str, str | None], set[str]]:
    """The labels patch (``None`` removes a label) and the keys the agent owns after it.

    A wanted key is the agent's when it owned it already (``recorded``) or the node lacks it;
    a key that was there with another owner's value stays that owner's (the agent writes its
    value all the same). An owned key the agent no longer wants is removed."""
    owned = {k for k in wanted if k in recorded or k not in on_node}
    patch: dict[str, str | None] = dict(wanted)
    patch.update({k: None for k in sorted(recorded - set(wanted))})
    return patch, owned


class AgentMetrics:
    """Prometheus metrics of the node agent, on its own registry."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        self.registry = CollectorRegistry()
        labels = ["node", "gpu", "model"]
        self.healthy = Gauge("gpuslice_gpu_healthy", "1 when the GPU is healthy", labels,
                             registry=self.registry)
        self.allocated = Gauge("gpuslice_gpu_allocated_milli",
                               "milli-GPU held by executed assignments", labels,
                               registry=self.registry)
        self.memory = Gauge("gpuslice_gpu_memory_mib", "GPU memory, MiB", labels,
                            registry=self.registry)
        self.slices = Gauge("gpuslice_gpu_slices", "assignments executed on the GPU", labels,
                            registry=self.registry)
        self.devices = Gauge("gpuslice_virtual_devices", "virtual devices served", ["node"],
                             registry=self.registry)
        self.mps_host_up = Gauge("gpuslice_mps_host_up",
                                 "1 while the MPS host's heartbeat is fresh (its daemons are "
                                 "kept), 0 when it is missing or stale", ["node"],
                                 registry=self.registry)
        self.mps_restarts = Gauge("gpuslice_mps_daemon_restarts",
                                  "restarts of the GPU's MPS daemon by the MPS host since its "
                                  "pod started (each one failed the daemon's clients)",
                                  ["node", "gpu"], registry=self.registry)
        from prometheus_client import Counter

        self.registration_failures = Counter(
            "gpuslice_device_plugin_registration_failures",
            "device plugin registrations refused by the kubelet (or by the resource name "
            "check), or unanswered", ["node", "resource"], registry=self.registry)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        out: bytes = generate_latest(self.registry)
        return out


class NodeAgent(MigLayouts):
    def __init__(self, cfg: PluginConfig, nvml: NvmlPort, api: KubePort, *,
                 quiet_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 mps: bool = False, mps_binary: str = "nvidia-cuda-mps-control",
                 poll_s: float = 1.0, quit_mps_on_stop: bool = True,
                 mps_host: bool = False, proc_root: Path = Path("/proc")) -> None:
        self.poll_s = poll_s
        # in a cluster the MPS daemons outlive the agent: running pods are their clients, and
        # a restarted agent adopts them from their records (adapters/mps/keeper.py); with
        # mps_host they are started by `gpuslice mps-host`, in a pod of their own, so that
        # they do not die with this one
        self.quit_mps_on_stop = quit_mps_on_stop
        self._layout_report: dict[str, dict[str, str]] = {}
        self.mps_binary = mps_binary
        self.cfg, self.nvml, self.api = cfg, nvml, api
        self.quiet_s, self.clock = quiet_s, clock
        self.mps = MpsDaemons(cfg.mps_pipe_dir, "node-agent", binary=mps_binary, host=mps_host)
        self.mps_enabled = mps
        self._mps = self.mps.daemons  # started or adopted
        self._ceilings = self.mps.ceilings  # per daemon: kept across its restarts
        self._mps_lock = self.mps.lock
        self.mps_check_s = 5.0  # how often run() checks that its MPS daemons still answer
        self._mps_checked = 0.0
        ensure = self.ensure_mps if mps else None
        # one plugin (or, with the "mixed" MIG strategy, one per MIG profile)
        self.plugins = [DevicePlugin(c, nvml, api, ensure_mps=ensure)
                        for c in plugin_configs(cfg, nvml)]
        self.servers = [PluginServer(p, on_failure=self.registration_failed)
                        for p in self.plugins]
        self.plugin = self.plugins[0] if self.plugins else DevicePlugin(cfg, nvml, api)
        self.server = self.servers[0] if self.servers else PluginServer(self.plugin)
        self._last_error: dict[str, float] = {}
        self._stop = threading.Event()
        self.problems: list[str] = []
        self.metrics = AgentMetrics()
        # what each pod uses of its share (memory, SMs, processes against its declared count)
        self.pod_usage = PodUsage(cfg.node, nvml, api, self.metrics.registry,
                                  keys=(cfg.key, *cfg.previous_keys), proc=proc_root)
        self.usage_every_s = 10.0
        self._usage_at = 0.0
        # the node labels and inventory to publish, until the API server takes them: retried
        # with backoff (an outage must not leave the extender without this node's GPUs)
        self._unpublished = False
        self._publish_at = 0.0
        self._publish_backoff_s = 0.0
        self.max_backoff_s = 30.0
        # the labels this agent owns (AGENT_LABELS), and those the node had when first read
        self._owned: set[str] | None = None
        self._found_labels: dict[str, str] = {}
        # NVML that had not answered at start (the driver loads after the agent after a
        # reboot): tried again this often, and the GPUs served once it answers
        self.nvml_retry_s = 10.0
        self._nvml_tried = 0.0
        # what it published, checked this often: another install's agent cleaning the node
        # on its way out (a migration) removes it, and nothing else would publish it again
        self.recheck_s = 60.0
        self._rechecked = time.monotonic()
        self.restart_needed = ""  # why the agent stopped to be started again (exit 1)

    def registration_failed(self, resource: str, message: str) -> None:
        """A device plugin registration failed: count it, and tell the cluster with a
        Warning Event on this node (``kubectl describe node`` shows it)."""
        self.metrics.registration_failures.labels(self.cfg.node, resource).inc()
        create = getattr(self.api, "create_event", None)
        if create is None:
            return
        from datetime import UTC, datetime

        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{self.cfg.node}.gpuslice-registration-"},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": self.cfg.node},
            "reason": "DevicePluginRegistrationFailed", "type": "Warning",
            "message": f"{resource}: {message}"[:1024],
            "source": {"component": "gpuslice-node-agent", "host": self.cfg.node},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1}
        try:
            create("default", event)
        except GpusliceError as exc:
            note_once(self.problems, f"could not report a registration failure: {exc}")

    def update_metrics(self) -> None:
        held: dict[str, tuple[int, int]] = {}
        for a in self.plugin.executed():
            for c in a.containers:
                for share in c.gpus:
                    milli, n = held.get(share.uuid, (0, 0))
                    held[share.uuid] = (milli + share.milli, n + 1)
        m = self.metrics
        for g in self.nvml.devices():
            labels = (self.cfg.node, g.uuid, g.model)
            m.healthy.labels(*labels).set(0 if g.uuid in self._last_error else 1)
            m.allocated.labels(*labels).set(held.get(g.uuid, (0, 0))[0])
            m.slices.labels(*labels).set(held.get(g.uuid, (0, 0))[1])
            m.memory.labels(*labels).set(g.memory_mib)
        m.devices.labels(self.cfg.node).set(self.plugin.device_count())

    def ensure_mps(self, uuid: str, thread_pct: int = 100, memory_mib: int | None = None) -> None:
        """The MPS control daemon of GPU ``uuid`` is running (started on first use, with its
        own pipe directory ``<mps_pipe_dir>/<uuid>`` that Allocate mounts into the pod; one a
        previous agent left running there is adopted), and its server-side ceiling covers a
        client of ``thread_pct`` percent and ``memory_mib`` (None: uncapped): the largest
        share handed out on it, which a client cannot raise its own limits past."""
        self.mps.ensure(uuid, thread_pct, memory_mib)

    @property
    def mps_restarts(self) -> int:
        return self.mps.restarts

    def adopt_mps(self) -> list[str]:
        """The MPS daemons an earlier agent on this node left for its pods, with their
        ceilings (from their records); the GPUs and MIG instances adopted."""
        found = self.mps.adopt()
        if found:
            log.info("adopted the MPS daemons of %s", ", ".join(found),
                     extra={"event": "mps-adopted", "targets": found})
        return found

    def watch_mps(self) -> list[str]:
        """Restart each MPS daemon this agent started or adopted that stopped answering, with
        its ceiling (with an MPS host, the host does: its heartbeat goes to the metrics).
        Returns the UUIDs restarted."""
        if self.mps.host:
            beat = read_heartbeat(self.mps.root)
            fresh = beat is not None and time.time() - beat.time <= HEARTBEAT_STALE_S
            self.metrics.mps_host_up.labels(self.cfg.node).set(1 if fresh else 0)
            for target, n in (beat.restarts if beat else {}).items():
                self.metrics.mps_restarts.labels(self.cfg.node, target).set(n)
            if not fresh:
                note_once(self.problems, f"MPS daemons not kept: {check_host(self.mps.root)}")
        try:
            return self.mps.watch()
        except GpusliceError as exc:
            note_once(self.problems, f"MPS daemon down and not restarted: {exc}")
            return []

    def count_processes(self) -> dict[str, tuple[int, int]]:
        """What each pod uses of its share on this node's GPUs and MIG instances (memory, SMs,
        processes: :mod:`gpuslice.services.pod_usage`, into the metrics); per pod, its most
        CUDA processes on one GPU and what it declares (a pod running more gets a Warning
        event)."""
        try:
            return self.pod_usage.step()
        except GpusliceError as exc:
            note_once(self.problems, f"measuring the pods' GPU use: {exc}")
            return {}

    def quit_mps(self) -> None:
        try:
            self.mps.quit_all()
        except GpusliceError as exc:
            self.problems.append(str(exc))

    def publish(self) -> bool:
        """Inventory annotation (healthy GPUs) and GFD labels on this node. When the API server
        refuses or is not answering, the agent tries again on its next passes, backing off up to
        :attr:`max_backoff_s`, with what is current then. Returns whether it was published."""
        gpus = [g for g in self.nvml.devices() if g.uuid not in self._last_error]
        labels = node_labels(self.nvml.devices(), self.nvml.driver_version())
        try:
            if self._owned is None:  # once: which labels were there before this agent's
                meta = self.api.get_node(self.cfg.node).get("metadata") or {}
                self._found_labels = dict(meta.get("labels") or {})
                self._owned = label_keys((meta.get("annotations") or {}).get(AGENT_LABELS))
            patch, owned = labels_to_publish(labels, self._found_labels, self._owned)
            self.api.patch_node(self.cfg.node, patch, {
                INVENTORY: json.dumps(inventory(gpus)), AGENT_LABELS: ",".join(sorted(owned))})
            self._owned = owned
            # the node's GPU share total, counted by kube-scheduler (deploy/base/scheduler-
            # config.yaml): its preemption then sees share contention; per-GPU fit stays the
            # extender's. The memory total is ignored by the scheduler's fit but must be in
            # allocatable: with a DeviceClass naming an extendedResourceName (deploy/dra), the
            # DynamicResources plugin refuses a node lacking any extended resource the pod asks
            # for ("cannot fit resource", filterExtendedResources in kube-scheduler's
            # dynamicresources/extendeddynamicresources.go), whatever the extender config says
            held_milli, held_mib = self.held_on_unhealthy()
            self.api.patch_node_capacity(self.cfg.node, {
                GPU_MILLI: str(1000 * len(gpus) + held_milli),
                GPU_MEMORY: str(sum(g.memory_mib for g in gpus) + held_mib)})
        except GpusliceError as exc:
            self._unpublished = True
            self._publish_backoff_s = min(self.max_backoff_s,
                                          max(self.poll_s, 2 * self._publish_backoff_s))
            self._publish_at = time.monotonic() + self._publish_backoff_s
            note_once(self.problems, f"publishing node labels (retrying, backing off up to "
                                     f"{self.max_backoff_s:g} s): {exc}")
            return False
        self._unpublished = False
        self._publish_backoff_s = 0.0
        return True

    def held_on_unhealthy(self) -> tuple[int, int]:
        """(milli, MiB) that live pods hold on this node's unhealthy GPUs (verified
        assignments of pods not finished). The node's totals keep them: a GPU with an XID
        leaves the inventory (no new pod goes there) but its pods still run, and a kubelet
        that restarts admits every running pod again against allocatable (its
        predicateAdmitHandler; an extended resource present but too small is "OutOf..."):
        totals that dropped by the whole GPU would get pods on healthy GPUs rejected.
        Reads the node's pods only while some GPU is unhealthy."""
        sick = {g.uuid for g in self.nvml.devices() if g.uuid in self._last_error}
        if not sick:
            return 0, 0
        milli = mib = 0
        for a in self.live_assignments():
            for c in a.containers:
                for share in c.gpus:
                    if share.uuid in sick:
                        milli += share.milli
                        mib += share.memory_mib
        return milli, mib

    def live_assignments(self) -> list[Assignment]:
        """The verified assignments of this node's pods that have not finished, as the API
        server has them now (pods bound but not started, still pulling or loading, count)."""
        from gpuslice.adapters.kube.annotation import AnnotationError, decode
        from gpuslice.adapters.kube.objects import pod_finished
        from gpuslice.core.assignment import ANNOTATION, verify_any

        out = []
        keys = (self.cfg.key, *self.cfg.previous_keys)
        for p in self.api.list_pods(node=self.cfg.node):
            text = ((p.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)
            if not text or pod_finished(p):
                continue
            try:
                a = decode(str(text))
            except AnnotationError:
                continue
            if a.node == self.cfg.node and verify_any(a, keys):
                out.append(a)
        return out

    def check_published(self) -> bool:
        """Publish again when the node lacks the inventory or the totals this agent put there
        (another install's agent took them off on its way out: a migration from kustomize to
        Helm); whether it did. An API error is left to the next check."""
        try:
            node = self.api.get_node(self.cfg.node)
        except GpusliceError:
            return False
        ann = (node.get("metadata") or {}).get("annotations") or {}
        capacity = (node.get("status") or {}).get("capacity") or {}
        if INVENTORY in ann and GPU_MILLI in capacity:
            return False
        log.warning("the node lacks what this agent published (another agent's cleanup?): "
                    "publishing it again", extra={"event": "republish"})
        return self.publish()

    def health_step(self, timeout_s: float) -> None:
        """Take NVML events for up to ``timeout_s``; recover GPUs that stayed quiet."""
        try:
            events = self.nvml.events(timeout_s)
        except NvmlError as exc:
            self.problems.append(str(exc))
            events = []
        changed = False
        for ev in events:
            if ev.xid in APPLICATION_XIDS:
                continue
            first = ev.uuid not in self._last_error
            self._last_error[ev.uuid] = self.clock()
            if first:
                for plugin in self.plugins:
                    plugin.set_health(ev.uuid, False)
                changed = True
        now = self.clock()
        for uuid, at in list(self._last_error.items()):
            if now - at >= self.quiet_s:
                del self._last_error[uuid]
                for plugin in self.plugins:
                    plugin.set_health(uuid, True)
                changed = True
        if changed:
            self.publish()

    def retry_nvml(self) -> bool:
        """While NVML has not answered (:class:`~gpuslice.adapters.nvml.real.LateNvml`), try
        it again; when it answers, serve its GPUs: ListAndWatch streams them, the CDI spec
        and the node's inventory, labels and totals follow. With the ``mixed`` MIG strategy
        the plugins are one per profile, known only now: the agent stops to be started
        again (:attr:`restart_needed`). Returns whether the GPUs appeared."""
        reload = getattr(self.nvml, "reload", None)
        if reload is None or not getattr(self.nvml, "waiting", False) or not reload():
            return False
        gpus = self.nvml.devices()
        log.info("NVML answers now: %d GPU(s), driver %s", len(gpus),
                 self.nvml.driver_version(), extra={"event": "nvml-found", "gpus": len(gpus)})
        if self.cfg.mig_strategy == "mixed":
            self.restart_needed = ("NVML answered after the start: the mixed MIG strategy's "
                                   "plugins (one per profile) are made at start")
            self._stop.set()
            return True
        for plugin in self.plugins:
            plugin.changed()
            plugin.write_cdi_spec()
        self.problems.extend(self.check_mig_tables())
        self.publish()
        return True

    def readiness(self) -> tuple[bool, str]:
        """Ready: GPUs served, every device plugin registered with the kubelet, the node's
        inventory published. Else why not (``/readyz``)."""
        gpus = self.nvml.devices()
        if not gpus:
            return False, f"no GPU served: {self.nvml.why_empty()}"
        waiting = [s.plugin.cfg.resource for s in self.servers if not s.registrations]
        if waiting or not self.servers:
            return False, ("not registered with the kubelet: " + ", ".join(waiting)
                           if waiting else "no device plugin")
        if self._unpublished:
            return False, "the node's GPU inventory is not published yet (API server)"
        return True, f"ok: {len(gpus)} GPU(s) served"

    def run(self) -> None:
        """Serve until :meth:`stop`: the device plugin, the node's labels, health."""
        if not self.nvml.devices():
            self.problems.append(f"no GPU served: {self.nvml.why_empty()}")
        if self.mps_enabled:  # before serving Allocate: the ceilings in force are known
            self.adopt_mps()
        for server in self.servers:
            server.start()
            self.problems.extend(server.errors)
        self.publish()
        while not self._stop.is_set():
            started = time.monotonic()
            self.health_step(self.poll_s)
            # NVML without GPUs (or a failing event set) answers at once: no busy loop
            self._stop.wait(max(0.0, self.poll_s - (time.monotonic() - started)))
            if time.monotonic() - self._rechecked >= self.recheck_s:
                self._rechecked = time.monotonic()
                self.check_published()
            if time.monotonic() - self._nvml_tried >= self.nvml_retry_s:
                self._nvml_tried = time.monotonic()
                self.retry_nvml()
            if self._unpublished and time.monotonic() >= self._publish_at:
                self.publish()
            self.update_metrics()
            if self._mps and time.monotonic() - self._mps_checked >= self.mps_check_s:
                self._mps_checked = time.monotonic()
                self.watch_mps()
            if time.monotonic() - self._usage_at >= self.usage_every_s:
                self._usage_at = time.monotonic()
                self.count_processes()
            try:
                self.reconcile_layouts()
            except GpusliceError as exc:
                note_once(self.problems, f"MIG layouts: {exc}")
            except Exception as exc:  # whatever the API server or NVML answered: health
                # checks, publishing and metrics must go on
                log.exception("MIG layouts: unexpected error")
                note_once(self.problems, f"MIG layouts: {type(exc).__name__}: {exc}")

    def mps_targets(self) -> set[str]:
        """The GPUs and MIG instances this agent may run an MPS daemon for (each one's pipe
        directory is ``<mps_pipe_dir>/<UUID>``)."""
        out = set(self._mps)
        for g in self.nvml.devices():
            out.add(g.uuid)
            out.update(m.uuid for m in g.mig)
        return out

    def remove_mps_state(self, timeout_s: float = 5.0) -> list[str]:
        """On uninstall: quit the MPS daemons of this node's GPUs (started by this agent or
        by an earlier one), then remove their pipe and log directories and, when no other
        daemon's directory is left in ``mps_pipe_dir``, the daemons' shared memory directory
        (``mps_shm_dir``'s contents; never the host's own /dev/shm). A daemon that does not
        quit within ``timeout_s`` (clients still attached) keeps its directories, and says
        so in :attr:`problems`. Returns the paths removed."""
        from concurrent.futures import ThreadPoolExecutor

        root = Path(self.cfg.mps_pipe_dir)
        if not root.is_dir():
            return []
        with self._mps_lock:
            known = dict(self._mps)
        daemons = [known.get(t) or MpsDaemon(t, root / t, root / f"{t}.log",
                                             binary=self.mps_binary)
                   for t in sorted(self.mps_targets()) if (root / t).is_dir()]
        for d in daemons:  # first: no MPS host starts them again
            remove_want(root, d.uuid)

        def quit_one(d: MpsDaemon) -> str | None:
            if not d.healthy():
                return None  # no daemon answers there (never started, or gone)
            try:
                d.quit(timeout_s=timeout_s)
            except GpusliceError as exc:
                return str(exc)
            return None

        removed: list[str] = []
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(daemons)))) as pool:
            for d, problem in zip(daemons, pool.map(quit_one, daemons), strict=True):
                if problem:
                    self.problems.append(f"MPS daemon for {d.uuid} left running, its "
                                         f"directories kept: {problem}")
                    continue
                for path in (d.pipe_dir, d.log_dir):
                    if path.exists():
                        shutil.rmtree(path, ignore_errors=True)
                        removed.append(str(path))
        # the shared memory folder serves every daemon: emptied once none is left (the MPS
        # host's heartbeat is no daemon's: it goes too)
        others = [e for e in root.iterdir() if e.name != HEARTBEAT] if root.is_dir() else []
        if not others:
            with contextlib.suppress(OSError):
                (root / HEARTBEAT).unlink()
        shm = Path(self.cfg.mps_shm_dir) if self.cfg.mps_shm_dir and not others else None
        if shm is not None and (os.path.realpath(shm) == "/dev/shm" or not shm.is_dir()):
            shm = None  # never the host's own /dev/shm (clients with hostIPC)
        for entry in list(shm.iterdir()) if shm is not None else []:
            with contextlib.suppress(OSError):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
                removed.append(str(entry))
        for folder in (root, shm):
            # a hostPath volume's mount point (the DaemonSet's) cannot go: it stays, empty
            if folder is not None:
                with contextlib.suppress(OSError):
                    folder.rmdir()
                    removed.append(str(folder))
        return removed

    def stop(self) -> None:
        self._stop.set()
        for server in self.servers:
            server.stop()
        if self.quit_mps_on_stop:
            self.quit_mps()
