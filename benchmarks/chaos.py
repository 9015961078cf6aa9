"""A chaos soak of gpuslice on the real control plane, with an independent auditor.

The control plane of the cluster tier (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler with deploy/'s extender configuration, kwok; tools/cluster/build.sh) with kwok
GPU nodes, and gpuslice's processes as deploy/ runs them on their own service accounts
(benchmarks/chaos_parts.py): two extender replicas with leader election behind a stand-in of
their Service (the leader's label), two DRA claim allocators, a node agent per device-plugin
node and a DRA driver per DRA node, with a stand-in of the kubelet (chaos_kubelet.py). A
seeded stream creates and deletes fractional, MIG, whole-GPU and multi-GPU pods, and pods
with ResourceClaims, keeping the nodes about full (chaos_load.py), while faults are injected
at random (chaos_faults.py: the extender leader, the DRA allocator, a node agent and a DRA
driver SIGKILLed and restarted, kube-scheduler restarted, kube-apiserver frozen 10-30 s with
SIGSTOP, a node's agent restarted in the middle of a bind).

The auditor (chaos_audit.py, gpuslice/devcluster/audit*.py) reads only the API server, every
3 s: no GPU's committed shares over its capacity, no MIG instance or whole GPU held by two
pods, every bound GPU pod with an assignment that verifies and names its node, every pending
pod with a current reason, no DRA device allocated past its capacity. After the churn:
every pending pod the auditor's own fit places is bound (or it is a violation), each extender
replica's ledger (its /metrics) matches the assignments on the live pods, and once every pod
is deleted nothing is left: no allocated claim, no ledger entry, no CDI spec, checkpoint
entry or MPS daemon on the nodes.

    python benchmarks/chaos.py --minutes 10
    python benchmarks/chaos.py --minutes 2 --seed 7 --out chaos.json
    python benchmarks/chaos.py --minutes 5 --no-dra

The last line is ``faults F, pods P, violations V``; the exit status is 0 only when V is 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import ssl
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.dra.kubelet: the kubelet's DRA calls
sys.path.insert(0, str(REPO / "benchmarks"))

from chaos_audit import Auditor  # noqa: E402
from chaos_faults import Faults  # noqa: E402
from chaos_kubelet import Kubelet, end_daemons, leaks  # noqa: E402
from chaos_load import (  # noqa: E402
    Workload,
    dp_nodes,
    dra_node_object,
    dra_nodes,
    node_object,
    templates,
)
from chaos_parts import (  # noqa: E402
    SYSTEM,
    SYSTEM_NODE,
    Api,
    Components,
    LeaderService,
    start_agent,
    start_allocators,
    start_driver,
    start_extenders,
    wait_for,
)
from gpuslice.devcluster import DevCluster, find_bin_dir, free_port, kwok_node  # noqa: E402
from gpuslice.devcluster import audit as A  # noqa: E402

NS = "chaos"
KEY = "chaos-soak-assignment-key-0123456789abcdef"


@dataclass
class Soak:
    dev: DevCluster
    args: argparse.Namespace
    api: Api
    comps: Components
    service: LeaderService
    kubelet: Kubelet
    workload: Workload
    faults: Faults
    auditor: Auditor
    folder: Path
    lines: list[str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)  # pending after the churn: reason
    phases: dict[str, float] = field(default_factory=dict)

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)


def apply_deploy(dev: DevCluster, dra: bool) -> None:
    """deploy/'s namespace, RBAC (and DRA's DeviceClasses), not its workloads: the soak runs
    the components itself."""
    deploy = REPO / "deploy"
    dev.apply(deploy / "base" / "namespace.yaml")
    dev.apply(deploy / "base" / "rbac.yaml", "-n", SYSTEM)
    if dra:
        dev.apply(deploy / "dra" / "rbac.yaml", "-n", SYSTEM)
        dev.apply(deploy / "dra" / "deviceclasses.yaml")
        dev.apply(deploy / "dra-allocator" / "rbac.yaml", "-n", SYSTEM)
    dev.kubectl("create", "namespace", NS)
    for ns in (SYSTEM, NS):
        wait_for(f"ServiceAccount {ns}/default", has_default_sa(dev, ns), 120)


def has_default_sa(dev: DevCluster, ns: str) -> Callable[[], bool]:
    return lambda: dev.kubectl("get", "sa", "default", "-n", ns, check=False).returncode == 0


def setup(dev: DevCluster, args: argparse.Namespace, folder: Path, rng: random.Random,
          ) -> Soak:
    api = Api(dev.server, dev._ssl())
    apply_deploy(dev, args.dra)
    dps = dp_nodes(args.nodes)
    dras = dra_nodes(args.dra_nodes) if args.dra else {}
    objs = [kwok_node(SYSTEM_NODE, gpus=0, labels={"chaos.gpuslice.io/pool": "system"})]
    objs += [node_object(n, g, "dp") for n, g in dps.items()]
    objs += [dra_node_object(n) for n in dras]
    dev.add_nodes(objs, ready_timeout_s=180)
    key = dev.dir / "assignment.key"
    key.write_text(KEY)
    comps = Components()
    ports = [free_port(), free_port()]
    start_extenders(dev, api, comps, key, ports, folder)
    service = LeaderService(api, dev.extender_port, comps.extender_pods, dev.ca_crt)
    service.start()
    agent_kc = dev.service_account_kubeconfig(SYSTEM, "gpuslice-node-agent")
    for node, gpus in dps.items():
        start_agent(dev, comps, key, node, gpus, agent_kc, folder)
    if args.dra:
        for t in templates(NS):
            api.call("POST", f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates",
                     t)
        driver_kc = dev.service_account_kubeconfig(SYSTEM, "gpuslice-dra-driver")
        for node, (gpus, modes) in dras.items():
            root = Path(tempfile.mkdtemp(prefix="chaos-", dir="/tmp"))
            start_driver(comps, node, gpus, modes, driver_kc, folder, root)
        start_allocators(dev, comps, folder)
    wait_for("an extender leader behind the Service", lambda: bool(service.endpoints), 180)
    if args.dra:
        wait_for("every DRA node's ResourceSlices", lambda: set(dras) <= {
            s["spec"]["pool"]["name"] for s in api.items(
                "/apis/resource.k8s.io/v1/resourceslices")}, 180)
    kubelet = Kubelet(Api(dev.server, dev._ssl()), NS, comps.driver_roots, rng)
    targets = {"dp": args.dp_pods} | ({"dra": args.dra_pods} if args.dra else {})
    workload = Workload(Api(dev.server, dev._ssl()), NS, rng, targets)
    faults = Faults(dev, Api(dev.server, dev._ssl()), comps, kubelet, workload, rng, args.dra)
    auditor = Auditor(Api(dev.server, dev._ssl()), NS, KEY.encode(), args.dra)
    return Soak(dev, args, api, comps, service, kubelet, workload, faults, auditor, folder)


def progress(s: Soak, t0: float) -> str:
    el = time.monotonic() - t0
    pods = s.auditor.last.pods if s.auditor.last else []
    pend = sum(1 for p in pods if A.pending(p))
    return (f"[{int(el) // 60:2d}:{int(el) % 60:02d}] pods created {s.workload.created} "
            f"bound {len(s.auditor.bound_uids)} deleted {s.workload.deleted} | live "
            f"{len(pods)} pending {pend} | faults {len(s.faults.done)} | violations "
            f"{s.auditor.violations}")


def churn(s: Soak, minutes: float) -> None:
    """Create and delete pods, inject faults, audit, for ``minutes``."""
    s.threads = threads = [threading.Thread(target=f, daemon=True, name=n) for n, f in (
        ("auditor", s.auditor.run), ("faults", s.faults.run), ("watchdog", s.faults.watchdog))]
    s.kubelet.start()
    t0 = time.monotonic()
    s.faults.t0 = s.auditor.t0 = t0
    for t in threads:
        t.start()
    end, next_line = t0 + 60 * minutes, t0 + s.args.progress
    while time.monotonic() < end:
        s.workload.step()
        time.sleep(s.workload.rng.uniform(0.2, 0.8))
        if time.monotonic() >= next_line:
            s.say(progress(s, t0))
            next_line += s.args.progress
    s.faults.stop()
    threads[1].join(60)  # a freeze under way is thawed first
    s.dev.thaw_apiserver()
    s.phases["churn_s"] = time.monotonic() - t0
    s.say(progress(s, t0) + " -- churn stopped")


def settle(s: Soak) -> None:
    """Every component up; then, within --settle seconds, every pending pod that the
    auditor's fit places must get bound, and every other one must have its reason."""
    s.faults.restart_crashed()
    if not s.dev.alive().get("kube-scheduler"):
        s.dev.restart_scheduler(kill=True, wait=False)
    t0 = time.monotonic()
    fits: dict[str, str] = {}
    unexplained: list[A.Violation] = []
    snap = None
    while time.monotonic() - t0 < s.args.settle:
        time.sleep(3.0)
        snap = s.auditor.round()
        if snap is None:
            continue
        fits = s.auditor.fitting_pending(snap)
        unexplained = s.auditor.pending(snap, grace_s=0.0)
        if not fits and not unexplained:
            break
    if snap is not None:
        pods = {A.key_of(p): p for p in snap.pods}
        s.waiting = {k: A.reason_of(p)[:300] for k, p in pods.items() if A.pending(p)}
        for pod, where in sorted(fits.items()):
            s.auditor.report(A.Violation("pending-but-fits", f"pod {pod}", f"{where}; "
                                         f"pending with reason {A.reason_of(pods[pod])!r}"))
        for v in unexplained:
            s.auditor.report(v)
    s.phases["settle_s"] = time.monotonic() - t0


def ledgers(s: Soak) -> dict[str, tuple[dict[str, int], int]]:
    """Each extender replica's ledger from its /metrics: per node milli held, assignments."""
    ctx = ssl.create_default_context(cafile=str(s.dev.ca_crt))
    out = {}
    for pod, port in s.comps.extender_pods.items():
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=ctx,
                                        timeout=10) as r:
                text = r.read().decode()
        except OSError:
            continue
        per_node = {m.group(1): int(float(m.group(2))) for m in re.finditer(
            r'^gpuslice_extender_node_allocated_milli\{node="([^"]+)"\} (\S+)', text, re.M)}
        count = re.search(r"^gpuslice_extender_assignments (\S+)", text, re.M)
        out[pod] = (per_node, int(float(count.group(1))) if count else -1)
    return out


def api_ledger(snap: Any, key: bytes) -> tuple[dict[str, int], int]:
    """Per node the milli the live pods' verified assignments hold, and how many there are:
    what a fresh extender would rebuild from the pods."""
    inv, _ = A.inventories(snap.nodes)
    held, _ = A.held_by_pods(snap.pods, inv, key)
    per_node = {n: sum(held.milli.get(u, 0) for u in gpus) for n, gpus in inv.items()}
    count = sum(1 for p in snap.pods if A.node_of(p) and not A.finished(p)
                and A.asks_gpuslice(p) and A.check_assignment(p, key)[0] is not None)
    return per_node, count


def check_ledgers(s: Soak, rule: str, timeout_s: float = 45.0) -> None:
    """Each replica's ledger equals the API's (its watch may lag: retried until
    ``timeout_s``), else one ``rule`` violation per replica and node."""
    end = time.monotonic() + timeout_s
    diffs: list[A.Violation] = []
    while time.monotonic() < end:
        snap = s.auditor.round()
        if snap is None:
            time.sleep(2.0)
            continue
        want, count = api_ledger(snap, s.auditor.key)
        diffs = []
        for pod, (have, n) in ledgers(s).items():
            for node in sorted(set(want) | set(have)):
                if have.get(node, 0) != want.get(node, 0):
                    diffs.append(A.Violation(rule, f"{pod} node {node}",
                                             f"ledger {have.get(node, 0)} milli, the API's "
                                             f"assignments {want.get(node, 0)}"))
            if n != count:
                diffs.append(A.Violation(rule, f"{pod}", f"{n} assignments in its ledger, "
                                         f"{count} on live pods"))
        if not diffs:
            return
        time.sleep(2.0)
    for v in diffs:
        s.auditor.report(v)


def drain(s: Soak) -> None:
    """Delete every pod; the kubelet stand-in lets each go; then nothing may be left."""
    t0 = time.monotonic()
    for name in [p["metadata"]["name"] for p in s.api.pods(NS)]:
        s.workload.delete(name)
    try:
        wait_for("every pod gone", lambda: not s.api.pods(NS), s.args.settle, every_s=2.0)
    except TimeoutError:
        for p in s.api.pods(NS):
            s.auditor.report(A.Violation("drain-stuck", f"pod {A.key_of(p)}",
                                         f"not gone {s.args.settle:.0f} s after its delete"))
    if s.args.dra:
        claims = f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims"
        try:
            wait_for("every claim gone", lambda: not s.api.items(claims), 120, every_s=2.0)
        except TimeoutError:
            for c in s.api.items(claims):
                if (c.get("status") or {}).get("allocation"):
                    s.auditor.report(A.Violation("leaked-claim-allocation",
                                                 f"claim {A.key_of(c)}", "still allocated "
                                                 "with every pod gone"))
    check_ledgers(s, "leaked-ledger-entry")
    s.kubelet.stop()
    for rule, what in leaks(s.comps.driver_roots, s.comps.agent_roots):
        s.auditor.report(A.Violation(rule, what.split(":", 1)[0], what.split(": ", 1)[1]))
    s.phases["drain_s"] = time.monotonic() - t0


def summary(s: Soak, wall_s: float) -> dict[str, Any]:
    return {
        "seed": s.args.seed, "minutes": s.args.minutes, "dra": s.args.dra,
        "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        "wall_s": round(wall_s, 1), "phases_s": {k: round(v, 1) for k, v in s.phases.items()},
        "faults": [asdict(f) for f in s.faults.done], "fault_counts": s.faults.counts(),
        "pods": {"created": s.workload.created, "bound": len(s.auditor.bound_uids),
                 "deleted": s.workload.deleted, "by_kind": s.workload.by_kind,
                 "bound_by_kind": s.auditor.bound_kinds,
                 "failed_calls": s.workload.failed_calls},
        "peak": s.auditor.peak, "pending_after_churn": s.waiting,
        "violations": list(s.auditor.found.values()), "crashes": s.faults.crashes,
        "audit": {"rounds": s.auditor.rounds, "failed_rounds": s.auditor.failed_rounds},
        "kubelet": s.kubelet.counts, "kubelet_errors": s.kubelet.errors,
        "service_refused": s.service.refused,
        "starts": {n: m.starts for n, m in s.comps.procs.items()},
        "progress": s.lines,
    }


def report(s: Soak, wall_s: float) -> int:
    rec = summary(s, wall_s)
    counts = ", ".join(f"{k} {v}" for k, v in rec["fault_counts"].items())
    s.say(f"faults by kind: {counts}")
    p = rec["pods"]
    s.say(f"pods: created {p['created']}, bound {p['bound']}, deleted {p['deleted']}; "
          f"audit rounds {rec['audit']['rounds']} ({rec['audit']['failed_rounds']} with the "
          f"API server away); component crashes {len(s.faults.crashes)}; kubelet "
          f"{rec['kubelet']}; wall {wall_s / 60:.1f} min on {os.cpu_count()} CPUs")
    for c in s.faults.crashes:
        s.say(f"crash: {c['component']} exited {c['exit']} at {c['at_s']} s")
    if s.args.out:
        s.args.out.write_text(json.dumps(rec, indent=1, default=str))
    print(f"faults {len(s.faults.done)}, pods {p['created']}, violations "
          f"{s.auditor.violations}", flush=True)
    return 0 if s.auditor.violations == 0 else 1


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="churn time (default 10)")
    ap.add_argument("--seed", type=int, default=1, help="the workload's and faults' seed")
    ap.add_argument("--nodes", type=int, default=2, help="A100 device-plugin nodes of 4 GPUs "
                    "(default 2; a MIG node and an L4 node come with them)")
    ap.add_argument("--dra", action=argparse.BooleanOptionalAction, default=True,
                    help="also the DRA path: drivers, claim allocators, pods with claims "
                    "(default on)")
    ap.add_argument("--dra-nodes", type=int, default=2, help="DRA nodes (default 2)")
    ap.add_argument("--dp-pods", type=int, default=30, help="live device-plugin pods kept "
                    "(default 30: more than the nodes hold)")
    ap.add_argument("--dra-pods", type=int, default=14, help="live DRA pods kept (default 14)")
    ap.add_argument("--settle", type=float, default=150.0, help="seconds after the churn for "
                    "pending pods that fit to get bound, and for the drain (default 150)")
    ap.add_argument("--progress", type=float, default=15.0, help="seconds between progress "
                    "lines (default 15)")
    ap.add_argument("--keep", action="store_true", help="keep the cluster's folder (logs)")
    ap.add_argument("--out", type=Path, help="a JSON record of every fault and violation")
    args = ap.parse_args()
    if args.minutes <= 0 or args.nodes < 1 or args.dra_nodes < 1:
        ap.error("--minutes, --nodes and --dra-nodes must be positive")
    return args


def main() -> int:
    args = parse()

    def interrupted(*_: object) -> None:  # a SIGTERM (a timeout) unwinds like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    rng = random.Random(args.seed)
    t_all = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix="gpuslice-chaos-"))
    dev = DevCluster(find_bin_dir(REPO), REPO / "deploy", folder=folder / "cluster")
    soak: Soak | None = None
    try:
        dev.start()
        soak = setup(dev, args, folder, rng)
        soak.say(f"control plane, {len(soak.comps.procs)} gpuslice processes up in "
                 f"{time.monotonic() - t_all:.0f} s ({folder})")
        churn(soak, args.minutes)
        settle(soak)
        check_ledgers(soak, "ledger-mismatch")
        drain(soak)
        return report(soak, time.monotonic() - t_all)
    finally:
        if soak is not None:
            soak.auditor.stop()
            soak.faults.stop()
            for t in soak.threads:  # no restart by the watchdog once stopping starts
                t.join(60)
            soak.service.stop()
            soak.comps.stop()
            for root in soak.comps.driver_roots.values():
                end_daemons(root / "mps")
        dev.stop()
        if soak is not None:
            for root in soak.comps.driver_roots.values():
                shutil.rmtree(root, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
