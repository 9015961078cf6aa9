"""Capability weights for production data planes: Istio DestinationRule + VirtualService, and
Envoy ClusterLoadAssignment (EDS) endpoint weights, generated from the planner's plan or a
router config, so a mesh applies the same weights as ``weighted-round-robin``.

Istio: replicas are grouped into subsets by GPU model (pod label ``gpuslice.io/gpu-model``; one
subset per replica by ``statefulset.kubernetes.io/pod-name`` when the plan names no GPU), the
VirtualService splits traffic over the subsets in proportion to their summed capability
(integer percentages summing to 100) and each subset balances by least request. Envoy: one
endpoint per replica with ``load_balancing_weight`` proportional to capability (largest 128).
Output is JSON, which ``kubectl apply -f`` and Envoy both read.
"""

from __future__ import annotations

import re
from typing import Any

from gpuslice.adapters.http.upstream import host_port
from gpuslice.core.errors import ValidationError
from gpuslice.core.routing import integer_weights, scaled_weights
from gpuslice.core.routing_config import RouterConfig, ServiceSpec

GPU_LABEL = "gpuslice.io/gpu-model"
POD_LABEL = "statefulset.kubernetes.io/pod-name"


def _dns(text: str) -> str:
    out = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return out[:63] or "x"


def istio(config: RouterConfig, namespace: str = "default") -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    for svc in config.services:
        items.extend(istio_service(svc, namespace))
    return {"apiVersion": "v1", "kind": "List", "items": items}


def istio_service(svc: ServiceSpec, namespace: str) -> list[dict[str, Any]]:
    if not svc.replicas:
        raise ValidationError(f"services[{svc.name}].replicas", "at least one replica", [])
    host = svc.host or f"{svc.name}.{namespace}.svc.cluster.local"
    groups: dict[str, tuple[dict[str, str], float]] = {}
    by_gpu = all("gpu" in r.labels for r in svc.replicas)
    for r in svc.replicas:
        if by_gpu:
            key, labels = _dns(r.labels["gpu"]), {GPU_LABEL: r.labels["gpu"]}
        else:
            key, labels = _dns(r.name), {POD_LABEL: r.name}
        prev = groups.get(key)
        groups[key] = (labels, r.weight + (prev[1] if prev else 0.0))
    names = list(groups)
    weights = integer_weights([groups[k][1] for k in names], 100, 1) if len(names) <= 100 \
        else integer_weights([groups[k][1] for k in names], len(names), 1)
    meta = {"name": _dns(svc.name), "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "gpuslice"}}
    dr = {
        "apiVersion": "networking.istio.io/v1", "kind": "DestinationRule", "metadata": meta,
        "spec": {
            "host": host,
            "trafficPolicy": {"loadBalancer": {"simple": "LEAST_REQUEST"}},
            "subsets": [{"name": k, "labels": groups[k][0]} for k in names],
        },
    }
    vs = {
        "apiVersion": "networking.istio.io/v1", "kind": "VirtualService", "metadata": meta,
        "spec": {
            "hosts": [host],
            "http": [{"route": [
                {"destination": {"host": host, "subset": k, "port": {"number": svc.port}},
                 "weight": w} for k, w in zip(names, weights, strict=True)]}],
        },
    }
    return [dr, vs]


def envoy(config: RouterConfig) -> dict[str, Any]:
    """One ``ClusterLoadAssignment`` per service (an EDS response body)."""
    out = []
    for svc in config.services:
        eps = []
        weights = scaled_weights([r.weight for r in svc.replicas])
        for r, w in zip(svc.replicas, weights, strict=True):
            if r.url is None:
                raise ValidationError(f"services[{svc.name}].replicas[{r.name}].url",
                                      "an http:// URL (Envoy endpoints need an address)", None)
            host, port = _host_port(r.url)
            eps.append({
                "endpoint": {"address": {"socket_address": {"address": host, "port_value": port}},
                             "hostname": r.name},
                "load_balancing_weight": w,
                "metadata": {"filter_metadata": {"gpuslice": dict(r.labels)}},
            })
        out.append({
            "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "cluster_name": svc.name,
            "endpoints": [{"lb_endpoints": eps}],
        })
    return {"version_info": "gpuslice", "resources": out}


def _host_port(url: str) -> tuple[str, int]:
    _, host, port, _ = host_port(url)
    return host, port
