"""The DRA runs of ``cluster_scale.py --path dra``: the same kwok nodes publish our driver's
ResourceSlices (one share device per GPU, consumable compute and memory, as
``core.dra.pool_slices`` writes them for the node's driver), and P pods each with a
ResourceClaim of ``share.gpuslice.io`` (compute 25/25/50/75 of 100, 8 GiB) are scheduled twice:

* **kube-scheduler's DRA allocation**: untainted devices, the DynamicResources plugin
  allocates each claim in the pod's scheduling cycle (first fit over the devices);
* **with gpuslice dra-allocator**: the devices carry the allocator's taint (as our driver
  publishes them while the allocator's Lease is fresh), ``gpuslice dra-allocator`` places the
  claims with frag-strand and kube-scheduler binds each pod where its claim was put;
* with ``--gated``, a third run: the same, the pods created with the allocator's scheduling
  gate (``gpu.gpuslice.io/allocator``), as gpuslice's admission webhook creates them in the
  namespaces that opt in (docs/dra-placement.md): kube-scheduler tries each pod once its claim
  is allocated, where the ungated pods of the second run are tried before, fail and back off.

The pods and claims are created while no scheduler (and no allocator) runs; the clock runs
from their start to the last pod bound. A watch on the claims records when each allocation
appeared. Over-allocation is read back from the claims: the consumed compute and memory summed
per device against its capacity, and each pod bound to the node its claim's allocation names.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from first_seen import FirstSeen
from gpuslice.adapters.kube import dra as kdra
from gpuslice.core import dra
from gpuslice.core.catalog import resolve
from gpuslice.core.devices import GpuDevice
from gpuslice.devcluster import DevCluster, wait_until

MODEL = "A100-80GB"
NS = "bench-dra"
COMPUTE = (25, 25, 50, 75)  # % of a GPU, the extender run's 250/250/500/750 milli
MEMORY = "8Gi"


def node_slices(node: str, gpus: int, tainted: bool, generation: int) -> list[dict[str, Any]]:
    """The ResourceSlices our DRA driver publishes for a node of ``gpus`` A100-80GB in share
    mode (``tainted``: with the allocator's taint, as while its Lease is fresh)."""
    mib = resolve(MODEL).memory_mib
    facts = [dra.GpuFacts(GpuDevice(j, f"GPU-{node}-{j:02d}", "NVIDIA A100-SXM4-80GB", MODEL,
                                    mib, 108, (8, 0))) for j in range(gpus)]
    plan = dra.pool_slices(facts, {f.gpu.uuid: dra.SHARE for f in facts}, "580.0.0",
                           dra.Features(), allocator_taint=tainted)
    return [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
             "metadata": {"name": f"{node}-{kdra.DRIVER.replace('.', '-')}-{k}"},
             "spec": {**spec, "driver": kdra.DRIVER, "nodeName": node,
                      "pool": {"name": node, "generation": generation,
                               "resourceSliceCount": len(plan.slices)}}}
            for k, spec in enumerate(plan.slices)]


def publish(dev: DevCluster, nodes: list[str], gpus: int, tainted: bool, generation: int,
            ) -> None:
    """Replace every ResourceSlice with the nodes' (``tainted`` or not)."""
    dev.kubectl("delete", "resourceslices", "--all", "--wait=true", timeout_s=600)
    for lo in range(0, len(nodes), 250):
        docs = [s for n in nodes[lo:lo + 250]
                for s in node_slices(n, gpus, tainted, generation)]
        dev.kubectl("create", "-f", "-", input=yaml.safe_dump_all(docs), timeout_s=600)


def claimed_pod(i: int, gated: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Pod ``i`` and its ResourceClaim (a share of one GPU); ``gated``: the pod carries the
    allocator's scheduling gate."""
    name = f"d{i:05d}"
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": name, "namespace": NS},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                 "deviceClassName": "share.gpuslice.io", "count": 1,
                 "capacity": {"requests": {"compute": str(COMPUTE[i % len(COMPUTE)]),
                                           "memory": MEMORY}}}}]}}}
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": NS},
           "spec": {"schedulerName": "default-scheduler", "terminationGracePeriodSeconds": 0,
                    "tolerations": [{"operator": "Exists"}],
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                    "containers": [{"name": "m", "image": "model:1",
                                    "resources": {"claims": [{"name": "gpu"}]}}]}}
    if gated:
        pod["spec"]["schedulingGates"] = [{"name": kdra.ALLOCATOR_GATE}]
    return pod, claim


def create(dev: DevCluster, n: int, gated: bool = False) -> float:
    t0 = time.monotonic()
    for lo in range(0, n, 500):
        made = [claimed_pod(i, gated) for i in range(lo, min(n, lo + 500))]
        dev.kubectl("create", "-f", "-", input=yaml.safe_dump_all([c for _, c in made]),
                    timeout_s=600)
        dev.kubectl("create", "-f", "-", input=yaml.safe_dump_all([p for p, _ in made]),
                    timeout_s=600)
    return time.monotonic() - t0


def allocation_watch(dev: DevCluster) -> FirstSeen:
    """When each claim of the namespace was first seen allocated (monotonic seconds)."""
    return FirstSeen(dev, f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims",
                     lambda c: bool((c.get("status") or {}).get("allocation")))


def paced(dev: DevCluster, first: int, n: int, rate: float, watch: FirstSeen,
          timeout_s: float, gated: bool = False) -> list[float]:
    """``n`` more pods with claims, one every ``1 / rate`` s (each claim then its pod, by the
    API); each claim's allocation latency in seconds, from its pod's creation to the watch
    seeing the allocation."""
    ctx = dev._ssl()

    def post(path: str, doc: dict[str, Any]) -> None:
        req = urllib.request.Request(dev.server + path, data=json.dumps(doc).encode(),
                                     method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, context=ctx, timeout=30) as r:
            r.read()

    created: dict[str, float] = {}
    t0 = time.monotonic()
    for k in range(n):
        time.sleep(max(0.0, t0 + k / rate - time.monotonic()))
        pod, claim = claimed_pod(first + k, gated)
        post(f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims", claim)
        post(f"/api/v1/namespaces/{NS}/pods", pod)
        created[pod["metadata"]["name"]] = time.monotonic()
    wait_until(f"{n} paced claims allocated", lambda: all(
        c in watch.seen for c in created), timeout_s, every_s=0.5)
    return sorted(watch.seen[c] - t for c, t in created.items())


def over_allocation(claims: list[dict[str, Any]], pods: list[dict[str, Any]]) -> list[str]:
    """Devices given more compute or memory than they have, a device taken whole and shared
    at once, and pods bound elsewhere than their claim's allocation."""
    mib = resolve(MODEL).memory_mib
    problems: list[str] = []
    for (pool, device), u in kdra.claim_usage(claims, kdra.DRIVER).items():
        if u.consumed.get("compute", 0) > 100:
            problems.append(f"{pool}/{device}: compute {u.consumed['compute']} of 100")
        if u.consumed.get("memory", 0) > mib * 2 ** 20:
            problems.append(f"{pool}/{device}: memory {u.consumed['memory']} of {mib} MiB")
        if u.whole and u.consumed:
            problems.append(f"{pool}/{device}: taken whole and shared")
    node_of = {c["metadata"]["name"]: kdra.allocated_node(c) for c in claims}
    for p in pods:
        bound = p["spec"].get("nodeName")
        want = node_of.get(p["metadata"]["name"])
        if bound and want and bound != want:
            problems.append(f"pod {p['metadata']['name']} on {bound}, its claim on {want}")
    return problems


def start_allocator(dev: DevCluster, log: Path) -> subprocess.Popen[bytes]:
    """``gpuslice dra-allocator`` as deploy/dra runs it, its taint settled after 1 s."""
    out = log.open("wb")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "gpuslice.cli", "dra-allocator", "--kubeconfig",
             str(dev.kubeconfig), "--settle", "1"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
    finally:
        out.close()


def clean(dev: DevCluster, list_json: Callable[..., list[dict[str, Any]]]) -> None:
    """Delete the run's pods and claims (the claims' delete-protection finalizer taken off
    once their pods are gone, should the claim controller not have done it yet)."""
    dev.kubectl("delete", "pods", "--all", "-n", NS, "--grace-period=0", "--force",
                "--wait=false", timeout_s=600)
    wait_until("pods deleted", lambda: not list_json(dev, "pods", "-n", NS), 600, every_s=2)
    dev.kubectl("delete", "resourceclaims", "--all", "-n", NS, "--wait=false", timeout_s=600)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and list_json(dev, "resourceclaims", "-n", NS):
        time.sleep(2)
    for c in list_json(dev, "resourceclaims", "-n", NS):
        dev.kubectl("patch", "resourceclaim", c["metadata"]["name"], "-n", NS, "--type=merge",
                    "-p", '{"metadata":{"finalizers":null}}', check=False)
    wait_until("claims deleted", lambda: not list_json(dev, "resourceclaims", "-n", NS), 300,
               every_s=2)


def run_dra(dev: DevCluster, nodes: list[str], gpus: int, pods: int, ours: bool,
            timeout_s: float, generation: int, helpers: Any, paced_n: int = 0,
            paced_rate: float = 10.0, gated: bool = False) -> dict[str, Any]:
    """One DRA run (``ours``: with ``gpuslice dra-allocator``): the burst of ``pods``, then
    ``paced_n`` pods arriving at ``paced_rate`` per second for the allocation latency;
    ``helpers``: cluster_scale's module (its metrics readers, CPU sampling and pod
    listing)."""
    from rich.console import Console

    console = Console(stderr=True)
    if "kube-scheduler" in dev.procs:
        dev.procs.pop("kube-scheduler").stop()
    publish(dev, nodes, gpus, tainted=ours, generation=generation)
    created = create(dev, pods, gated)
    console.print(f"  {pods} pods with claims created in {created:.0f} s; starting "
                  f"kube-scheduler{' and gpuslice dra-allocator' if ours else ''}")
    watch = allocation_watch(dev).start()
    before = helpers.cpu_now(dev, {})
    allocator = start_allocator(dev, dev.dir / f"dra-allocator-{generation}.log") \
        if ours else None
    pids = {"gpuslice dra-allocator": allocator.pid} if allocator is not None else {}
    before.update({"gpuslice dra-allocator": 0.0})
    t0 = time.monotonic()
    try:
        dev.start_scheduler(with_extender=False)
        wait_until(f"{pods} pods bound", lambda: helpers.unbound(dev, NS) == 0, timeout_s,
                   every_s=1.0)
        elapsed = time.monotonic() - t0
        after = helpers.cpu_now(dev, pids)
        metrics = dev.scheduler_metrics()  # the burst's, before the paced pods
        at = sorted(t - t0 for t in watch.seen.values())
        latency = paced(dev, pods, paced_n, paced_rate, watch, timeout_s, gated) \
            if paced_n else []
    finally:
        watch.stop()
        if allocator is not None:
            allocator.terminate()
            allocator.wait(30)
    spent = {n: after.get(n, 0.0) - before.get(n, 0.0) for n in after}
    algo = helpers.histogram(metrics, "scheduler_scheduling_algorithm_duration_seconds")
    attempt = helpers.histogram(metrics, "scheduler_scheduling_attempt_duration_seconds",
                                {"result": "scheduled"})
    q = helpers.quantile
    res: dict[str, Any] = {
        "pods": pods, "seconds": elapsed, "pods_per_s": pods / elapsed,
        "retries": helpers.counter(metrics, "scheduler_schedule_attempts_total", "error")
        + helpers.counter(metrics, "scheduler_schedule_attempts_total", "unschedulable"),
        "algo_p50_ms": q(algo, 0.5) * 1e3, "algo_p99_ms": q(algo, 0.99) * 1e3,
        "attempt_p50_ms": q(attempt, 0.5) * 1e3, "attempt_p99_ms": q(attempt, 0.99) * 1e3,
        "allocated": len(at),
        "alloc_p50_s": at[len(at) // 2] if at else float("nan"),
        "alloc_p99_s": at[min(len(at) - 1, int(0.99 * len(at)))] if at else float("nan"),
        "cpu_ms": {n: 1e3 * spent.get(n, 0.0) / pods for n in helpers.DRA_COMPONENTS},
        "cores": sum(spent.values()) / elapsed,
        "paced": len(latency), "paced_rate": paced_rate,
        "latency_p50_ms": 1e3 * latency[len(latency) // 2] if latency else float("nan"),
        "latency_p99_ms": 1e3 * latency[min(len(latency) - 1, int(0.99 * len(latency)))]
        if latency else float("nan"),
    }
    got = helpers.list_json(dev, "pods", "-n", NS)
    claims = helpers.list_json(dev, "resourceclaims", "-n", NS)
    burst = {claimed_pod(i)[0]["metadata"]["name"] for i in range(pods)}
    res["bound"] = sum(1 for p in got if p["spec"].get("nodeName") and
                       p["metadata"]["name"] in burst)
    problems = over_allocation(claims, got)
    res["over_allocation"] = len(problems)
    for p in problems[:5]:
        console.print(f"  [red]over-allocation: {p}[/]")
    dev.procs.pop("kube-scheduler").stop()
    clean(dev, helpers.list_json)
    return res



ROWS = ("kube-scheduler's DRA allocation (first fit)", "with gpuslice dra-allocator (frag-strand)",
        "with gpuslice dra-allocator, pods gated (as the webhook admits them)")


def report(runs: list[dict[str, Any]], nodes: int, gpus: int, pods: int, total_s: float,
           cores: int | None, console: Any, write: Path | None, components: tuple[str, ...],
           ) -> int:
    """Print (and with ``write`` append to that markdown file) the DRA runs (two, or three
    with the gated one); 1 when a run lost a pod or over-allocated a device."""
    from rich.table import Table

    default, ours = runs[0], runs[1]
    ratio = ours["pods_per_s"] / default["pods_per_s"]
    rows = ROWS[:len(runs)]
    cols = ("run", "pods/s", "bound", "failed attempts", "scheduling algorithm p50 / p99 ms",
            "attempt p50 / p99 ms", "claims allocated", "allocated p50 / p99 s after start",
            "over-allocated")

    def cells(r: dict[str, Any]) -> list[str]:
        return [f"{r['pods_per_s']:.1f}", f"{r['bound']}/{r['pods']}", str(r["retries"]),
                f"{r['algo_p50_ms']:.1f} / {r['algo_p99_ms']:.1f}",
                f"{r['attempt_p50_ms']:.1f} / {r['attempt_p99_ms']:.1f}",
                f"{r['allocated']}/{r['pods']}",
                f"{r['alloc_p50_s']:.1f} / {r['alloc_p99_s']:.1f}", str(r["over_allocation"])]

    table = Table(title=f"DRA: {nodes} kwok nodes x {gpus} GPUs, {pods} pods with claims per "
                  f"run ({cores} CPUs, whole benchmark {total_s / 60:.1f} min)")
    for c in cols:
        table.add_column(c)
    for name, r in zip(rows, runs, strict=True):
        table.add_row(name, *cells(r))
    console.print(table)
    cpu = Table(title="CPU per pod bound (ms, user + system, over the timed window)")
    for c in ("run", *components, "all", "cores busy"):
        cpu.add_column(c)
    for name, r in zip(rows, runs, strict=True):
        cpu.add_row(name, *(f"{r['cpu_ms'][n]:.1f}" for n in components),
                    f"{sum(r['cpu_ms'].values()):.1f}", f"{r['cores']:.2f} of {cores}")
    console.print(cpu)
    lat = [f"{r['latency_p50_ms']:.0f} / {r['latency_p99_ms']:.0f}" for r in runs]
    paced_line = (f"claim allocation latency, {runs[0]['paced']} more pods arriving at "
                  f"{runs[0]['paced_rate']:g}/s after the burst (pod created -> allocation "
                  f"seen), p50 / p99 ms: " + "; ".join(
                      f"{name.split(' (')[0]} {v}" for name, v in zip(rows, lat, strict=True))
                  + " (goal p99 <= 1000 for ours)")
    if runs[0]["paced"]:
        console.print(paced_line)
    gated = (f"; gated {runs[2]['pods_per_s'] / default['pods_per_s']:.2f}"
             if len(runs) > 2 else "")
    console.print(f"ratio dra-allocator / kube-scheduler's DRA allocation: {ratio:.2f} "
                  f"(goal >= 0.80){gated}; over-allocation: "
                  f"{' / '.join(str(r['over_allocation']) for r in runs)} (must be 0)")
    if write is not None:
        lines = ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
        lines += [f"| {name} | " + " | ".join(cells(r)) + " |"
                  for name, r in zip(rows, runs, strict=True)]
        lines += ["", "CPU per pod bound (ms, user + system, over the timed window):", "",
                  "| run | " + " | ".join(components) + " | all | cores busy |",
                  "|---" * (len(components) + 3) + "|"]
        lines += [f"| {name} | " + " | ".join(f"{r['cpu_ms'][n]:.1f}" for n in components)
                  + f" | {sum(r['cpu_ms'].values()):.1f} | {r['cores']:.2f} of {cores} |"
                  for name, r in zip(rows, runs, strict=True)]
        if runs[0]["paced"]:
            lines += ["", paced_line[0].upper() + paced_line[1:] + "."]
        block = (f"<!-- cluster_scale --path dra: {nodes} nodes x {gpus} GPUs, {pods} pods -->"
                 "\n" + "\n".join(lines) + f"\n\nRatio {ratio:.2f}{gated}; whole benchmark "
                 f"{total_s / 60:.1f} min on {cores} CPUs.\n")
        write.parent.mkdir(parents=True, exist_ok=True)
        with write.open("a") as f:
            f.write("\n" + block)
        console.print(f"appended to {write}")
    bad = any(r["over_allocation"] or r["bound"] != r["pods"] for r in runs)
    return 1 if bad else 0
