"""``kubectl gpuslice status``: per node and GPU, what is allocated to which pod, and what is free;
``kubectl gpuslice top``: what each pod uses of its share, as the node agents measure it.

Installed as the console script ``kubectl-gpuslice``, so kubectl finds it as a plugin. It reads
nodes (the node agents' GPU inventory) and pods (the signed assignments) from the API server
(``--kubeconfig``, else the default kubeconfig) or from a ``--fake-cluster`` YAML file, and
counts only assignments that verify when ``--key-file`` is given.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.table import Table

from gpuslice._version import VersionAction
from gpuslice.adapters.kube.annotation import AnnotationError, decode
from gpuslice.adapters.kube.fake import KubePort, load_fake_cluster
from gpuslice.adapters.kube.objects import node_inventory
from gpuslice.core.assignment import ANNOTATION, verify
from gpuslice.core.errors import GpusliceError


def _api(args: argparse.Namespace) -> KubePort:
    if args.fake_cluster is not None:
        return load_fake_cluster(Path(args.fake_cluster))
    from gpuslice.adapters.kube.client import KubeClient

    return KubeClient(args.kubeconfig, args.context)  # $KUBECONFIG or ~/.kube/config, as kubectl


def status(api: KubePort, key: bytes | None, console: Console, output: str = "table") -> int:
    by_gpu: dict[str, list[tuple[str, int, int, str]]] = defaultdict(list)
    unverified = 0
    for p in api.list_pods():
        text = ((p.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)
        if not text:
            continue
        try:
            a = decode(text)
        except AnnotationError:
            unverified += 1
            continue
        if key is not None and not verify(a, key):
            unverified += 1
            continue
        for c in a.containers:
            for share in c.gpus:
                where = f" in {share.mig_profile}@{share.mig_start}" if share.mig_profile \
                    else ""
                by_gpu[share.uuid].append((f"{a.namespace}/{a.pod}", share.milli,
                                           share.memory_mib, c.mode.value + where))
    rows = []
    for n in sorted(api.list_nodes(), key=lambda n: n["metadata"]["name"]):
        for g in node_inventory(n):
            held = by_gpu.get(g.uuid, [])
            milli = sum(h[1] for h in held)
            mem = sum(h[2] for h in held)
            rows.append({
                "node": n["metadata"]["name"], "index": g.index, "uuid": g.uuid,
                "model": g.model,
                "mig": [f"{m.profile}@{m.start}" for m in g.mig] if g.mig_enabled else None,
                "used_milli": milli, "free_milli": 1000 - milli,
                "free_mib": g.memory_mib - mem if g.memory_mib else None,
                "pods": [{"pod": pod, "milli": m, "memory_mib": mib, "mode": mode}
                         for pod, m, mib, mode in held]})
    if output == "json":
        sys.stdout.write(json.dumps({"gpus": rows, "unverified_assignments": unverified},
                                    indent=1) + "\n")
        return 0
    table = Table(title="gpuslice: GPU allocation")
    for col in ("node", "GPU", "model", "used milli", "free milli", "free MiB", "pods"):
        table.add_column(col)
    for r in rows:
        pods = ", ".join(f"{p['pod']} ({p['milli']} {p['mode']})" for p in r["pods"]) or "-"
        model = f"{r['model']} (MIG: {', '.join(r['mig'])})" if r["mig"] is not None \
            else r["model"]
        table.add_row(r["node"], f"{r['index']} {r['uuid']}", model, str(r["used_milli"]),
                      str(r["free_milli"]), "-" if r["free_mib"] is None else str(r["free_mib"]),
                      pods)
    console.print(table)
    if unverified:
        console.print(f"{unverified} pod(s) carry an assignment that does not verify "
                      "(hand-written or another key); not counted", highlight=False)
    return 0


# the pods that measure usage: the node agents (device-plugin nodes) and the DRA drivers
AGENT_SELECTOR = "app.kubernetes.io/name=gpuslice-node-agent"
DRIVER_SELECTOR = "app=gpuslice-dra-driver"
USE_METRICS = {
    "gpuslice_pod_gpu_memory_used_bytes": "used_mib",
    "gpuslice_pod_gpu_memory_cap_bytes": "cap_mib",
    "gpuslice_pod_gpu_sm_utilization_ratio": "sm_pct",
    "gpuslice_pod_gpu_sm_share_ratio": "share_pct",
    "gpuslice_pod_gpu_processes": "processes",
}


def usage_rows(texts: dict[str, str]) -> list[dict[str, object]]:
    """Per node, GPU, pod and container, what the node agents measured (their metrics'
    text, agent pod -> exposition): memory used and its cap in MiB, SMs busy and the share
    of SMs in percent, CUDA processes; and, per GPU, processes that belong to no pod."""
    from prometheus_client.parser import text_string_to_metric_families

    rows: dict[tuple[str, ...], dict[str, object]] = {}
    for text in texts.values():
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                field = USE_METRICS.get(sample.name)
                lab = sample.labels
                if field is not None:
                    key = (lab.get("node", ""), lab.get("gpu", ""), lab.get("namespace", ""),
                           lab.get("pod", ""), lab.get("container", ""))
                    row = rows.setdefault(key, {
                        "node": key[0], "gpu": key[1], "pod": f"{key[2]}/{key[3]}",
                        "container": key[4], "service": lab.get("service", "")})
                    scale = 100.0 if field.endswith("_pct") else \
                        1 / 2**20 if field.endswith("_mib") else 1.0
                    row[field] = round(sample.value * scale, 1)
                elif sample.name == "gpuslice_gpu_unattributed_processes" and sample.value:
                    key = (lab.get("node", ""), lab.get("gpu", ""), "", "(no pod)", "")
                    rows[key] = {"node": key[0], "gpu": key[1], "pod": "(no pod)",
                                 "container": "", "service": "",
                                 "processes": int(sample.value)}
    return [rows[k] for k in sorted(rows)]


class AgentReader(Protocol):
    """What ``top`` needs of the API: the agents' pods, and a GET through the pod proxy."""

    def list_namespaced_pods(self, namespace: str, label_selector: str) -> Any: ...
    def pod_proxy_get(self, namespace: str, name: str, port: int, path: str) -> str: ...


def _running(api: AgentReader, namespace: str, selector: str) -> list[dict[str, Any]]:
    listed = api.list_namespaced_pods(namespace, selector)
    return [p for p in (listed.get("items") or [])
            if (p.get("status") or {}).get("phase") == "Running"]


def top(api: AgentReader, namespace: str, port: int, console: Console,
        output: str = "table", dra_port: int = 9403) -> int:
    """``kubectl gpuslice top``: the usage metrics of the node agents (on ``port``) and DRA
    drivers (on ``dra_port``), read through the API server's proxy to each of their pods
    (``pods/proxy`` get in their namespace)."""
    agents = [(p, port) for p in _running(api, namespace, AGENT_SELECTOR)]
    agents += [(p, dra_port) for p in _running(api, namespace, DRIVER_SELECTOR)]
    if not agents:
        raise GpusliceError(f"no running node agent ({AGENT_SELECTOR}) or DRA driver "
                            f"({DRIVER_SELECTOR}) pod in namespace {namespace}: is gpuslice "
                            "installed there?")
    texts = {}
    failed = []
    for a, at in agents:
        name = a["metadata"]["name"]
        try:
            texts[name] = api.pod_proxy_get(namespace, name, at, "metrics")
        except GpusliceError as exc:
            failed.append(f"{name}: {exc}")
    rows = usage_rows(texts)
    if output == "json":
        sys.stdout.write(json.dumps({"usage": rows, "unreachable_agents": failed},
                                    indent=1) + "\n")
        return 0
    table = Table(title="gpuslice: GPU use per pod (measured by the node agents)")
    for col in ("node", "GPU", "pod", "container", "memory MiB (used / share)",
                "SMs % (busy / share)", "processes"):
        table.add_column(col)
    for r in rows:
        mem = f"{_num(r.get('used_mib'))} / {_num(r.get('cap_mib'))}"
        sms = f"{_num(r.get('sm_pct'))} / {_num(r.get('share_pct'))}"
        table.add_row(str(r["node"]), str(r["gpu"]), str(r["pod"]), str(r["container"]),
                      mem, sms, _num(r.get("processes")))
    console.print(table)
    for f in failed:
        console.print(f"not read: {f}", markup=False, highlight=False)
    return 0


def _num(v: object) -> str:
    if v is None:
        return "-"
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kubectl gpuslice", description="gpuslice's view of a cluster: per node and GPU, "
        "what is allocated to which pod and what is free, from the node agents' GPU inventory "
        "and the signed assignments on the pods. Exit codes: 0 ok, 2 bad input.")
    ap.add_argument("--version", action=VersionAction)
    sub = ap.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="per node and GPU: allocations and free capacity",
                        description="Per node and GPU: model (and MIG instances), the milli "
                        "and memory held, by which pods, and what is free.")
    src = st.add_mutually_exclusive_group()
    src.add_argument("--kubeconfig",
                     help="kubeconfig file (default $KUBECONFIG or ~/.kube/config, as kubectl)")
    src.add_argument("--fake-cluster", help="YAML with 'nodes' and 'pods' (for trying it out)")
    st.add_argument("--context", help="kubeconfig context")
    st.add_argument("--key-file", type=Path,
                    help="count only assignments signed with this key")
    st.add_argument("-o", "--output", choices=("table", "json"), default="table",
                    help="table (default) or json: one JSON document on stdout")
    tp = sub.add_parser("top", help="per node, GPU and pod: GPU memory and SMs used against "
                        "the share", description="What each pod uses of its GPU share, as "
                        "the node agents and DRA drivers measure it (NVML's processes, "
                        "mapped to pods): memory used and the share's, SMs busy and the "
                        "share's, CUDA processes; read from their metrics through the API "
                        "server (you need pods/proxy get in their namespace).")
    tp.add_argument("--kubeconfig",
                    help="kubeconfig file (default $KUBECONFIG or ~/.kube/config, as kubectl)")
    tp.add_argument("--context", help="kubeconfig context")
    tp.add_argument("--namespace", default="gpuslice-system",
                    help="the node agents' namespace (default gpuslice-system)")
    tp.add_argument("--port", type=int, default=9402,
                    help="the node agents' metrics port (default 9402)")
    tp.add_argument("--dra-port", type=int, default=9403,
                    help="the DRA drivers' metrics port (default 9403)")
    tp.add_argument("-o", "--output", choices=("table", "json"), default="table",
                    help="table (default) or json: one JSON document on stdout")
    tp.set_defaults(fake_cluster=None)
    err = Console(stderr=True)
    try:
        args = ap.parse_args(argv)
        console = Console()
        if not console.is_terminal:  # a pipe or a file: whole lines, not 80 columns
            console = Console(width=1000)
        if args.command == "top":
            from gpuslice.adapters.kube.client import KubeClient

            return top(KubeClient(args.kubeconfig, args.context), args.namespace, args.port,
                       console, args.output, args.dra_port)
        key = args.key_file.read_bytes().strip() if args.key_file else None
        return status(_api(args), key, console, args.output)
    except (GpusliceError, OSError) as exc:
        err.print(f"kubectl-gpuslice: error: {exc}", markup=False, highlight=False,
                  soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
