"""Replicas from Kubernetes EndpointSlices (``discovery.k8s.io/v1``), read over the API
server's HTTP API: in cluster with the pod's service-account token, from a kubeconfig, or
against any URL (tests, a ``kubectl proxy``). Ready endpoints become replicas; a replica's
weight comes from the plan (matched by pod name) when one is given, else 1 (SED learns the
rest online).

A pod the reconfiguration controller is taking away carries the label (and annotation)
``gpuslice.io/draining=true``: each reload also lists the Service namespace's pods with that
label (one selected list, usually empty), and an endpoint whose ``targetRef`` is such a pod is
a draining replica (no new request; those in flight finish), as a terminating endpoint that
still serves is."""

from __future__ import annotations

import asyncio
import os
import re
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from gpuslice.adapters.kube.objects import DRAINING_LABEL
from gpuslice.core.errors import ValidationError
from gpuslice.core.routing_config import ReplicaSpec

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True, slots=True)
class SliceSource:
    namespace: str
    service: str
    port_name: str | None = None
    api: str | None = None  # None: in cluster

    @classmethod
    def parse(cls, text: str, api: str | None = None, port_name: str | None = None
              ) -> SliceSource:
        ns, sep, svc = text.partition("/")
        if not sep or not ns or not svc:
            raise ValidationError("--endpointslices", "NAMESPACE/SERVICE", text)
        return cls(ns, svc, port_name, api)


def draining_pods(doc: object) -> frozenset[str]:
    """The names of the pods of a PodList marked draining (label or annotation
    ``gpuslice.io/draining: "true"``)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
        raise ValidationError("PodList", "an object with an items list", type(doc))
    out = set()
    for item in doc["items"]:
        meta = item.get("metadata") if isinstance(item, dict) else None
        if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
            continue
        marks = [m.get(DRAINING_LABEL) for m in (meta.get("labels"), meta.get("annotations"))
                 if isinstance(m, dict)]
        if "true" in marks:
            out.add(meta["name"])
    return frozenset(out)


def replicas_from_slices(doc: object, port_name: str | None = None,
                         weights: Mapping[str, ReplicaSpec] | None = None,
                         draining: frozenset[str] = frozenset()) -> tuple[ReplicaSpec, ...]:
    """An EndpointSliceList -> replicas: ready endpoints, one per address, and terminating
    endpoints that still serve as draining replicas (in-flight requests finish there); an
    endpoint whose pod is in ``draining`` (:func:`draining_pods`) is a draining replica too."""
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
        raise ValidationError("EndpointSliceList", "an object with an items list", type(doc))
    out: dict[str, ReplicaSpec] = {}
    for item in doc["items"]:
        if not isinstance(item, dict):
            continue
        ports = [p for p in _items(item.get("ports")) if isinstance(p, dict)]
        if port_name is not None:
            ports = [p for p in ports if p.get("name") == port_name]
        port = ports[0].get("port") if ports else None
        # an EndpointSlice port the API server would refuse (discovery/v1 validation) is
        # skipped, as are the endpoints below whose fields are not of their types
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            continue
        for ep in _items(item.get("endpoints")):
            if not isinstance(ep, dict):
                continue
            cond, ref = ep.get("conditions") or {}, ep.get("targetRef") or {}
            if not isinstance(cond, dict) or not isinstance(ref, dict):
                continue
            terminating = cond.get("terminating") is True
            if terminating and cond.get("serving") is not True:
                continue
            if not terminating and cond.get("ready") is False:
                continue
            ref_name = ref.get("name")
            marked = isinstance(ref_name, str) and ref_name in draining
            node = ep.get("nodeName")
            labels = {"node": node} if isinstance(node, str) and node else {}
            for addr in _items(ep.get("addresses")):
                if not isinstance(addr, str) or not _ADDRESS.match(addr):
                    continue
                host = f"[{addr}]" if ":" in addr else addr
                pod = ref_name if isinstance(ref_name, str) and ref_name else addr
                name = pod if pod not in out else f"{pod}-{addr}"
                known = _match(pod, weights or {})
                if known is not None:
                    out[name] = ReplicaSpec(name, f"http://{host}:{port}", known.weight,
                                            known.concurrency, known.service_time_s,
                                            {**known.labels, **labels}, terminating or marked)
                else:
                    out[name] = ReplicaSpec(name, f"http://{host}:{port}", labels=labels,
                                            draining=terminating or marked)
    return tuple(out.values())


# an endpoint address: IPv4, IPv6 or (addressType FQDN) a DNS name
_ADDRESS = re.compile(r"^([0-9A-Fa-f:.]+|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)$")


def _items(value: object) -> list[object]:
    """A list field of the EndpointSlice, or nothing when it is absent or not a list."""
    return value if isinstance(value, list) else []


def _match(pod: str, weights: Mapping[str, ReplicaSpec]) -> ReplicaSpec | None:
    """The plan's replica for a pod: its exact name, or the Deployment name it starts with."""
    if pod in weights:
        return weights[pod]
    best = None
    for name, spec in weights.items():
        if pod.startswith(name + "-") and (best is None or len(name) > len(best[0])):
            best = (name, spec)
    return None if best is None else best[1]


Fetch = Callable[[aiohttp.ClientSession], Awaitable[object]]


def slice_fetcher(src: SliceSource, kubeconfig: str | None) -> Fetch:
    """How the router reads ``src``'s EndpointSlices: from ``--kube-api URL`` (no
    credentials, as ``kubectl proxy`` serves), or from the API server that the pod's service
    account (in a pod, without ``--kubeconfig``) or the kubeconfig names, as every other
    component finds it (``adapters/kube/client.KubeClient``, in a thread: it blocks)."""
    return fetchers(src, kubeconfig)[0]


def fetchers(src: SliceSource, kubeconfig: str | None) -> tuple[Fetch, Fetch]:
    """(EndpointSlices, the PodList of the draining pods) of ``src``, read as
    :func:`slice_fetcher` says."""
    if src.api is not None or (kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST")):
        return (lambda session: fetch_slices(session, src),
                lambda session: fetch_draining(session, src))
    from gpuslice.adapters.kube.client import KubeClient

    kube = KubeClient(kubeconfig, timeout_s=10.0)

    async def slices(_: aiohttp.ClientSession) -> object:
        return await asyncio.get_running_loop().run_in_executor(
            None, kube.list_endpoint_slices, src.namespace, src.service)

    async def draining(_: aiohttp.ClientSession) -> object:
        return await asyncio.get_running_loop().run_in_executor(
            None, kube.list_namespaced_pods, src.namespace, f"{DRAINING_LABEL}=true")

    return slices, draining


async def fetch_slices(session: aiohttp.ClientSession, src: SliceSource) -> object:
    path = (f"/apis/discovery.k8s.io/v1/namespaces/{src.namespace}/endpointslices"
            f"?labelSelector=kubernetes.io/service-name%3D{src.service}")
    return await _get(session, src, path, "EndpointSlice list")


async def fetch_draining(session: aiohttp.ClientSession, src: SliceSource) -> object:
    """The PodList of ``src``'s namespace labelled ``gpuslice.io/draining=true``."""
    path = (f"/api/v1/namespaces/{src.namespace}/pods"
            f"?labelSelector={DRAINING_LABEL.replace('/', '%2F')}%3Dtrue")
    return await _get(session, src, path, "draining pod list")


async def _get(session: aiohttp.ClientSession, src: SliceSource, path: str,
               what: str) -> object:
    headers = {"Accept": "application/json"}
    ssl_ctx: ssl.SSLContext | bool = True
    if src.api is None:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValidationError("--endpointslices", "running in a cluster "
                                  "(KUBERNETES_SERVICE_HOST) or --kubeconfig FILE", None)
        base = f"https://{host}:{port}"
        headers["Authorization"] = "Bearer " + (SA_DIR / "token").read_text().strip()
        ssl_ctx = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))
    else:
        base = src.api.rstrip("/")
    async with session.get(base + path, headers=headers, ssl=ssl_ctx,
                           timeout=aiohttp.ClientTimeout(total=10)) as resp:
        if resp.status != 200:
            text = (await resp.text())[:200]
            raise ValidationError(what, "HTTP 200 from the API server",
                                  f"{resp.status}: {text}")
        try:
            return await resp.json(content_type=None)
        except ValueError as exc:  # json's JSONDecodeError, a body that is not UTF-8
            raise ValidationError(what, "a JSON answer from the API server",
                                  str(exc)[:200]) from None
