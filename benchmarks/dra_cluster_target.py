"""The control-plane target of :mod:`dra_placement`: :class:`ClusterTarget` replays the trace
on a real kube-apiserver, kube-scheduler and kwok nodes (:class:`gpuslice.devcluster.DevCluster`),
through kube-scheduler's DRA allocation, ``gpuslice dra-allocator`` or the device-plugin path."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from dra_targets import (
    CLUSTER_CPU,
    CLUSTER_MEM_GIB,
    CLUSTER_MODEL,
    Outcome,
    SimTarget,
    kwok_scenario,
)
from first_seen import FirstSeen
from gpuslice.adapters.kube.dra import ALLOCATOR_GATE, ALLOCATOR_TAINT
from gpuslice.core.dra_gate import NOT_PLACED
from gpuslice.devcluster import Proc, wait_until

DRIVER = "gpu.gpuslice.io"
# a task unschedulable this long (its claim unallocated) is decided: longer than the allocator's
# longest wait before it places a released claim again (its --max-backoff, below)
SETTLE_S = 5.0
QUIET_S = 12.0  # --burst: no new bind or allocation this long, every other pod unschedulable


class ClusterTarget:
    """The real control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
    kwok) of :class:`gpuslice.devcluster.DevCluster`, started here: kwok nodes whose GPUs are
    published as ResourceSlices of ``gpu.gpuslice.io`` (one consumable-capacity share device per
    GPU, as ``gpuslice dra-driver --mode share`` publishes them; created directly so that the
    allocator's taint can be put on them, which the driver does not do yet), and the trace
    submitted as pods with one ResourceClaim each (``share.gpuslice.io``, ``count`` = the task's
    GPUs, ``compute`` = ceil(milli / 10)); CPU-only tasks as plain pods.

    * ``default``: the devices untainted; kube-scheduler's allocator places every claim.
    * ``ours``: the devices carry the allocator taint and ``gpuslice dra-allocator`` runs (on
      the admin's kubeconfig, ``--settle 1``); the scheduler only checks the node it chose.
      Its GPU pods carry the allocator's scheduling gate, as a pod template or the admission
      webhook (``adapters.kube.dra_gate.admission_patch``) puts it on (issue 58): the
      allocator removes it once the claim is allocated, so kube-scheduler tries each pod
      once; a pod it will not place it releases with a ``ClaimNotPlaced`` Event, which is
      then its final verdict (nothing departs in this protocol).
    * ``device-plugin``: the device-plugin path as deploy/ installs it, on the same nodes
      (which also carry what the node agent publishes: the inventory annotation and the
      gpuslice.io resources): GPU tasks are pods asking for ``gpuslice.io/gpu`` (and
      ``gpu-milli`` below a whole GPU) with ``schedulerName: gpuslice-scheduler``, whose profile
      (deploy/base/scheduler-config.yaml) calls ``gpuslice extender`` (a process, HTTPS, on its
      service account) to filter, prioritize and bind; CPU-only tasks go to the default
      scheduler, as they do on a cluster.
    * ``ours-pinned``: ``ours`` with the CPU-only tasks behind the allocator's gate too (as
      the webhook's ``--gate-cpu-only`` puts it on): the allocator places them by its policy
      and pins each to its node (services/dra_pins.py).
    * ``default-model``, ``ours-model``, ``ours-pinned-model``, ``device-plugin-model``: the
      simulator's models of those paths on the same nodes and tuned trace (``sim.dra``'s
      ``dra-default``, ``dra-ours`` and ``dra-ours-pinned``, ``sim.deployed``), to compare
      seed for seed.
    * ``device-plugin-sim``: the simulator's ``ours`` on the same nodes and tuned trace, where
      ``frag-strand`` places every pod (what the device-plugin path would do if it placed the
      CPU-only pods too and kube-scheduler's own scores did not take part).

    The trace is the simulator's tuned task list (``tune`` with the seed) cut where the
    arrived GPU demand reaches 100% of the cluster's GPUs; unallocated GPU % counts the milli of
    the GPU pods bound once the cluster is quiet, as the simulator does. Throughput: GPU pods
    bound per second, from the first create to the last bind. Each replay also gives its wall
    time and each bound GPU pod's time from its creation (the client's clock before the
    create) to a watch of the namespace's pods seeing it bound."""

    modes = ("default", "ours", "device-plugin", "device-plugin-sim", "device-plugin-model",
             "device-plugin-model-every", "default-model", "ours-model", "ours-pinned",
             "ours-pinned-model")

    def __init__(self, bin_dir: Path, nodes: int, gpus: int, tune_ratio: float,
                 console: Console, burst: bool = False, variant: str | None = None,
                 mix: str | None = None,
                 nodes_to_score: int | None = None, stages: bool = False) -> None:
        self.console, self.tune_ratio = console, tune_ratio
        self.stages = stages  # time each GPU pod's claim allocation and gate's removal too
        self.nodes_to_score = nodes_to_score  # the gpuslice profile's, when not deploy/'s
        self.nodes, self.scenario, mix_name = kwok_scenario(nodes, gpus, variant, mix)
        # what the run replays, written into --json so that the simulator's rows can be
        # recomputed later (placement_matrix.py --cluster-json)
        self.spec = {"nodes": nodes, "gpus": gpus, "variant": variant, "mix": mix,
                     "tune": tune_ratio, "nodes_to_score": nodes_to_score, "burst": burst}
        # the model of the device-plugin path scores the share of nodes the profile does
        self.sim = SimTarget(self.scenario, tune_ratio, nodes_to_score)
        self.name = (f"real control plane (kube-scheduler v1.36, kwok), {nodes} nodes x "
                     f"{gpus} {CLUSTER_MODEL}, {mix_name}")
        self.bin_dir = bin_dir
        self.dev: Any = None
        self.runs = 0
        self.log_dir = Path(tempfile.gettempdir()) / f"dra-placement-{os.getpid()}"
        self.burst = burst
        self.device_plugin = False  # the run in progress is the device-plugin path's
        self.allocator_runs = False  # our DRA allocator runs (it may place a task late)
        self.gated = False  # GPU pods carry the allocator's scheduling gate
        self.pin = False  # CPU-only pods carry it too (the webhook's --gate-cpu-only)

    # -- cluster lifecycle ----------------------------------------------------------------

    def __enter__(self) -> ClusterTarget:
        from kubernetes import client, config

        from gpuslice.devcluster import DevCluster, gpu_node

        repo = Path(__file__).resolve().parents[1]
        self.dev = DevCluster(self.bin_dir, repo / "deploy", scheduler="plain",
                              nodes_to_score=self.nodes_to_score).start()
        self.dev.apply(repo / "deploy" / "dra" / "namespace.yaml")
        self.dev.apply(repo / "deploy" / "dra" / "deviceclasses.yaml")
        # the extender's RBAC, for the device-plugin runs
        self.dev.apply(repo / "deploy" / "base" / "rbac.yaml", "-n", "gpuslice-system")
        nodes = []
        for n in self.nodes:
            # what the node agent publishes (inventory, labels, gpuslice.io resources) for
            # the device-plugin path; the DRA runs use the ResourceSlices below instead
            doc = gpu_node(n.name, CLUSTER_MODEL, count=len(n.gpus))
            for k in ("capacity", "allocatable"):
                doc["status"][k].update(cpu=str(CLUSTER_CPU), memory=f"{CLUSTER_MEM_GIB}Gi")
            nodes.append(doc)
        self.dev.add_nodes(nodes)
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(self.dev.kubeconfig), client_configuration=cfg)
        self.api = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.api)
        self.objects = client.CustomObjectsApi(self.api)
        self.nodes_by_name = {n.name: n for n in self.nodes}
        return self

    def __exit__(self, *exc: object) -> None:
        if self.dev is not None:
            self.api.close()
            self.dev.stop()

    def _slices(self, tainted: bool) -> None:
        for s in self.objects.list_cluster_custom_object(
                "resource.k8s.io", "v1", "resourceslices")["items"]:
            self.objects.delete_cluster_custom_object(
                "resource.k8s.io", "v1", "resourceslices", s["metadata"]["name"])
        taints = ([{"key": ALLOCATOR_TAINT, "value": "gpuslice", "effect": "NoSchedule"}]
                  if tainted else [])
        for n in self.nodes:
            devices = []
            for g in n.gpus:
                dev: dict[str, Any] = {
                    "name": f"gpu-{g.index}",
                    "attributes": {"type": {"string": "share"},
                                   "uuid": {"string": f"GPU-{n.name}-{g.index:02d}"},
                                   "index": {"int": g.index},
                                   "model": {"string": g.model}},
                    "capacity": {
                        "compute": {"value": "100", "requestPolicy": {
                            "default": "100",
                            "validRange": {"min": "1", "max": "100", "step": "1"}}},
                        "memory": {"value": f"{g.memory_mib}Mi", "requestPolicy": {
                            "default": "0",
                            "validRange": {"min": "0", "step": "1Mi"}}}},
                    "allowMultipleAllocations": True}
                if taints:
                    dev["taints"] = taints
                devices.append(dev)
            self.objects.create_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                "metadata": {"name": f"{n.name}-gpu-gpuslice-io"},
                "spec": {"driver": DRIVER, "nodeName": n.name,
                         "pool": {"name": n.name, "generation": self.runs,
                                  "resourceSliceCount": 1},
                         "devices": devices}})

    # -- one replay -----------------------------------------------------------------------

    def trace(self, seed: int) -> list[tuple[int, int, int, int]]:
        """(cpu milli, memory MiB, GPUs, milli per GPU) in arrival order up to 100% arrived."""
        from gpuslice.core.workload import tune

        rng = np.random.default_rng(seed)
        t = tune(self.scenario.tasks, self.scenario.total_gpus * 1000, self.tune_ratio, rng)
        out, demand, cap = [], 0, self.scenario.total_gpus * 1000
        for cpu, mem, num, milli in zip(t.cpu_milli.tolist(), t.memory_mib.tolist(),
                                        t.num_gpu.tolist(), t.gpu_milli.tolist(), strict=True):
            if demand + num * milli > cap:
                break
            demand += num * milli
            out.append((cpu, mem, num, milli))
        return out

    def replay(self, mode: str, seed: int) -> Outcome:
        if mode == "device-plugin-sim":
            return self.sim.replay("device-plugin", seed)
        if mode in ("default-model", "ours-model", "ours-pinned-model"):  # the simulator's
            return self.sim.replay(mode.removesuffix("-model"), seed)
        if mode.startswith("device-plugin-model"):
            return self.sim.replay(mode, seed)
        self.runs += 1
        ns = f"dra-bench-{mode}-{seed}-{self.runs}"
        ours = mode in ("ours", "ours-pinned")
        self._slices(tainted=ours)
        self.core.create_namespace({"metadata": {"name": ns}})
        wait_until(f"ServiceAccount {ns}/default", lambda: bool(
            self.core.read_namespaced_service_account("default", ns)), 60)
        self.device_plugin = mode == "device-plugin"
        self.allocator_runs = self.gated = ours
        self.pin = mode == "ours-pinned"
        allocator: subprocess.Popen[bytes] | None = None
        extender: Proc | None = None
        if self.device_plugin:
            extender = self._start_extender()
        elif ours:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = (self.log_dir / f"dra-allocator-{self.runs}.log").open("wb")
            allocator = subprocess.Popen(
                [sys.executable, "-m", "gpuslice.cli", "dra-allocator", "--kubeconfig",
                 # passes on the watch events, as deployed (--interval: its 1 s default)
                 str(self.dev.kubeconfig), "--settle", "1",
                 # retries of released claims within the time a task is given to settle
                 "--max-backoff", str(SETTLE_S - 1)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
            log.close()
            self._wait_allocator_ready(allocator, self.log_dir / f"dra-allocator-{self.runs}.log")
        try:
            replay = self._burst if self.burst else self._submit_and_measure
            return replay(ns, self.trace(seed))
        finally:
            if allocator is not None:
                allocator.terminate()
                allocator.wait(20)
            if extender is not None:
                extender.stop()
                self.dev.start_scheduler(with_extender=False)
            self.core.delete_namespace(ns)
            self._wait_deleted(ns)

    @staticmethod
    def _wait_allocator_ready(proc: subprocess.Popen[bytes], log: Path) -> None:
        """Until the allocator holds its Lease and the devices' taint has settled (its
        ``--settle 1``), however long its start takes on a loaded machine."""
        wait_until("gpuslice dra-allocator holding its Lease", lambda: proc.poll() is None and
                   b"holding the Lease" in log.read_bytes(), 120, every_s=0.2)
        time.sleep(1.5)

    def _wait_deleted(self, ns: str, stall_s: float = 300.0) -> None:
        """Until namespace ``ns`` is gone: a replay's thousands of pods take the namespace
        controller minutes on a loaded machine, so the wait fails only after ``stall_s``
        without one pod fewer (not after a fixed time)."""
        fewest, since, left = math.inf, time.monotonic(), -1
        while True:
            try:  # an API server slow to answer under the deletions: look again
                if not any(x.metadata.name == ns for x in self.core.list_namespace().items):
                    return
                got = self.core.list_namespaced_pod(ns, limit=1)
                left = len(got.items) + (got.metadata.remaining_item_count or 0)
            except Exception:
                pass
            if 0 <= left < fewest:
                fewest, since = left, time.monotonic()
            elif time.monotonic() - since > stall_s:
                raise RuntimeError(f"namespace {ns}: {left} pod(s) still there, none deleted "
                                   f"in {stall_s:.0f} s")
            time.sleep(1.0)

    def _start_extender(self) -> Proc:
        """``gpuslice extender`` as deploy/base runs it (:meth:`DevCluster.start_extender`),
        and kube-scheduler restarted with the extender in its ``gpuslice-scheduler``
        profile."""
        key = self.dev.dir / "assignment-key"
        key.write_text("dra-placement-benchmark-key-0123456789")
        ext = self.dev.start_extender(key)
        self.dev.start_scheduler(with_extender=True)
        return ext

    def _bound_now(self, ns: str) -> set[str]:
        pods = json.loads(self.core.list_namespaced_pod(ns, _preload_content=False).data)
        return {p["metadata"]["name"] for p in pods["items"] if p["spec"].get("nodeName")}

    def _task(self, ns: str, i: int, cpu: int, mem: int, num: int, milli: int,
              created: dict[str, float] | None = None) -> str:
        """Create task ``i``: its ResourceClaim (GPU tasks on the DRA path) and its pod
        (``created``: when, on the monotonic clock, just before the pod's create)."""
        name = f"t{i:04d}"
        requests = {"cpu": f"{cpu}m", "memory": f"{mem}Mi"}
        scheduler = "default-scheduler"
        if num and self.device_plugin:  # the device-plugin path's resources, not a claim
            scheduler = "gpuslice-scheduler"
            requests["gpuslice.io/gpu"] = str(num)
            if milli < 1000:
                requests["gpuslice.io/gpu-milli"] = str(milli)
        pod: dict[str, Any] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns},
            "spec": {**({"schedulingGates": [{"name": ALLOCATOR_GATE}]}
                        if (num and self.gated) or (not num and self.pin) else {}),
                     "schedulerName": scheduler,
                     "tolerations": [{"operator": "Exists"}],
                     "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "c", "image": "registry.local/model:1",
                                     "resources": {"requests": requests,
                                                   "limits": {k: v for k, v in requests.items()
                                                              if k.startswith("gpuslice.io/")}
                                                   }}]}}
        if num and not self.device_plugin:
            self.objects.create_namespaced_custom_object(
                "resource.k8s.io", "v1", ns, "resourceclaims", {
                    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                    "metadata": {"name": name},
                    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                        "deviceClassName": "share.gpuslice.io", "count": num,
                        "capacity": {"requests": {
                            "compute": str(math.ceil(milli / 10))}}}}]}}})
            pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": name}]
            pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpu"}]
        if created is not None:
            created[name] = time.monotonic()
        self.core.create_namespaced_pod(ns, pod)
        return name

    def _settled(self, ns: str, name: str, has_claim: bool, since: list[float],
                 allocator: bool = True, bound: FirstSeen | None = None) -> bool:
        """Task ``name`` is decided: bound, or unschedulable (its claim, if any, unallocated)
        for SETTLE_S on end, long enough for our allocator's retries (``--max-backoff``).
        Without our allocator (``allocator`` False), or for a pod without a claim, or one our
        allocator released with ``ClaimNotPlaced`` (no room for it), kube-scheduler's verdict
        Unschedulable is final at once: nothing departs, so nothing frees room later (a bind
        error or a conflict, reason SchedulerError, still waits SETTLE_S for the retry).
        ``bound``: a watch of the pods, which sees a bind first."""
        if bound is not None and name in bound.seen:
            since[0] = 0.0  # bound: the caller reads 0 as placed
            return True
        pod = json.loads(self.core.read_namespaced_pod(name, ns, _preload_content=False).data)
        if pod["spec"].get("nodeName"):
            since[0] = 0.0  # bound: the caller reads 0 as placed
            return True
        verdicts = [c for c in (pod.get("status") or {}).get("conditions") or []
                     if c.get("type") == "PodScheduled" and c.get("status") == "False"]
        refused = bool(verdicts)
        if refused and verdicts[0].get("reason") == "Unschedulable" and \
                (not allocator or not has_claim or self._not_placed(ns, name)):
            since[0] = since[0] or time.monotonic()
            return True
        if refused and has_claim:
            claim = self.objects.get_namespaced_custom_object(
                "resource.k8s.io", "v1", ns, "resourceclaims", name)
            refused = not (claim.get("status") or {}).get("allocation")
        now = time.monotonic()
        if not refused:
            since[0] = 0.0
            return False
        since[0] = since[0] or now
        return now - since[0] >= SETTLE_S

    def _not_placed(self, ns: str, name: str) -> bool:
        """Whether our allocator released pod ``name`` from its gate because no node has
        room for its claim (its ``ClaimNotPlaced`` Event)."""
        return bool(self.core.list_namespaced_event(
            ns, field_selector=f"involvedObject.name={name},reason={NOT_PLACED}").items)

    def _burst(self, ns: str, trace: list[tuple[int, int, int, int]]) -> Outcome:
        """Throughput: every task created at once; done when every unbound pod is marked
        unschedulable and nothing was bound or allocated for QUIET_S. (Not the FGD protocol:
        claim-less pods then race our claims for CPU.)"""
        milli_of: dict[str, int] = {}
        t0 = time.monotonic()
        for i, (cpu, mem, num, milli) in enumerate(trace):
            name = self._task(ns, i, cpu, mem, num, milli)
            if num:
                milli_of[name] = num * milli
        last_change, last_count, bound_names = time.monotonic(), -1, set()
        last_write, last_allocated = last_change, -1
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            pods = json.loads(self.core.list_namespaced_pod(
                ns, _preload_content=False).data)["items"]
            bound_names = {p["metadata"]["name"] for p in pods if p["spec"].get("nodeName")}
            allocated = sum(1 for c in self.objects.list_namespaced_custom_object(
                "resource.k8s.io", "v1", ns, "resourceclaims")["items"]
                if (c.get("status") or {}).get("allocation"))
            now = time.monotonic()
            if len(bound_names) != last_count:
                last_count, last_change = len(bound_names), now
            if allocated != last_allocated:  # the allocator still writing: not quiet
                last_allocated, last_write = allocated, now
            waiting = [p for p in pods if not p["spec"].get("nodeName")]
            decided = all(any(c.get("type") == "PodScheduled" and c.get("status") == "False"
                              for c in (p.get("status") or {}).get("conditions") or [])
                          for p in waiting)
            if len(pods) == len(trace) and decided and \
                    now - max(last_change, last_write) >= QUIET_S:
                break
            time.sleep(0.5)
        else:
            self.console.print(f"[yellow]{ns}: not quiet after 600 s[/]")
        allocated = sum(m for n, m in milli_of.items() if n in bound_names)
        cap = self.scenario.total_gpus * 1000
        placed = sum(1 for n in milli_of if n in bound_names)
        return Outcome(100.0 - 100.0 * allocated / cap, placed, last_change - t0)

    def _submit_and_measure(self, ns: str, trace: list[tuple[int, int, int, int]]) -> Outcome:
        """The FGD protocol's replay: tasks submitted one by one, each decided (bound, or
        unschedulable for good: nothing departs, so what does not fit now never will) before
        the next arrives."""
        from functools import partial

        milli_of: dict[str, int] = {}
        watch = FirstSeen(self.dev, f"/api/v1/namespaces/{ns}/pods",
                          lambda p: bool((p.get("spec") or {}).get("nodeName"))).start()
        extra = [FirstSeen(self.dev, f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims",
                           lambda c: bool((c.get("status") or {}).get("allocation"))).start(),
                 FirstSeen(self.dev, f"/api/v1/namespaces/{ns}/pods", lambda p: not (
                     p.get("spec") or {}).get("schedulingGates")).start()] \
            if self.stages else []
        time.sleep(0.5)  # the watch open before the first pod
        t0 = time.monotonic()
        binding_s = 0.0  # summed over the tasks bound: creation to bound (decision latency)
        created: dict[str, float] = {}  # GPU task -> just before its pod's create
        try:
            for i, (cpu, mem, num, milli) in enumerate(trace):
                t_task = time.monotonic()
                name = self._task(ns, i, cpu, mem, num, milli, created if num else None)
                if num:
                    milli_of[name] = num * milli
                since = [0.0]
                wait_until(f"{ns}/{name} bound or unschedulable",
                           partial(self._settled, ns, name,
                                   bool(num) and not self.device_plugin, since,
                                   self.allocator_runs, watch), 120, every_s=0.02)
                if not since[0]:  # bound
                    binding_s += time.monotonic() - t_task
            elapsed = time.monotonic() - t0
            wait_until("the watch seeing every bound GPU pod", lambda: all(
                n in watch.seen for n in self._bound_now(ns) if n in created), 30, every_s=0.2)
        finally:
            for w in (watch, *extra):
                w.stop()
        latencies = tuple(sorted(watch.seen[n] - t for n, t in created.items()
                                 if n in watch.seen))
        stages = tuple((extra[0].seen[n] - t, extra[1].seen[n] - t, watch.seen[n] - t)
                       for n, t in created.items() if extra and n in watch.seen
                       and n in extra[0].seen and n in extra[1].seen)
        pods = json.loads(self.core.list_namespaced_pod(
            ns, _preload_content=False).data)["items"]
        bound_names = {p["metadata"]["name"] for p in pods if p["spec"].get("nodeName")}
        allocated = sum(m for n, m in milli_of.items() if n in bound_names)
        cap = self.scenario.total_gpus * 1000
        placed = sum(1 for n in milli_of if n in bound_names)
        # what stayed pending and why (kube-scheduler's PodScheduled message), per replay
        why: dict[str, int] = {}
        for p in pods:
            if p["spec"].get("nodeName"):
                continue
            kind = "GPU" if p["metadata"]["name"] in milli_of else "CPU-only"
            msg = next((c.get("message") or c.get("reason") or "" for c in
                        (p.get("status") or {}).get("conditions") or []
                        if c.get("type") == "PodScheduled"), "no condition")
            key = f"{kind}: {msg.split('. preemption')[0][:160]}"
            why[key] = why.get(key, 0) + 1
        self.console.print(f"  {ns}: {placed}/{len(milli_of)} GPU tasks and "
                           f"{len(bound_names) - placed}/{len(trace) - len(milli_of)} CPU-only "
                           f"tasks bound; GPU {100.0 * allocated / cap:.1f}% allocated; "
                           f"{len(trace)} tasks in {elapsed:.0f} s")
        for key, n in sorted(why.items(), key=lambda kv: -kv[1])[:4]:
            self.console.print(f"    {n} pending, {key}")
        return Outcome(100.0 - 100.0 * allocated / cap, len(bound_names), binding_s,
                       wall_s=elapsed, latencies=latencies, stages=stages)
