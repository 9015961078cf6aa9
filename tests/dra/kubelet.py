"""The kubelet's side of DRA, written from its behaviour (kubernetes/kubernetes
pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go and dra_plugin.go, as summarised in
shared/reference/dra.md section 1-2): the plugin watcher finds ``<driver>-reg.sock``, calls
GetInfo, checks the type, picks the first of the plugin's ``supported_versions`` that it
supports (an empty list is an error), tells the plugin with NotifyRegistrationStatus, then
calls the DRA service at the endpoint in that version. A claim missing from a prepare answer
is an error; an unprepare answer must have an entry for every claim."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gpuslice.adapters.kubelet import dra_health_v1alpha1_pb2 as hpb
from gpuslice.adapters.kubelet import dra_health_v1alpha1_pb2_grpc as hpbg
from gpuslice.adapters.kubelet import dra_v1_pb2 as v1
from gpuslice.adapters.kubelet import dra_v1_pb2_grpc as v1g
from gpuslice.adapters.kubelet import dra_v1beta1_pb2 as v1beta1
from gpuslice.adapters.kubelet import dra_v1beta1_pb2_grpc as v1beta1g
from gpuslice.adapters.kubelet import pluginregistration_v1_pb2 as rpb
from gpuslice.adapters.kubelet import pluginregistration_v1_pb2_grpc as rpbg

KUBELET_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")  # what a 1.35 kubelet serves
TIMEOUT_S = 45.0  # the kubelet's default per-call timeout


class KubeletRefused(Exception):
    pass


@dataclass
class Registered:
    name: str
    endpoint: str
    version: str
    health: bool


def register(reg_socket: Path) -> Registered:
    """What the kubelet's plugin manager does with a new registration socket."""
    with grpc.insecure_channel(f"unix://{reg_socket}") as ch:
        stub = rpbg.RegistrationStub(ch)
        info = stub.GetInfo(rpb.InfoRequest(), timeout=TIMEOUT_S)
        error = ""
        if info.type != "DRAPlugin":
            error = f"unexpected plugin type {info.type!r}"
        versions = list(info.supported_versions)
        chosen = next((v for v in versions if v in KUBELET_VERSIONS), "")
        if not error and not chosen:
            error = f"none of the versions {versions} is supported"
        if not error and not Path(info.endpoint).is_absolute():
            error = f"endpoint {info.endpoint!r} is not an absolute path"
        stub.NotifyRegistrationStatus(rpb.RegistrationStatus(
            plugin_registered=not error, error=error), timeout=TIMEOUT_S)
        if error:
            raise KubeletRefused(error)
        return Registered(info.name, info.endpoint, chosen,
                          "v1alpha1.DRAResourceHealth" in versions)


class DraClient:
    """NodePrepareResources / NodeUnprepareResources as the kubelet calls them."""

    def __init__(self, reg: Registered) -> None:
        self.reg = reg
        self.channel = grpc.insecure_channel(f"unix://{reg.endpoint}")
        v1beta = reg.version.startswith("v1beta1")
        self.pb: Any = v1beta1 if v1beta else v1
        self.stub: Any = (v1beta1g.DRAPluginStub if v1beta else v1g.DRAPluginStub)(self.channel)

    def close(self) -> None:
        self.channel.close()

    def _claims(self, claims: list[tuple[str, str, str]]) -> list[Any]:
        return [self.pb.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims]

    def prepare(self, claims: list[tuple[str, str, str]]) -> dict[str, Any]:
        """UID -> the claim's NodePrepareResourceResponse; a missing claim raises, as the
        kubelet treats it as an error."""
        resp = self.stub.NodePrepareResources(self.pb.NodePrepareResourcesRequest(
            claims=self._claims(claims)), timeout=TIMEOUT_S)
        out = {uid: resp.claims[uid] for uid in resp.claims}
        missing = [uid for _, uid, _ in claims if uid not in out]
        if missing:
            raise AssertionError(f"NodePrepareResources left out claims {missing}")
        return out

    def unprepare(self, claims: list[tuple[str, str, str]]) -> dict[str, str]:
        resp = self.stub.NodeUnprepareResources(self.pb.NodeUnprepareResourcesRequest(
            claims=self._claims(claims)), timeout=TIMEOUT_S)
        out = {uid: resp.claims[uid].error for uid in resp.claims}
        missing = [uid for _, uid, _ in claims if uid not in out]
        if missing:
            raise AssertionError(f"NodeUnprepareResources left out claims {missing}")
        return out

    def health_stream(self) -> Any:
        stub = hpbg.DRAResourceHealthStub(self.channel)
        return stub.NodeWatchResources(hpb.NodeWatchResourcesRequest())
