"""How long the extender's full re-read of pods takes through the Kubernetes client: pods as a
cluster holds them (containers with env, mounts and probes, the service-account volume,
status with conditions and container statuses, managedFields), served over HTTP by the REST
stand-in of tests/kube. The client's generated models (deserialise, then back to plain dicts:
how KubeClient read before) are the baseline, measured in the same run as KubeClient's path
(the server's JSON parsed with orjson).

    python benchmarks/kube_list_speed.py [--pods 5000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the REST stand-in
from tests.kube.helpers import kube_client
from tests.kube.rest_fake import RestApiServer


def realistic_pod(i: int) -> dict[str, Any]:
    name = f"resnet-{i:05d}"
    cond = [{"type": t, "status": "True", "lastProbeTime": None,
             "lastTransitionTime": "2026-11-23T00:00:00Z"}
            for t in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady",
                      "PodScheduled")]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": "ml", "uid": f"0000-{i}",
            "labels": {"app": "resnet", "pod-template-hash": "7c9d8", "gpuslice.io/service": "r"},
            "annotations": {"gpuslice.io/gpu-model": "A100-80GB",
                            "gpuslice.io/assignment": "x" * 400},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                 "name": "resnet-7c9d8", "uid": "rs-uid", "controller": True,
                                 "blockOwnerDeletion": True}],
            "creationTimestamp": "2026-11-23T00:00:00Z",
            "managedFields": [{"manager": m, "operation": "Update", "apiVersion": "v1",
                               "time": "2026-11-23T00:00:00Z", "fieldsType": "FieldsV1",
                               "fieldsV1": {"f:metadata": {"f:labels": {".": {}}}}}
                              for m in ("kube-controller-manager", "kubelet", "extender")]},
        "spec": {
            "nodeName": f"node-{i % 500}", "schedulerName": "gpuslice-scheduler",
            "serviceAccountName": "default", "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
            "containers": [{
                "name": "server", "image": "registry.local/resnet:1.4.2",
                "ports": [{"containerPort": 8080, "protocol": "TCP", "name": "http"}],
                "env": [{"name": f"VAR_{k}", "value": str(k)} for k in range(8)],
                "resources": {"limits": {"gpuslice.io/gpu": "1", "gpuslice.io/gpu-milli": "300",
                                         "gpuslice.io/gpu-memory": "8192"},
                              "requests": {"cpu": "500m", "memory": "2Gi"}},
                "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080,
                                               "scheme": "HTTP"},
                                   "periodSeconds": 5, "timeoutSeconds": 1},
                "volumeMounts": [{"name": "kube-api-access-x", "readOnly": True,
                                  "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
                "terminationMessagePath": "/dev/termination-log",
                "imagePullPolicy": "IfNotPresent"}],
            "volumes": [{"name": "kube-api-access-x", "projected": {"sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt",
                               "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}}],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                             "effect": "NoSchedule"}]},
        "status": {
            "phase": "Running", "conditions": cond, "hostIP": "10.0.0.1", "podIP": "10.1.0.1",
            "startTime": "2026-11-23T00:00:00Z", "qosClass": "Burstable",
            "containerStatuses": [{"name": "server", "ready": True, "restartCount": 0,
                                   "image": "registry.local/resnet:1.4.2",
                                   "imageID": "sha256:" + "a" * 64,
                                   "containerID": "containerd://" + "b" * 64, "started": True,
                                   "state": {"running": {"startedAt": "2026-11-23T00:00:00Z"}}}]}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    console = Console()
    rest = RestApiServer().start()
    try:
        with console.status(f"creating {args.pods} pods"):
            for i in range(args.pods):
                rest.add_pod(realistic_pod(i))
        api = kube_client(rest, Path(tempfile.mkdtemp(prefix="kls-")))
        core = api._api  # the generated CoreV1Api KubeClient holds

        def models() -> int:
            return len([api._api_client.sanitize_for_serialization(p)
                        for p in core.list_pod_for_all_namespaces(_request_timeout=60).items])

        def kubeclient() -> int:
            return len(api.list_pods())

        best: dict[str, float] = {}
        for r in range(args.repeat):
            for label, fn in (("models (baseline)", models), ("KubeClient", kubeclient)):
                with console.status(f"round {r + 1}/{args.repeat}: {label}"):
                    t0 = time.perf_counter()
                    assert fn() == args.pods
                    best[label] = min(best.get(label, 1e9), time.perf_counter() - t0)
    finally:
        rest.stop()
    table = Table(title=f"list {args.pods} pods over HTTP (best of {args.repeat})")
    table.add_column("path")
    table.add_column("seconds", justify="right")
    table.add_column("vs baseline", justify="right")
    base = best["models (baseline)"]
    for label, t in best.items():
        table.add_row(label, f"{t:.2f}", f"{base / t:.1f}x faster" if t < base else "1.0x")
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
