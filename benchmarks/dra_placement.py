"""DRA placement benchmark: default first-fit allocation against our claim allocator.

Issue 21's acceptance figures, measured on one trace: the unallocated GPU share at 100% arrived
workload (FGD's metric) for kube-scheduler's default DRA allocation, for ours, and for our
device-plugin path on the same trace, plus scheduling throughput (claims placed per second)
of the default path and ours. Gates, printed as pass/fail:

* ours within 0.3 percentage points of the device-plugin path;
* ours clearly better than default first fit (at least 1 point, and outside both spreads);
* our throughput at least 50% of the default's.

It is written against :class:`Target`, one trace replay on some cluster:

* ``--sim`` (works today): :class:`SimTarget` replays the trace through the simulator's DRA
  path (``gpuslice.sim.dra``): the default mode models kube-scheduler's node window and scores
  and the allocator's first fit in slice order; ours is the same decision function the
  ``gpuslice dra-allocator`` controller runs. Throughput is decisions per second of the
  placement code alone (no API server), so it bounds what the control plane can reach.
* ``--cluster [--binaries DIR]``: :class:`ClusterTarget` starts the real control plane of
  the cluster tier (kube-apiserver, kube-scheduler with DRAConsumableCapacity and
  DRADeviceTaints, kwok nodes publishing our ResourceSlices) and replays a modest trace on
  it, with kube-scheduler's allocator alone, with ``gpuslice dra-allocator`` running, and
  through the device-plugin path as deployed (the ``gpuslice-scheduler`` profile of
  deploy/base calling ``gpuslice extender``; the simulator's figure for that path is printed
  beside it).
  As FGD's protocol says, tasks are submitted one by one, each decided (bound, or
  unschedulable for SETTLE_S) before the next; throughput is then tasks bound per second of
  their creation-to-bound time (a latency). ``--burst`` creates every task at once instead and
  measures throughput as tasks bound per second of the whole burst; its unallocated figure is
  not FGD's (claim-less pods race our claims for CPU).
  Binaries: ``$GPUSLICE_CLUSTER_BIN`` or ``tools/cluster/build.sh --bin-dir``.

    python benchmarks/dra_placement.py --sim                       # embedded scenario
    python benchmarks/dra_placement.py --sim --variant default --seeds 42-44
    python benchmarks/dra_placement.py --cluster --seeds 42-44     # about 8 min on 2 cores
    python benchmarks/dra_placement.py --cluster --burst --seeds 42-44
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
from rich.console import Console
from rich.table import Table

from gpuslice.adapters.kube.dra import ALLOCATOR_TAINT
from gpuslice.cli import parse_seeds
from gpuslice.devcluster import Proc, wait_until
from gpuslice.sim.runner import Job, Scenario, load_scenario, run_job, scenario_of

DEVICE_PLUGIN = "ours"  # the device-plugin path's policy in the simulator
DRIVER = "gpu.gpuslice.io"
# the control-plane target's nodes (the embedded scenario's A100 nodes)
CLUSTER_MODEL, CLUSTER_CPU, CLUSTER_MEM_GIB = "A100-80GB", 96, 768
# a task unschedulable this long (its claim unallocated) is decided: longer than the allocator's
# longest wait before it places a released claim again (its --max-backoff, below)
SETTLE_S = 5.0
QUIET_S = 12.0  # --burst: no new bind or allocation this long, every other pod unschedulable


@dataclass(frozen=True)
class Outcome:
    """One replay: unallocated GPU % at 100% arrived, tasks placed and the seconds they took
    (on the control plane: each bound task's time from creation to bound, summed)."""

    unallocated_pct: float
    placed: int
    seconds: float

    @property
    def per_second(self) -> float:
        return self.placed / self.seconds if self.seconds > 0 else float("nan")


class Target(Protocol):
    name: str
    modes: tuple[str, ...]

    def replay(self, mode: str, seed: int) -> Outcome:
        """Replay the trace (tuned with ``seed``) with ``mode``: ``default`` (kube-scheduler's
        DRA allocator), ``ours`` (our claim allocator) or ``device-plugin`` (our extender's
        path)."""
        ...


SIM_POLICY = {"default": "dra-default", "ours": "dra-ours", "device-plugin": DEVICE_PLUGIN,
              "device-plugin-model": "deployed", "device-plugin-model-every": "deployed:100"}
PATHS = ("default", "ours", "device-plugin", "device-plugin-sim", "device-plugin-model",
         "device-plugin-model-every")


class SimTarget:
    """The simulator. ``nodes_to_score``: the ``device-plugin-model`` row's
    ``percentageOfNodesToScore`` (default deploy/'s, kube-scheduler's adaptive share);
    ``device-plugin-model-every`` is that model scoring every node (100)."""

    modes = ("default", "ours", "device-plugin", "device-plugin-model",
             "device-plugin-model-every")
    labels: ClassVar[dict[str, str]] = {
        "device-plugin": "device-plugin path, simulator's frag-strand (every pod)"}

    def __init__(self, scenario: Scenario, tune: float = 1.3,
                 nodes_to_score: int | None = None) -> None:
        self.scenario, self.tune = scenario, tune
        self.name = f"simulator, {scenario.name} ({scenario.total_gpus} GPUs)"
        self.policy = dict(SIM_POLICY)
        if nodes_to_score is not None:
            self.policy["device-plugin-model"] = f"deployed:{nodes_to_score}"

    def replay(self, mode: str, seed: int) -> Outcome:
        start = time.perf_counter()
        res = run_job(self.scenario, Job(self.policy[mode], seed, self.tune))
        seconds = time.perf_counter() - start
        return Outcome(100.0 - float(res.binned.alloc[100]), res.tasks - res.binned.failed,
                       seconds)


def kwok_scenario(nodes: int, gpus: int,
                  variant: str | None) -> tuple[list[Any], Scenario, str]:
    """The cluster target's nodes (``nodes`` x ``gpus`` A100s, named as its kwok nodes, so the
    extender's fixed node order is the same), their scenario with the embedded task mix or
    ``variant``'s, and the mix's name."""
    from gpuslice.core.catalog import resolve
    from gpuslice.core.model import Gpu, Node
    from gpuslice.sim.default import default_tasks

    mib = resolve(CLUSTER_MODEL).memory_mib
    made = [Node(f"dra-bench-{i:02d}", CLUSTER_CPU * 1000, CLUSTER_MEM_GIB * 1024,
                 tuple(Gpu(j, CLUSTER_MODEL, mib) for j in range(gpus))) for i in range(nodes)]
    tasks, mix = default_tasks(), "embedded task mix"
    if variant:
        tasks, mix = variant_tasks(variant), f"task mix of trace variant {variant}"
    return made, scenario_of(f"{nodes} x {gpus} {CLUSTER_MODEL}", made, tasks), mix


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
    * ``device-plugin``: the device-plugin path as deploy/ installs it, on the same nodes
      (which also carry what the node agent publishes: the inventory annotation and the
      gpuslice.io resources): GPU tasks are pods asking for ``gpuslice.io/gpu`` (and
      ``gpu-milli`` below a whole GPU) with ``schedulerName: gpuslice-scheduler``, whose profile
      (deploy/base/scheduler-config.yaml) calls ``gpuslice extender`` (a process, HTTPS, on its
      service account) to filter, prioritize and bind; CPU-only tasks go to the default
      scheduler, as they do on a cluster.
    * ``device-plugin-sim``: the simulator's ``ours`` on the same nodes and tuned trace, where
      ``frag-strand`` places every pod (what the device-plugin path would do if it placed the
      CPU-only pods too and kube-scheduler's own scores did not take part).

    The trace is the simulator's tuned task list (``tune`` with the seed) cut where the
    arrived GPU demand reaches 100% of the cluster's GPUs; unallocated GPU % counts the milli of
    the GPU pods bound once the cluster is quiet, as the simulator does. Throughput: GPU pods
    bound per second, from the first create to the last bind."""

    modes = ("default", "ours", "device-plugin", "device-plugin-sim", "device-plugin-model",
             "device-plugin-model-every")

    def __init__(self, bin_dir: Path, nodes: int, gpus: int, tune_ratio: float,
                 console: Console, burst: bool = False, variant: str | None = None,
                 nodes_to_score: int | None = None) -> None:
        self.console, self.tune_ratio = console, tune_ratio
        self.nodes_to_score = nodes_to_score  # the gpuslice profile's, when not deploy/'s
        self.nodes, self.scenario, mix = kwok_scenario(nodes, gpus, variant)
        # the model of the device-plugin path scores the share of nodes the profile does
        self.sim = SimTarget(self.scenario, tune_ratio, nodes_to_score)
        self.name = (f"real control plane (kube-scheduler v1.36, kwok), {nodes} nodes x "
                     f"{gpus} {CLUSTER_MODEL}, {mix}")
        self.bin_dir = bin_dir
        self.dev: Any = None
        self.runs = 0
        self.log_dir = Path(tempfile.gettempdir()) / f"dra-placement-{os.getpid()}"
        self.burst = burst
        self.device_plugin = False  # the run in progress is the device-plugin path's
        self.allocator_runs = False  # our DRA allocator runs (it may place a task late)

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
        if mode.startswith("device-plugin-model"):
            return self.sim.replay(mode, seed)
        self.runs += 1
        ns = f"dra-bench-{mode}-{seed}-{self.runs}"
        self._slices(tainted=mode == "ours")
        self.core.create_namespace({"metadata": {"name": ns}})
        wait_until(f"ServiceAccount {ns}/default", lambda: bool(
            self.core.read_namespaced_service_account("default", ns)), 60)
        self.device_plugin = mode == "device-plugin"
        self.allocator_runs = mode == "ours"
        allocator: subprocess.Popen[bytes] | None = None
        extender: Proc | None = None
        if self.device_plugin:
            extender = self._start_extender()
        elif mode == "ours":
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = (self.log_dir / f"dra-allocator-{self.runs}.log").open("wb")
            allocator = subprocess.Popen(
                [sys.executable, "-m", "gpuslice.cli", "dra-allocator", "--kubeconfig",
                 str(self.dev.kubeconfig), "--settle", "1", "--interval", "0.2",
                 # retries of released claims within the time a task is given to settle
                 "--max-backoff", str(SETTLE_S - 1)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
            log.close()
            time.sleep(3)  # its lease taken and the taint settled
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
            wait_until(f"namespace {ns} deleted", lambda: not any(
                x.metadata.name == ns for x in self.core.list_namespace().items), 300,
                every_s=1.0)

    def _start_extender(self) -> Proc:
        """``gpuslice extender`` as deploy/base runs it (:meth:`DevCluster.start_extender`),
        and kube-scheduler restarted with the extender in its ``gpuslice-scheduler``
        profile."""
        key = self.dev.dir / "assignment-key"
        key.write_text("dra-placement-benchmark-key-0123456789")
        ext = self.dev.start_extender(key)
        self.dev.start_scheduler(with_extender=True)
        return ext

    def _task(self, ns: str, i: int, cpu: int, mem: int, num: int, milli: int) -> str:
        """Create task ``i``: its ResourceClaim (GPU tasks on the DRA path) and its pod."""
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
            "spec": {"schedulerName": scheduler,
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
        self.core.create_namespaced_pod(ns, pod)
        return name

    def _settled(self, ns: str, name: str, has_claim: bool, since: list[float],
                 allocator: bool = True) -> bool:
        """Task ``name`` is decided: bound, or unschedulable (its claim, if any, unallocated)
        for SETTLE_S on end, long enough for our allocator's retries (``--max-backoff``).
        Without our allocator (``allocator`` False) kube-scheduler's verdict Unschedulable
        is final at once: nothing departs, so nothing frees room later (a bind error or a
        conflict, reason SchedulerError, still waits SETTLE_S for the retry)."""
        pod = json.loads(self.core.read_namespaced_pod(name, ns, _preload_content=False).data)
        if pod["spec"].get("nodeName"):
            since[0] = 0.0  # bound: the caller reads 0 as placed
            return True
        verdicts = [c for c in (pod.get("status") or {}).get("conditions") or []
                     if c.get("type") == "PodScheduled" and c.get("status") == "False"]
        refused = bool(verdicts)
        if refused and not allocator and verdicts[0].get("reason") == "Unschedulable":
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
        t0 = time.monotonic()
        binding_s = 0.0  # summed over the tasks bound: creation to bound (decision latency)
        for i, (cpu, mem, num, milli) in enumerate(trace):
            t_task = time.monotonic()
            name = self._task(ns, i, cpu, mem, num, milli)
            if num:
                milli_of[name] = num * milli
            since = [0.0]
            wait_until(f"{ns}/{name} bound or unschedulable",
                       partial(self._settled, ns, name, bool(num) and not self.device_plugin,
                               since, self.allocator_runs), 120, every_s=0.05)
            if not since[0]:  # bound
                binding_s += time.monotonic() - t_task
        elapsed = time.monotonic() - t0
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
        return Outcome(100.0 - 100.0 * allocated / cap, len(bound_names), binding_s)


def pm(mean: float, se: float) -> str:
    """``+m ± se``, or ``+m (one seed)`` where a standard error cannot be had."""
    return f"{mean:+.2f} (one seed)" if math.isnan(se) else f"{mean:+.2f} ± {se:.2f}"


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean and standard error of the per-seed differences ``a - b``."""
    d = np.array(a) - np.array(b)
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
    return float(d.mean()), se


def run(target: Target, seeds: list[int], console: Console,
        only: list[str] | None = None, json_out: Path | None = None,
        doc: Path | None = None, doc_key: str = "main") -> int:
    rows: dict[str, list[Outcome]] = {m: [] for m in target.modes if not only or m in only}
    # in the simulator the device-plugin row is frag-strand itself, not the deployed path
    labels = {**LABELS, **getattr(target, "labels", {})}
    for seed in seeds:
        for mode, outs in rows.items():
            t0 = time.monotonic()
            outs.append(target.replay(mode, seed))
            console.print(f"seed {seed} {mode}: {outs[-1].unallocated_pct:.2f}% unallocated "
                          f"({time.monotonic() - t0:.0f} s)")
    unalloc = {m: [o.unallocated_pct for o in outs] for m, outs in rows.items()}
    if json_out is not None:
        json_out.write_text(json.dumps({"unallocated": {
            m: {str(s): round(v, 4) for s, v in zip(seeds, vals, strict=True)}
            for m, vals in unalloc.items()}, "target": target.name}, indent=1) + "\n")
    table = Table(title=f"DRA placement: {target.name}, seeds {seeds[0]}-{seeds[-1]}")
    for col in ("path", "unallocated GPU % at 100% arrived", "tasks placed / s", "vs default"):
        table.add_column(col, justify="right" if col != "path" else "left")
    stats = {}
    for mode, outs in rows.items():
        u = np.array(unalloc[mode])
        rate = float(np.mean([o.per_second for o in outs]))
        stats[mode] = (float(u.mean()), float(u.std()), rate)
    base_rate = stats["default"][2] if "default" in stats else float("nan")
    for mode, (mean, sd, rate) in stats.items():
        table.add_row(labels.get(mode, mode), f"{mean:.2f} ± {sd:.2f}", f"{rate:,.0f}",
                      "-" if math.isnan(base_rate) else f"{rate / base_rate:.2f}x")
    console.print(table)
    # the simulator's frag-strand placing every pod: the figure each deployed path should reach
    ref = "device-plugin-sim" if "device-plugin-sim" in unalloc else "device-plugin"
    pairs = [(a, b) for a, b in (("device-plugin", ref), ("ours", ref),
                                 ("device-plugin-model", ref), ("device-plugin",
                                                                "device-plugin-model"),
                                 ("device-plugin-model", "device-plugin-model-every"),
                                 ("default", "device-plugin"), ("default", "ours"))
             if a in unalloc and b in unalloc and a != b]
    ptable = Table(title=f"paired per-seed differences (points of unallocated GPU, "
                   f"{len(seeds)} seeds, mean ± standard error)")
    ptable.add_column("difference")
    ptable.add_column("mean ± SE", justify="right")
    diffs = {}
    for a, b in pairs:
        diffs[(a, b)] = paired(unalloc[a], unalloc[b])
        m, se = diffs[(a, b)]
        ptable.add_row(f"{labels.get(a, a)} - {labels.get(b, b)}", pm(m, se))
    console.print(ptable)
    gates = []
    for path in ("device-plugin", "ours"):
        if (path, ref) in diffs:
            m, se = diffs[(path, ref)]
            gates.append((f"{labels[path]} within 0.3 points of the simulator's frag-strand "
                          "(paired mean)", abs(m) <= 0.3, pm(m, se)))
    for path in ("device-plugin", "ours"):
        if ("default", path) in diffs:
            m, se = diffs[("default", path)]
            gates.append((f"{labels[path]} better than DRA first fit by more than 2 SE",
                          not math.isnan(se) and m > 2 * se, f"{m:+.2f} (2 SE = {2 * se:.2f})"))
    if "ours" in stats and "default" in stats and not math.isnan(base_rate):
        gates.append(("our DRA throughput >= 50% of the default's",
                      stats["ours"][2] >= 0.5 * base_rate,
                      f"{stats['ours'][2] / base_rate:.2f}x"))
    for label, ok, value in gates:
        console.print(f"[{'green' if ok else 'red'}]{'PASS' if ok else 'FAIL'}[/] {label}: "
                      f"{value}")
    if doc is not None:
        write_doc(doc, target.name, seeds, unalloc, diffs, gates, doc_key, labels)
    return 0 if all(ok for _, ok, _ in gates) else 1


LABELS = {"default": "DRA first fit (kube-scheduler)", "ours": "DRA, our claim allocator",
          "device-plugin": "device-plugin path as deployed",
          "device-plugin-sim": "simulator, frag-strand (every pod)",
          "device-plugin-model": "simulator, deployed model",
          "device-plugin-model-every": "simulator, deployed model, every node scored"}
def doc_markers(key: str) -> tuple[str, str]:
    """The comments around a generated section (``--doc-key`` names one of several)."""
    tag = "--doc" if key == "main" else f"--doc {key}"
    return (f"<!-- generated by benchmarks/dra_placement.py {tag}: start -->",
            f"<!-- generated by benchmarks/dra_placement.py {tag}: end -->")


def write_doc(doc: Path, name: str, seeds: list[int], unalloc: dict[str, list[float]],
              diffs: dict[tuple[str, str], tuple[float, float]],
              gates: list[tuple[str, bool, str]], key: str = "main",
              labels: dict[str, str] | None = None) -> None:
    """Replace the generated section ``key`` of ``doc`` (between its markers; appended when
    absent) with this run's per-seed table, paired differences and gates."""
    start, end = doc_markers(key)
    labels = labels or LABELS
    lines = [start, "", f"Run: {name}; seeds {seeds[0]}-{seeds[-1]} ({len(seeds)}), "
             f"{time.strftime('%Y-%m-%d')}. Unallocated GPU % at 100% arrived, per seed:", "",
             "| path | " + " | ".join(map(str, seeds)) + " | mean |",
             "|---|" + "---|" * (len(seeds) + 1)]
    for m, vals in unalloc.items():
        lines.append(f"| {labels.get(m, m)} | " + " | ".join(f"{v:.2f}" for v in vals)
                     + f" | {np.mean(vals):.2f} |")
    lines += ["", "Paired per-seed differences (same tuned trace per seed for every path):", "",
              "| difference | mean ± standard error |", "|---|---|"]
    for (a, b), (m, se) in diffs.items():
        lines.append(f"| {labels.get(a, a)} - {labels.get(b, b)} | {pm(m, se)} |")
    if gates:
        lines += ["", "| goal | result | measured |", "|---|---|---|"]
    for label, ok, value in gates:
        lines.append(f"| {label} | {'met' if ok else 'missed'} | {value} |")
    lines += ["", end]
    text = doc.read_text() if doc.exists() else ""
    if start in text and end in text:
        text = text[:text.index(start)] + "\n".join(lines) + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n"
    doc.write_text(text)


def variant_tasks(variant: str) -> Any:
    """The task list of trace variant ``variant`` (found through GPUSLICE_DATA), its GPU-model
    constraints dropped: the benchmark's kwok nodes are all one model."""
    import dataclasses

    from gpuslice.adapters.traces.data import variant_paths

    pods, nodes = variant_paths(variant)
    tasks = load_scenario(pods, nodes).tasks
    return dataclasses.replace(tasks, specs=(frozenset(),) * len(tasks.specs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--sim", action="store_true", help="replay through the simulator")
    mode.add_argument("--cluster", action="store_true",
                      help="start the real control plane (issue 19's dev cluster) and replay "
                      "on it")
    ap.add_argument("--binaries", type=Path, default=None,
                    help="cluster binaries (default $GPUSLICE_CLUSTER_BIN, else "
                    "tools/cluster/build.sh --bin-dir)")
    ap.add_argument("--nodes", type=int, default=None,
                    help="--cluster: kwok nodes (default 6); --sim: replay on that many nodes "
                    "of the cluster target's shape instead of the scenario's")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per node of --nodes (default 8)")
    ap.add_argument("--variant", default=None, help="trace variant from the shared data "
                    "folder (default: the embedded scenario); with --cluster its task mix on "
                    "the kwok nodes, GPU-model constraints dropped")
    ap.add_argument("--burst", action="store_true",
                    help="--cluster: create every task at once and measure throughput (tasks "
                    "bound per second) instead of the FGD protocol's one-by-one replay")
    ap.add_argument("--nodes-to-score", type=int, default=None, metavar="PERCENT",
                    help="the gpuslice-scheduler profile's percentageOfNodesToScore, on the "
                    "cluster and in the device-plugin-model path (default: deploy/'s, 0: "
                    "kube-scheduler's adaptive share; 100: every node)")
    ap.add_argument("--seeds", default="42-44")
    ap.add_argument("--only", default=None, metavar="PATH[,PATH]",
                    help=f"replay only these paths ({', '.join(PATHS)}; device-plugin-sim "
                    "only with --cluster: the simulator's device-plugin row is it)")
    ap.add_argument("--tune", type=float, default=1.3)
    ap.add_argument("--json", type=Path, default=None, metavar="FILE",
                    help="write the per-seed figures: {\"unallocated\": {PATH: {SEED: %%}}}")
    ap.add_argument("--doc", type=Path, default=None, metavar="MD",
                    help="write the per-seed table, paired differences and gates into MD "
                    "(between the generated-section markers; e.g. docs/dra-placement.md)")
    ap.add_argument("--doc-key", default="main", metavar="KEY",
                    help="which generated section of --doc this run writes (default main)")
    args = ap.parse_args(argv)
    console = Console()
    seeds = parse_seeds(args.seeds)
    only = args.only.split(",") if args.only else None
    known = set(PATHS) if args.cluster else set(PATHS) - {"device-plugin-sim"}
    if only and not set(only) <= known:
        raise SystemExit(f"dra_placement: --only takes {', '.join(sorted(known))}; got "
                         f"{args.only!r}")
    if args.nodes_to_score is not None and not 0 <= args.nodes_to_score <= 100:
        raise SystemExit("dra_placement: --nodes-to-score takes a percentage, 0..100 (0: "
                         f"kube-scheduler's adaptive share); got {args.nodes_to_score}")
    if args.burst and not args.cluster:
        raise SystemExit("dra_placement: --burst needs --cluster")
    if args.cluster and args.variant:
        from gpuslice.adapters.traces.data import variant_paths

        try:
            variant_paths(args.variant)
        except Exception as exc:
            raise SystemExit(f"dra_placement: --variant {args.variant}: {exc}") from None
    if args.cluster:
        from gpuslice.devcluster import find_bin_dir, missing_binaries

        args.nodes = 6 if args.nodes is None else args.nodes
        if args.nodes < 1 or args.gpus < 1:
            raise SystemExit("dra_placement: --nodes and --gpus must be at least 1")
        bin_dir = args.binaries or find_bin_dir(Path(__file__).resolve().parents[1])
        missing = missing_binaries(bin_dir)
        if missing:
            raise SystemExit(f"dra_placement: {bin_dir} lacks {', '.join(missing)}; build "
                             "them with tools/cluster/build.sh")
        with ClusterTarget(bin_dir, args.nodes, args.gpus, args.tune, console,
                           burst=args.burst, variant=args.variant,
                           nodes_to_score=args.nodes_to_score) as ct:
            return run(ct, seeds, console, only, args.json, args.doc, args.doc_key)
    target: Target
    if args.nodes is not None:
        if args.nodes < 1 or args.gpus < 1:
            raise SystemExit("dra_placement: --nodes and --gpus must be at least 1")
        _, scenario, mix = kwok_scenario(args.nodes, args.gpus, args.variant)
        target = SimTarget(scenario, args.tune, args.nodes_to_score)
        target.name += f", {mix}"
    elif args.variant:
        from gpuslice.adapters.traces.data import variant_paths

        pods, nodes = variant_paths(args.variant)
        target = SimTarget(load_scenario(pods, nodes), args.tune, args.nodes_to_score)
    else:
        from gpuslice.sim.default import default_nodes, default_tasks

        target = SimTarget(scenario_of("embedded-default", default_nodes(), default_tasks()),
                           args.tune, args.nodes_to_score)
    return run(target, seeds, console, only, args.json, args.doc, args.doc_key)


if __name__ == "__main__":
    sys.exit(main())
