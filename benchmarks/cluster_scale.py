"""Scheduling throughput on the real control plane: kube-scheduler with the gpuslice extender
(fractional pods) against kube-scheduler alone (whole GPUs), both measured in this run.

A dev cluster (tools/cluster/build.sh's binaries: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, kwok) with N kwok nodes of 8 A100-80GB GPUs each, as
the node agent describes them (inventory annotation, GFD labels, gpuslice.io/gpu and
nvidia.com/gpu capacity). Two runs on the same nodes:

* **gpuslice**: P pods asking 1 gpuslice.io/gpu with 250..750 gpuslice.io/gpu-milli, scheduled
  by the ``gpuslice-scheduler`` profile, which calls ``gpuslice extender`` (a process, HTTPS,
  on its service account) for filter, prioritize and bind;
* **baseline**: P pods asking 1 nvidia.com/gpu (a whole GPU), kube-scheduler alone; with
  ``--baseline fractional`` the gpuslice run's own pods through the same ``gpuslice-scheduler``
  profile without the extender (kube-scheduler counts the three extended resources against the
  node totals and chooses no GPU): what the extender's path adds to the same pods.

kwok runs only its Node stages (``--pod-lifecycle``: its Pod stages too), so a bound pod
stays as bound, as kube-scheduler's scheduler_perf runs no kubelet; its node Leases last 40 s
per 1000 nodes, so heartbeats load the API server alike at every size. The pods are created
while no scheduler runs; pods/s is the burst's rate from the first pod
bound to the last (a watch of the pods: each pod's first event with a node), and CPU is counted
from the scheduler's start until a poll finds every pod bound. Latency
as the scheduler sees it: ``scheduler_scheduling_algorithm_duration_seconds`` (filter and score,
including the extender's HTTP round trips; the 1.36 scheduler has no per-extender metric), and
the extender's own ``gpuslice_extender_request_seconds`` per verb. Over-allocation is read back
from the pods' assignments in the API server and must be 0 (the baseline's pods: their
requests summed per node against its allocatable).

    python benchmarks/cluster_scale.py            # 1000 nodes, 5000 pods
    python benchmarks/cluster_scale.py --nodes 5000
    python benchmarks/cluster_scale.py --quick    # 100 nodes, 500 pods
    ... --write docs/scale.md                     # the figures into that file
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the cluster tier's node and pod builders
sys.path.insert(0, str(REPO / "benchmarks"))  # cluster_scale_dra

from tests.cluster.helpers import assignment, over_allocation  # noqa: E402

from cluster_scale_report import (  # noqa: E402
    PROFILE_TITLE,
    api_bind_line,
    go_lines,
    idle_line,
    packing_line,
    profile_rows,
    profile_table,
    requests_line,
    sys_line,
    threads_line,
    timeline_line,
    window_line,
)
from first_seen import FirstSeen, burst_quantiles, burst_rate  # noqa: E402
from go_profile import APISERVER_WHERE, Capture, breakdown  # noqa: E402
from gpuslice.adapters.kube.objects import quantity  # noqa: E402
from gpuslice.core.assignment import ANNOTATION  # noqa: E402
from gpuslice.devcluster import DevCluster, find_bin_dir, gpu_node, wait_until  # noqa: E402
from gpuslice.devcluster.procs import insecure  # noqa: E402
from proc_cpu import by_thread, cpu_seconds, cpu_split, thread_cpu, thread_names  # noqa: E402
from prom_text import (  # noqa: E402
    api_requests,
    counter,
    histogram,
    minus,
    per_pod,
    pod_watch_events,
    quantile,
)

KEY = "cluster-scale-benchmark-key-0123456789abcdef"
NS = "bench"


BINDING = {"verb": "POST", "resource": "pods", "subresource": "binding"}


def api_metrics(dev: DevCluster) -> str:
    return dev.kubectl("get", "--raw", "/metrics", timeout_s=60).stdout


def binding_buckets(text: str) -> list[tuple[float, float]]:
    """kube-apiserver's own latency histogram for the Binding writes so far (whoever wrote
    them: kube-scheduler alone, or the extender)."""
    return histogram(text, "apiserver_request_duration_seconds", BINDING)


def unbound(dev: DevCluster, ns: str = NS) -> int:
    """Pods of the benchmark not bound yet: a metadata-only list of those with no nodeName (the
    scheduler's 'scheduled' counter misses pods whose bind it timed out on while the extender
    still completed it)."""
    req = urllib.request.Request(
        f"{dev.server}/api/v1/namespaces/{ns}/pods?fieldSelector=spec.nodeName%3D",
        headers={"Accept": "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"})
    with urllib.request.urlopen(req, context=dev._ssl(), timeout=60) as r:
        return len(json.loads(r.read())["items"] or [])


# kube-scheduler's client rate limit in the benchmark: high enough that no run is held by it
# (with 200, the dev cluster's own, the scheduler alone's Bindings came at 200/s after a burst
# of 400: 217 pods/s for 5000 pods, as it measured at 1000 nodes; the extender's Binding
# writer has no such limit)
SCHEDULER_QPS = 5000


def lease_s(nodes: int) -> int:
    """kwok's node Lease duration for ``nodes``: the dev cluster's (renewed a quarter of it
    apart) per 1000 nodes, at least that, so 5000 nodes' heartbeats load the API server and
    etcd as 1000 nodes' do."""
    base = DevCluster.node_lease_s
    return max(base, base * nodes // 1000)


BASELINES = {"whole": "whole GPUs", "fractional": "fractional, no extender"}


def pod(i: int, fractional: bool, rng: random.Random) -> dict[str, Any]:
    if fractional:
        limits = {"gpuslice.io/gpu": "1", "gpuslice.io/gpu-milli": str(rng.choice(
            (250, 250, 500, 750))), "gpuslice.io/gpu-memory": "8192"}
        scheduler = "gpuslice-scheduler"
    else:
        limits = {"nvidia.com/gpu": "1"}
        scheduler = "default-scheduler"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"p{i:05d}", "namespace": NS},
            "spec": {"schedulerName": scheduler, "terminationGracePeriodSeconds": 0,
                     "tolerations": [{"operator": "Exists"}],
                     "containers": [{"name": "m", "image": "model:1",
                                     "resources": {"limits": limits}}]}}


def create_pods(dev: DevCluster, n: int, fractional: bool) -> float:
    rng = random.Random(7)
    t0 = time.monotonic()
    for lo in range(0, n, 500):
        docs = [pod(i, fractional, rng) for i in range(lo, min(n, lo + 500))]
        dev.kubectl("create", "-f", "-", input=yaml.safe_dump_all(docs), timeout_s=600)
    return time.monotonic() - t0


def list_json(dev: DevCluster, *args: str) -> list[dict[str, Any]]:
    out = dev.kubectl("get", *args, "-o", "json", timeout_s=600).stdout
    return list(json.loads(out)["items"])


CPU_COMPONENTS = ("kube-scheduler", "gpuslice extender", "kube-apiserver", "etcd", "kwok",
                  "kube-controller-manager")
DRA_COMPONENTS = ("kube-scheduler", "gpuslice dra-allocator", "kube-apiserver", "etcd", "kwok",
                  "kube-controller-manager")


def cpu_now(dev: DevCluster, ours: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of the cluster's processes and ``ours`` (name -> PID)."""
    pids = {n: p.pid for n, p in dev.procs.items() if p.pid}
    pids.update(ours)
    return {n: cpu_seconds(pid) for n, pid in pids.items()
            if n in CPU_COMPONENTS or n in DRA_COMPONENTS}


def background_cores(dev: DevCluster, extender_pid: int, seconds: float = 10.0) -> float:
    """Cores the cluster keeps busy with no pod to schedule (kwok's node leases and status
    updates, the API server and etcd serving them, the controllers): a cost per second, so
    per pod it is larger the slower the pods go."""
    before = cpu_now(dev, {"gpuslice extender": extender_pid})
    time.sleep(seconds)
    after = cpu_now(dev, {"gpuslice extender": extender_pid})
    return sum(after[n] - before.get(n, 0.0) for n in after) / seconds


def in_use(pods: list[dict[str, Any]]) -> tuple[int, int, int]:
    """GPUs and nodes holding at least one share of the pods' assignments (how tightly the
    policy packed them: fewer is tighter), and the fewest GPUs their milli could fill."""
    held = [assignment(p) for p in pods
            if ANNOTATION in (p["metadata"].get("annotations") or {})]
    shares = [g for a in held for c in a.containers for g in c.gpus]
    return (len({g.uuid for g in shares}), len({a.node for a in held}),
            -(-sum(g.milli for g in shares) // 1000))


def over_node_totals(pods: list[dict[str, Any]], nodes: list[dict[str, Any]]) -> int:
    """Nodes whose bound pods' extended resources (nvidia.com/gpu, gpuslice.io/*), summed,
    exceed the node's allocatable: the baseline runs' over-allocation."""
    used: dict[tuple[str, str], float] = defaultdict(float)
    for p in pods:
        node = p["spec"].get("nodeName")
        for c in p["spec"]["containers"] if node else ():
            for k, v in ((c.get("resources") or {}).get("limits") or {}).items():
                if "/" in k:  # as the API server writes them back: 1000 is "1k"
                    used[node, k] += quantity(v, k)
    cap = {(n["metadata"]["name"], k): quantity(v, k) for n in nodes
           for k, v in n["status"]["allocatable"].items() if "/" in k}
    return len({node for (node, k), v in used.items() if v > cap.get((node, k), 0)})


def run_once(dev: DevCluster, pods: int, fractional: bool, timeout_s: float,
             extender_metrics: Any, extender_pid: int,
             window_closed: Any = None, go_profile: Path | None = None,
             go_seconds: int = 10, go_delay: float = 2.0,
             baseline_fractional: bool = False) -> dict[str, Any]:
    """One run (``fractional``: through the extender; otherwise the baseline, whole-GPU pods
    or, with ``baseline_fractional``, the same fractional pods without the extender);
    ``window_closed`` is called when the last pod is bound (before the pods are read back and
    deleted); ``go_profile``: a folder for kube-scheduler's CPU profile."""
    console = Console(stderr=True)
    if "kube-scheduler" in dev.procs:
        dev.procs.pop("kube-scheduler").stop()
    created = create_pods(dev, pods, fractional or baseline_fractional)
    console.print(f"  {pods} pods created in {created:.0f} s; starting kube-scheduler "
                  f"({'with' if fractional else 'without'} the extender)")
    # the scheduler is not running yet: it starts at 0
    before = cpu_now(dev, {"gpuslice extender": extender_pid})
    sys0 = cpu_split(extender_pid)[1]
    threads0 = thread_cpu(extender_pid)
    api0 = api_metrics(dev)
    # each pod's bind as a client sees it: its first event with a node
    binds = FirstSeen(dev, f"/api/v1/namespaces/{NS}/pods?fieldSelector=spec.nodeName%21%3D",
                      lambda _: True, metadata_only=True).start()
    dev.start_scheduler(with_extender=fractional)
    t0 = time.monotonic()
    cap = capi = None
    if go_profile is not None:
        go_profile.mkdir(parents=True, exist_ok=True)
        cap = Capture(f"https://127.0.0.1:{dev.ports['scheduler']}", insecure(),
                      go_profile / f"kube-scheduler-{'ours' if fractional else 'alone'}.pb.gz",
                      delay_s=go_delay, seconds=go_seconds).start()
        # kube-apiserver's over the same seconds (the cluster opens it with --go-profile)
        capi = Capture(dev.server, dev._ssl(),
                       go_profile / f"kube-apiserver-{'ours' if fractional else 'alone'}.pb.gz",
                       delay_s=go_delay, seconds=go_seconds).start()
    wait_until(f"{pods} pods bound", lambda: unbound(dev) == 0, timeout_s, every_s=1.0)
    elapsed = time.monotonic() - t0
    after = cpu_now(dev, {"gpuslice extender": extender_pid})
    sys1 = cpu_split(extender_pid)[1]
    threads1 = thread_cpu(extender_pid)
    api1 = api_metrics(dev)
    binding = minus(binding_buckets(api1), binding_buckets(api0))
    if window_closed is not None:
        window_closed()
    got_profile = cap.finish() if cap is not None else None
    got_api = capi.finish() if capi is not None else None
    time.sleep(0.5)  # the watch's last events
    binds.stop()
    bound_at = list(binds.seen.values())
    spent = {n: after[n] - before.get(n, 0.0) for n in after}
    metrics = dev.scheduler_metrics()
    algo = histogram(metrics, "scheduler_scheduling_algorithm_duration_seconds")
    attempt = histogram(metrics, "scheduler_scheduling_attempt_duration_seconds",
                        {"result": "scheduled"})
    res: dict[str, Any] = {
        # the burst's rate from the first bind to the last (the scheduler's start and the
        # poll that noticed the end are left out: a second or more at --quick's size)
        "pods": pods, "seconds": elapsed, "pods_per_s": burst_rate(bound_at)
        if len(bound_at) == pods else pods / elapsed, "window_pods_per_s": pods / elapsed,
        "bind_quantiles": burst_quantiles(bound_at),
        "retries": counter(metrics, "scheduler_schedule_attempts_total", "error")
        + counter(metrics, "scheduler_schedule_attempts_total", "unschedulable"),
        "algo_p50_ms": quantile(algo, 0.5) * 1e3, "algo_p99_ms": quantile(algo, 0.99) * 1e3,
        "attempt_p50_ms": quantile(attempt, 0.5) * 1e3,
        "attempt_p99_ms": quantile(attempt, 0.99) * 1e3,
        # CPU per pod bound, per process, over the timed window; and how many of the
        # machine's cores the whole cluster kept busy meanwhile
        "cpu_ms": {n: 1e3 * spent.get(n, 0.0) / pods for n in CPU_COMPONENTS},
        "cores": sum(spent.values()) / elapsed,
        "ext_sys_ms": 1e3 * (sys1 - sys0) / pods,  # of it the kernel's, for the extender
        # the Binding write as kube-apiserver timed it (its part of a bind's latency)
        "api_bind_p50_ms": quantile(binding, 0.5) * 1e3,
        "api_bind_p99_ms": quantile(binding, 0.99) * 1e3,
        # what the API server served meanwhile: requests by kind, pod watch events
        "api_requests": per_pod(api_requests(api1), api_requests(api0), pods),
        "pod_events": [(b - a) / pods for a, b in zip(pod_watch_events(api0),
                                                       pod_watch_events(api1), strict=True)],
        "ext_threads": by_thread(threads0, threads1, thread_names(extender_pid), pods),
        "go_profile": breakdown(got_profile) if got_profile is not None else None,
        "go_profile_off": cap is None, "go_profile_error": cap.error if cap else "",
        "api_profile": breakdown(got_api, APISERVER_WHERE) if got_api is not None else None,
        "api_profile_error": capi.error if capi else "",
    }
    got = list_json(dev, "pods", "-n", NS)
    res["bound"] = sum(1 for p in got if p["spec"].get("nodeName"))
    if fractional:
        nodes = list_json(dev, "nodes")
        res["over_allocation"] = len(over_allocation(got, nodes))
        res["gpus_used"], res["nodes_used"], res["gpus_needed"] = in_use(got)
        text = extender_metrics()
        def total(name: str) -> float:
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(name + " "))

        res["ext_connections"] = int(total("gpuslice_extender_connections_total"))
        res["filter_waits"] = int(total("gpuslice_extender_filter_waits_total"))
        res["filter_wait_s"] = total("gpuslice_extender_filter_wait_seconds_total")
        for verb in ("filter", "prioritize", "bind"):
            h = histogram(text, "gpuslice_extender_request_seconds", {"verb": verb})
            res[f"ext_{verb}_p50_ms"] = quantile(h, 0.5) * 1e3
            res[f"ext_{verb}_p99_ms"] = quantile(h, 0.99) * 1e3
        h = histogram(text, "gpuslice_extender_bind_write_seconds", {})
        res["ext_write_p50_ms"], res["ext_write_p99_ms"] = (quantile(h, q) * 1e3
                                                            for q in (0.5, 0.99))
    else:
        res["over_allocation"] = over_node_totals(got, list_json(dev, "nodes"))
    dev.procs.pop("kube-scheduler").stop()
    dev.kubectl("delete", "pods", "--all", "-n", NS, "--grace-period=0", "--force",
                "--wait=false", timeout_s=600)
    wait_until("pods deleted", lambda: not list_json(dev, "pods", "-n", NS), 600, every_s=2)
    return res


def dra_runs(args: argparse.Namespace, dev: DevCluster, console: Console, t_all: float,
             ) -> int:
    """The DRA pair (benchmarks/cluster_scale_dra.py) on the cluster's nodes."""
    import cluster_scale_dra as cd

    dev.apply(REPO / "deploy" / "dra" / "deviceclasses.yaml")
    dev.kubectl("create", "namespace", cd.NS)
    wait_until(f"ServiceAccount {cd.NS}/default", lambda: dev.kubectl(
        "get", "sa", "default", "-n", cd.NS, check=False).returncode == 0, 120)
    nodes = [f"kwok-{i:05d}" for i in range(args.nodes)]
    helpers = sys.modules[__name__]
    runs = []
    variants = ((False, False), (True, False), *(((True, True),) if args.gated else ()))
    for k, (ours, gated) in enumerate(variants):
        console.print(f"run {k + 1}/{len(variants)}: kube-scheduler"
                      f"{' + gpuslice dra-allocator' if ours else ' alone'}, pods with claims"
                      f"{', gated' if gated else ''}")
        paced = args.paced if args.paced is not None else 100 if args.quick else 300
        runs.append(cd.run_dra(dev, nodes, args.gpus, args.pods, ours, args.timeout, k + 1,
                               helpers, paced, args.paced_rate, gated))
    return cd.report(runs, args.nodes, args.gpus, args.pods, time.monotonic() - t_all,
                     os.cpu_count(), console, args.write, DRA_COMPONENTS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000, help="kwok nodes (default 1000)")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per node (default 8)")
    ap.add_argument("--pods", type=int, default=5000, help="pods per run (default 5000)")
    ap.add_argument("--quick", action="store_true", help="100 nodes, 500 pods")
    ap.add_argument("--path", choices=("extender", "dra"), default="extender",
                    help="extender: kube-scheduler + gpuslice extender against kube-scheduler "
                         "alone (default); dra: kube-scheduler's DRA allocation against "
                         "gpuslice dra-allocator, pods with ResourceClaims "
                         "(benchmarks/cluster_scale_dra.py)")
    ap.add_argument("--paced", type=int, default=None, metavar="N",
                    help="--path dra: after each burst, N more pods arriving one by one for "
                         "the claim allocation latency (default 300, 100 with --quick)")
    ap.add_argument("--paced-rate", type=float, default=10.0, metavar="R",
                    help="pods per second of --paced (default 10)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--profile", metavar="FILE",
                    help="sample the extender with py-spy during run 1 (collapsed stacks to "
                         "FILE) and print its top functions")
    ap.add_argument("--go-profile", type=Path, metavar="DIR",
                    help="kube-scheduler's and kube-apiserver's CPU profiles of each run "
                         "(pprof, --go-seconds long, from --go-delay into the burst) into DIR, "
                         "and where their CPU went (kube-apiserver's /debug/pprof opened "
                         "for it)")
    ap.add_argument("--go-seconds", type=int, default=None, help="length of --go-profile's "
                    "profiles (default 10 s: the 1000-node bursts last 25-60 s; 3 s with "
                    "--quick, whose bursts last 1.5-3.5 s)")
    ap.add_argument("--go-delay", type=float, default=None, help="seconds from the "
                    "scheduler's start to its profile's (default 2, 0 with --quick)")
    ap.add_argument("--baseline", choices=("whole", "fractional"), default="whole",
                    help="the scheduler-alone run's pods: whole GPUs (default), or the same "
                    "fractional pods through the gpuslice-scheduler profile without the "
                    "extender")
    ap.add_argument("--scheduler-qps", type=int, default=SCHEDULER_QPS, metavar="N",
                    help="kube-scheduler's client rate limit, burst twice that (default "
                    f"{SCHEDULER_QPS}: the scheduler alone's own Bindings not held by it; "
                    "the figures before 2026-11-28's seventh session ran with 200)")
    ap.add_argument("--nodes-to-score", type=int, default=None, metavar="PERCENT",
                    help="the gpuslice profile's percentageOfNodesToScore (default: "
                    "deploy/'s, 100; 0: kube-scheduler's adaptive share)")
    ap.add_argument("--node-lease-s", type=int, default=None, metavar="S",
                    help="kwok's node Lease duration (default: 40 s per 1000 nodes, at "
                    "least 40: the nodes' heartbeats as 1000 nodes write them, 100 a second)")
    ap.add_argument("--pod-lifecycle", action="store_true",
                    help="kwok also plays the bound pods' lifecycle (marks them Running: a "
                    "status write each, as the figures before 2026-11-28's eighth session); "
                    "by default a bound pod stays as bound, as in kube-scheduler's "
                    "scheduler_perf")
    ap.add_argument("--binds-in-flight", type=int, default=None, metavar="N",
                    help="the extender's --binds-in-flight (default: its own)")
    ap.add_argument("--write", type=Path, help="write the figures (markdown) to this file")
    ap.add_argument("--gated", action="store_true",
                    help="--path dra: a third run, its pods created with the claim "
                    "allocator's scheduling gate as the admission webhook creates them")
    args = ap.parse_args()
    # a SIGTERM (timeout, CI) unwinds like Ctrl-C, so the cluster's processes are stopped
    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    if args.quick:
        args.nodes, args.pods = 100, 500
    if args.node_lease_s is None:
        args.node_lease_s = lease_s(args.nodes)
    if args.go_seconds is None:
        args.go_seconds = 3 if args.quick else 10
    if args.go_delay is None:
        args.go_delay = 0.0 if args.quick else 2.0
    console = Console(width=220)
    bin_dir = find_bin_dir(REPO)
    t_all = time.monotonic()
    with DevCluster(bin_dir, REPO / "deploy", scheduler="none",
                    scheduler_qps=args.scheduler_qps,
                    nodes_to_score=args.nodes_to_score,
                    node_lease_s=args.node_lease_s,
                    pod_lifecycle=args.pod_lifecycle,
                    apiserver_profiling=args.go_profile is not None) as dev:
        console.print(f"control plane up in {dev.dir}")
        for f in ("namespace.yaml", "rbac.yaml"):
            dev.kubectl("apply", "--server-side", "-n", "gpuslice-system", "-f",
                        str(REPO / "deploy" / "base" / f))
        dev.kubectl("create", "namespace", NS)
        t0 = time.monotonic()
        for lo in range(0, args.nodes, 250):
            nodes = [gpu_node(f"kwok-{i:05d}", "A100-80GB", count=args.gpus)
                     for i in range(lo, min(args.nodes, lo + 250))]
            for n in nodes:
                for k in ("capacity", "allocatable"):
                    n["status"][k]["nvidia.com/gpu"] = str(args.gpus)
            dev.kubectl("create", "-f", "-", input=yaml.safe_dump_all(nodes), timeout_s=600)
        wait_until(f"{args.nodes} nodes Ready", lambda: sum(
            1 for n in list_json(dev, "nodes") if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in n["status"].get("conditions", []))) >= args.nodes, 900, every_s=3)
        console.print(f"{args.nodes} kwok nodes x {args.gpus} GPUs Ready in "
                      f"{time.monotonic() - t0:.0f} s")
        wait_until("ServiceAccount bench/default", lambda: dev.kubectl(
            "get", "sa", "default", "-n", NS, check=False).returncode == 0, 120)
        if args.path == "dra":
            return dra_runs(args, dev, console, t_all)

        key = dev.dir / "key"
        key.write_text(KEY)
        flow = [] if args.binds_in_flight is None else \
            ["--binds-in-flight", str(args.binds_in_flight)]
        ext = dev.start_extender(key, timeout_s=300, args=flow)
        assert ext.pid is not None
        ctx = ssl.create_default_context(cafile=str(dev.ca_crt))

        def ext_metrics() -> str:
            with urllib.request.urlopen(dev.extender_url + "/metrics", context=ctx,
                                        timeout=10) as r:
                return str(r.read().decode())

        idle = background_cores(dev, ext.pid)
        console.print(f"with no pod to schedule the cluster keeps {idle:.2f} cores busy")
        spy = None
        if args.profile:  # py-spy samples the extender process through run 1
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(ext.pid), "--format", "raw",
                                    "--rate", "200", "--gil", "--nonblocking", "-o",
                                    args.profile],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            console.print("run 1/2: kube-scheduler + gpuslice extender, fractional pods")
            def stop_spy() -> None:  # the profile covers the timed window only
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(60)

            ours = run_once(dev, args.pods, True, args.timeout, ext_metrics, ext.pid,
                            stop_spy, args.go_profile, args.go_seconds, args.go_delay)
            if spy is not None:
                console.print(profile_table(Path(args.profile)))
            console.print(f"run 2/2: kube-scheduler alone, {BASELINES[args.baseline]}")
            base = run_once(dev, args.pods, False, args.timeout, ext_metrics, ext.pid,
                            None, args.go_profile, args.go_seconds, args.go_delay,
                            baseline_fractional=args.baseline == "fractional")
        finally:
            ext.stop(30)
    total = time.monotonic() - t_all
    ratio = ours["pods_per_s"] / base["pods_per_s"]
    table = Table(title=f"{args.nodes} kwok nodes x {args.gpus} GPUs, {args.pods} pods per run "
                  f"({os.cpu_count()} CPUs, kube-scheduler qps {args.scheduler_qps}, node Leases "
                  f"{args.node_lease_s} s, pod lifecycle "
                  f"{'on' if args.pod_lifecycle else 'off'}, whole benchmark {total / 60:.1f} min)")
    for col in ("run", "pods/s", "bound", "failed attempts", "sched. algorithm p50 / p99 ms",
                "attempt p50 / p99 ms", "extender filter p50 / p99 ms",
                "prioritize p50 / p99 ms", "bind p50 / p99 ms", "over-allocated"):
        table.add_column(col)

    def pair(r: dict[str, Any], a: str) -> str:
        if f"{a}_p50_ms" not in r:
            return "-"
        return f"{r[f'{a}_p50_ms']:.1f} / {r[f'{a}_p99_ms']:.1f}"

    rows = [("scheduler + gpuslice (fractional)", ours),
            (f"scheduler alone ({BASELINES[args.baseline]})", base)]
    for name, r in rows:
        table.add_row(name, f"{r['pods_per_s']:.1f}", f"{r['bound']}/{r['pods']}",
                      str(r["retries"]),
                      pair(r, "algo"), pair(r, "attempt"), pair(r, "ext_filter"),
                      pair(r, "ext_prioritize"), pair(r, "ext_bind"),
                      str(r["over_allocation"]))
    console.print(table)
    cpu = Table(title="CPU per pod bound (ms, user + system, over the timed window)")
    for col in ("run", *CPU_COMPONENTS, "all", "cores busy"):
        cpu.add_column(col)
    for name, r in rows:
        cpu.add_row(name, *(f"{r['cpu_ms'][n]:.1f}" for n in CPU_COMPONENTS),
                    f"{sum(r['cpu_ms'].values()):.1f}", f"{r['cores']:.2f} of {os.cpu_count()}")
    console.print(cpu)
    console.print(f"the scheduler's calls reached the extender on {ours['ext_connections']} "
                  f"connections ({ours['pods']} pods)")
    # the lines below the tables, printed and (as sentences) written
    notes = [api_bind_line(ours, base), requests_line(ours, base), idle_line(idle, ours, base),
             window_line(ours, base), timeline_line(ours, base), packing_line(ours)]
    console.print(sys_line(ours))
    console.print(threads_line(ours))
    for line in notes:
        console.print(line)
    console.print(f"filters that waited for binds in flight: {ours['filter_waits']} of "
                  f"{ours['pods']}, {ours['filter_wait_s']:.1f} s in all")
    go_rows = go_lines(ours, base, args.go_seconds, args.go_delay)
    for line in go_rows:
        console.print(line, highlight=False)
    goal = "0.60" if args.quick else "0.50"  # issue 28's, at 100 and at 1000 nodes
    console.print(f"ratio gpuslice / scheduler alone: {ratio:.2f} (goal >= {goal}); "
                  f"over-allocation: {ours['over_allocation']} (must be 0)")
    if args.write:
        lines = ["| run | pods/s | bound | failed attempts | scheduling algorithm p50 / p99 ms "
                 "| attempt p50 / "
                 "p99 ms | extender filter p50 / p99 ms | prioritize p50 / p99 ms | bind p50 / "
                 "p99 ms | over-allocated GPUs |", "|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in rows:
            lines.append(f"| {name} | {r['pods_per_s']:.1f} | {r['bound']}/{r['pods']} | "
                         f"{r['retries']} | "
                         f"{pair(r, 'algo')} | {pair(r, 'attempt')} | {pair(r, 'ext_filter')} "
                         f"| {pair(r, 'ext_prioritize')} | {pair(r, 'ext_bind')} | "
                         f"{r['over_allocation']} |")
        lines += ["", "CPU per pod bound (ms, user + system, over the timed window):", "",
                  "| run | " + " | ".join(CPU_COMPONENTS) + " | all | cores busy |",
                  "|---" * (len(CPU_COMPONENTS) + 3) + "|"]
        for name, r in rows:
            lines.append(f"| {name} | " + " | ".join(f"{r['cpu_ms'][n]:.1f}"
                                                      for n in CPU_COMPONENTS)
                         + f" | {sum(r['cpu_ms'].values()):.1f} | {r['cores']:.2f} of "
                         f"{os.cpu_count()} |")
        cpu_line = sys_line(ours)
        lines += ["", cpu_line[0].upper() + cpu_line[1:] + "; " + threads_line(ours) + "."]
        for line in notes:
            lines += ["", line + "."]
        if go_rows:
            lines += ["", *go_rows]
        if args.profile:
            samples, prof = profile_rows(Path(args.profile))
            lines += ["", PROFILE_TITLE.format(samples) + ", top functions by own time:", "",
                      "| function (file) | own % | total % |", "|---|---|---|"]
            lines += [f"| `{f}` | {own:.1f} | {tot:.1f} |" for f, own, tot in prof]
        flags = "" if args.binds_in_flight is None else \
            f", extender --binds-in-flight {args.binds_in_flight}"
        if args.baseline != "whole":
            flags += f", --baseline {args.baseline}"
        if args.nodes_to_score is not None:
            flags += f", --nodes-to-score {args.nodes_to_score}"
        if args.node_lease_s != lease_s(args.nodes):
            flags += f", --node-lease-s {args.node_lease_s}"
        if args.pod_lifecycle:
            flags += ", --pod-lifecycle"
        if args.scheduler_qps != SCHEDULER_QPS:
            flags += f", --scheduler-qps {args.scheduler_qps}"
        block = (f"<!-- cluster_scale: {args.nodes} nodes x {args.gpus} GPUs, {args.pods} pods"
                 f"{flags} -->\n" + "\n".join(lines) + f"\n\nRatio {ratio:.2f}; whole benchmark "
                 f"{total / 60:.1f} min on {os.cpu_count()} CPUs.\n")
        args.write.parent.mkdir(parents=True, exist_ok=True)
        with args.write.open("a") as f:
            f.write("\n" + block)
        console.print(f"appended to {args.write}")
    failed = ours["over_allocation"] != 0 or ours["bound"] != ours["pods"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
