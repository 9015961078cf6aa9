"""The kubelet's PodResources API (v1, gRPC on a unix socket): which pods the kubelet has given
devices of a resource to. The kubelet records a container's devices once Allocate has returned,
and keeps them across its restarts (its checkpoint), so this tells a restarted node agent which
assignments were executed already, whatever the pods' phase (a pod pulling its image is still
Pending). The socket is recreated when the kubelet restarts: dial it anew each time."""

from __future__ import annotations

from pathlib import Path

import grpc

from gpuslice.adapters.kubelet import podresources_pb2 as pb
from gpuslice.adapters.kubelet import podresources_pb2_grpc as pbg
from gpuslice.core.errors import GpusliceError

SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")


def pods_holding(resource: str, socket: Path = SOCKET,
                 timeout_s: float = 2.0) -> dict[tuple[str, str], list[str]]:
    """(namespace, pod) -> the device IDs of ``resource`` its containers hold. Raises
    :class:`GpusliceError` (naming the socket) when the kubelet does not answer."""
    if not socket.exists():
        raise GpusliceError(f"no kubelet PodResources socket at {socket}")
    try:
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            stub = pbg.PodResourcesListerStub(channel)  # type: ignore[no-untyped-call]
            resp = stub.List(pb.ListPodResourcesRequest(), timeout=timeout_s)
    except grpc.RpcError as exc:
        raise GpusliceError(f"the kubelet's PodResources API at {socket} did not answer: "
                            f"{exc.code().name}") from None
    out: dict[tuple[str, str], list[str]] = {}
    for p in resp.pod_resources:
        ids = [i for c in p.containers for d in c.devices if d.resource_name == resource
               for i in d.device_ids]
        if ids:
            out[(p.namespace, p.name)] = ids
    return out
