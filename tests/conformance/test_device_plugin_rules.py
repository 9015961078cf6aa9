"""The device plugin against rules of the kubelet's device manager and the device plugin API.

Each test names the upstream file and function whose rule it checks. Transport: gRPC over
unix sockets, the kubelet side in ``tests.conformance.kubelet``."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from gpuslice.adapters.kube.annotation import decode
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.kubelet import deviceplugin_pb2 as pb
from gpuslice.adapters.nvml.port import FakeNvml
from gpuslice.core.assignment import ANNOTATION
from gpuslice.core.podrequest import ContainerKind
from gpuslice.core.resourcenames import extended_resource_name_problems, qualified_name_problems
from gpuslice.services.device_plugin import (
    DevicePlugin,
    PluginConfig,
    PluginServer,
    device_list_strategy,
    plugin_configs,
    wait_for,
)
from tests.conformance.helpers import (
    KEY,
    container,
    extender,
    gpus,
    make_pod,
    node_rig,
    schedule,
)
from tests.conformance.kubelet import CheckingKubelet


def test_two_gpu_containers_are_each_allocated() -> None:
    """manager.go allocateContainerResources: Allocate once per container, one
    ContainerAllocateRequest each; the pod's assignment is split per container."""
    api = FakeApiServer()
    with node_rig(api, "n1", gpus("n1", 2)) as rig:
        st = extender(api)
        pod = schedule(api, st, make_pod("two", [container("a", 1, 300),
                                                 container("b", 1, 200)]), "n1")
        rig.dm.admit(pod)
        ra, rb = rig.dm.responses[("ml/two", "a")], rig.dm.responses[("ml/two", "b")]
        assert ra.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
        assert rb.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"
        assert ra.envs["NVIDIA_VISIBLE_DEVICES"] == rb.envs["NVIDIA_VISIBLE_DEVICES"]
        assert (ra.envs["GPUSLICE_CONTAINER"], rb.envs["GPUSLICE_CONTAINER"]) == ("a", "b")
        a = decode(api.get_pod("ml", "two")["metadata"]["annotations"][ANNOTATION])
        assert sum(m for m, _ in a.held().values()) == 500  # both run at once


def test_init_container_devices_are_reused_by_the_app_container() -> None:
    """manager.go Allocate / devicesToAllocate: a regular init container's devices go to
    devicesToReuse and the app container gets them first; the plugin must accept them."""
    api = FakeApiServer()
    with node_rig(api, "n1", gpus("n1", 2)) as rig:
        st = extender(api)
        pod = schedule(api, st, make_pod("warm", [container("main", 1, 300)],
                                         init=[container("fetch", 1, 1000)]), "n1")
        rig.dm.admit(pod)
        init_ids = rig.dm.devices_of[("ml/warm", "fetch")]
        assert rig.dm.devices_of[("ml/warm", "main")] == init_ids  # reused, and accepted
        assert rig.dm.responses[("ml/warm", "main")].envs[
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
        a = decode(api.get_pod("ml", "warm")["metadata"]["annotations"][ANNOTATION])
        assert [c.kind for c in a.containers] == [ContainerKind.INIT, ContainerKind.APP]
        assert list(a.held().values()) == [(1000, 81920)]  # max(init, app), not the sum


def test_whole_gpu_init_and_sidecar_reuse_follow_the_kubelet() -> None:
    """manager.go Allocate: a sidecar's (restartable init container's) devices are not
    reused; a regular init container's are, in whatever order the kubelet picks them."""
    api = FakeApiServer()
    with node_rig(api, "n1", gpus("n1", 4)) as rig:
        st = extender(api)
        pod = schedule(api, st, make_pod(
            "whole", [container("main", 2, 1000)],
            init=[container("proxy", 1, 1000, sidecar=True), container("prep", 2, 1000)]),
            "n1")
        rig.dm.admit(pod)
        gpu = {k[1]: {d.split("::")[0] for d in v} for k, v in rig.dm.devices_of.items()}
        assert gpu["proxy"].isdisjoint(gpu["main"])  # the sidecar runs beside main
        assert gpu["prep"] == gpu["main"]  # reused
        assert len(gpu["proxy"] | gpu["main"]) == 3
        main = rig.dm.responses[("ml/whole", "main")].envs["NVIDIA_VISIBLE_DEVICES"]
        assert set(main.split(",")) == gpu["main"]


def test_preferred_allocation_always_holds_must_include_and_the_size() -> None:
    """api.proto ContainerPreferredAllocationRequest: the answer must include every
    must_include_deviceIDs and be allocation_size long (manager.go
    callGetPreferredAllocationIfAvailable passes the devices already taken as must-include)."""
    api = FakeApiServer()
    with node_rig(api, "n1", gpus("n1", 2), replicas=4) as rig:
        st = extender(api)
        schedule(api, st, make_pod("waiting", [container("main", 1, 300)]), "n1")
        stub = rig.kubelet.stub()
        avail = [f"GPU-n1-{g}::{k}" for g in range(2) for k in range(4)]

        def ask(available: list[str], must: list[str], size: int) -> list[str]:
            r = stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=must,
                    allocation_size=size)]), timeout=5)
            return list(r.container_responses[0].deviceIDs)

        for must, size in (([], 1), (["GPU-n1-1::3"], 1), (["GPU-n1-0::2"], 2),
                           (["GPU-n1-0::0", "GPU-n1-1::0"], 3)):
            got = ask(avail, must, size)
            assert set(must) <= set(got) and len(got) == size and len(set(got)) == size
            assert set(got) <= set(avail)
        # fewer offered than asked: all of them, nothing invented
        assert sorted(ask(avail[:2], [], 5)) == sorted(avail[:2])
        # a must-include ID outside available is still in the answer
        assert "GPU-n1-1::1" in ask(avail[:3], ["GPU-n1-1::1"], 2)


@pytest.mark.parametrize(("ids", "text"), [
    (["GPU-zzz::0"], "unknown device IDs"),
    ([], "expected distinct device IDs"),
    (["GPU-n1-0::0", "GPU-n1-0::0"], "expected distinct device IDs"),
])
def test_allocate_refuses_devices_it_never_advertised(ids: list[str], text: str) -> None:
    """api.proto Allocate / manager.go: the kubelet allocates only advertised devices; the
    plugin answers anything else with INVALID_ARGUMENT and changes nothing."""
    api = FakeApiServer()
    with node_rig(api, "n1", gpus("n1", 1), replicas=2) as rig:
        with pytest.raises(grpc.RpcError) as exc:
            rig.kubelet.stub().Allocate(pb.AllocateRequest(container_requests=[
                pb.ContainerAllocateRequest(devices_ids=ids)]), timeout=5)
        assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert text in (exc.value.details() or "")
        assert rig.agent.plugin.executed() == []


def test_options_and_list_and_watch_follow_the_api() -> None:
    """plugin/v1beta1 client.go: the kubelet asks GetDevicePluginOptions after Register and
    reads the first ListAndWatch message as the full list; a health change is a new full
    list (api.proto ListAndWatch)."""
    api = FakeApiServer()
    with node_rig(api, "n1", gpus("n1", 2), replicas=3) as rig:
        opts = rig.kubelet.options
        assert opts is not None and opts.get_preferred_allocation_available
        assert not opts.pre_start_required
        assert len(rig.kubelet.lists[0]) == 6
        rig.agent.plugin.set_health("GPU-n1-1", False)
        assert wait_for(lambda: sum(d.health == "Unhealthy"
                                    for d in rig.kubelet.lists[-1]) == 3, 5)
        assert len(rig.kubelet.lists[-1]) == 6  # a full list every time


def test_resource_names_are_checked_as_the_kubelet_checks_them() -> None:
    """apimachinery pkg/util/validation IsQualifiedName and pkg/apis/core/v1/helper
    IsExtendedResourceName (the kubelet's registration handler refuses other names)."""
    good = ["gpuslice.io/gpu", "gpuslice.io/mig-1g.10gb.me", "nvidia.com/gpu",
            "example.com/a_b-c.d"]
    bad = ["gpuslice.io/mig-1g.10gb+me", "gpu", "kubernetes.io/gpu", "x.kubernetes.io/gpu",
           "requests.gpuslice.io/gpu", "gpuslice.io/", "/gpu", "Gpuslice.io/gpu",
           "gpuslice.io/-gpu", "gpuslice.io/gpu-", "a/b/c", "gpuslice.io/" + "g" * 64]
    assert [n for n in good if extended_resource_name_problems(n)] == []
    assert [n for n in bad if not extended_resource_name_problems(n)] == []


def test_mixed_mig_registers_the_media_extension_profile_by_nvidias_name(
        tmp_path: Path) -> None:
    """IsQualifiedName (no '+') and NVIDIA's spelling: the 1g.10gb+me profile is served as
    gpuslice.io/mig-1g.10gb.me, and the kubelet takes every resource at the first try."""
    (tmp_path / "inv.yaml").write_text(
        'gpus:\n  - model: A100-80GB\n    mig: "1g.10gb+me@0,1g.10gb@1,3g.40gb@4"\n')
    nvml = FakeNvml.from_yaml(tmp_path / "inv.yaml", node="n1")
    sock = tmp_path / "sock"
    sock.mkdir()
    kubelet = CheckingKubelet(sock).start()
    base = PluginConfig("n1", sock, KEY, mig_strategy="mixed")
    servers = [PluginServer(DevicePlugin(c, nvml, FakeApiServer()))
               for c in plugin_configs(base, nvml)]
    try:
        for s in servers:
            s.start()
        assert wait_for(lambda: len(kubelet.resources) == 3, 5)
        assert sorted(kubelet.resources) == ["gpuslice.io/mig-1g.10gb",
                                             "gpuslice.io/mig-1g.10gb.me",
                                             "gpuslice.io/mig-3g.40gb"]
        assert kubelet.refused == [] and all(s.attempts == 1 for s in servers)
        me = next(s for s in servers if s.plugin.cfg.resource.endswith(".me"))
        assert [d.ID for d in me.plugin.devices()] == ["MIG-GPU-n1-00-0"]
    finally:
        for s in servers:
            s.stop()
        kubelet.stop()


class RefusingKubelet(CheckingKubelet):
    def Register(self, request: pb.RegisterRequest, context: object) -> pb.Empty:
        self.refused.append(request.resource_name)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no room for you")  # type: ignore[attr-defined]
        raise AssertionError


def test_a_refused_registration_backs_off_and_is_reported(tmp_path: Path) -> None:
    """handler.go (the kubelet refuses a registration with an error): the plugin must not
    retry in a tight loop; each failure doubles the wait up to a cap, and the node agent
    turns it into a Warning Event on its node and a metric."""
    from gpuslice.services.node_agent import NodeAgent

    api = FakeApiServer()
    api.add_node({"metadata": {"name": "n1"}})
    kubelet = RefusingKubelet(tmp_path).start()
    agent = NodeAgent(PluginConfig("n1", tmp_path, KEY, replicas=1),
                      FakeNvml(gpus("n1", 1)), api)
    server = agent.servers[0]
    server.backoff_s, server.max_backoff_s = 0.05, 0.2
    try:
        delays = []
        for _ in range(5):
            assert not server._attempt()
            delays.append(server._delay)
        assert delays == [0.05, 0.1, 0.2, 0.2, 0.2]
        assert len(kubelet.refused) == 5
        assert "no room for you" in server.errors[0]
        events = [e for e in api.events if e["reason"] == "DevicePluginRegistrationFailed"]
        assert len(events) == 5 and events[0]["involvedObject"] == {
            "apiVersion": "v1", "kind": "Node", "name": "n1"}
        assert events[0]["type"] == "Warning"
        text = agent.metrics.render().decode()
        assert ('gpuslice_device_plugin_registration_failures_total{node="n1",'
                'resource="gpuslice.io/gpu"} 5.0') in text
    finally:
        server.stop()
        kubelet.stop()


def test_an_invalid_resource_name_is_never_sent(tmp_path: Path) -> None:
    """IsExtendedResourceName: a name the kubelet would refuse is refused here, with a
    clear error, and never registered (so there is nothing to retry)."""
    kubelet = CheckingKubelet(tmp_path).start()
    server = PluginServer(DevicePlugin(PluginConfig("n1", tmp_path, KEY,
                                                    resource="gpuslice.io/mig-1g.10gb+me"),
                                       FakeNvml(gpus("n1", 1)), FakeApiServer()))
    try:
        server.start()
        assert server.attempts == 0 and kubelet.refused == [] and kubelet.resources == []
        assert "gpuslice.io/mig-1g.10gb+me" in server.invalid
        assert "name part must consist of alphanumeric characters" in server.invalid
    finally:
        server.stop()
        kubelet.stop()


def cdi_validator() -> object:
    """The CDI spec's JSON schema (tests/conformance/cdi_schema.py) as a validator."""
    jsonschema = pytest.importorskip("jsonschema")
    referencing = pytest.importorskip("referencing")
    from tests.conformance.cdi_schema import DEFS, SCHEMA

    registry = referencing.Registry().with_resource(
        "defs.json", referencing.Resource.from_contents(
            DEFS, default_specification=referencing.jsonschema.DRAFT7))
    return jsonschema.Draft7Validator(SCHEMA, registry=registry)


@pytest.mark.parametrize("strategy", ["envvar", "volume-mounts", "cdi-annotations",
                                      "cdi-cri", "envvar,cdi-cri"])
def test_device_list_strategies(strategy: str, tmp_path: Path) -> None:
    """NVIDIA k8s-device-plugin --device-list-strategy (envvar, volume-mounts,
    cdi-annotations, cdi-cri), api.proto ContainerAllocateResponse (envs, mounts,
    annotations, cdi_devices) and the CDI spec (SPEC.md: kind vendor/class, device names,
    fully-qualified name vendor/class=name; schema/schema.json)."""
    api = FakeApiServer()
    cdi_root = tmp_path / "cdi"
    with node_rig(api, "n1", gpus("n1", 2), device_list_strategy=device_list_strategy(
            strategy), cdi_root=cdi_root) as rig:
        st = extender(api)
        pod = schedule(api, st, make_pod("p", [container("main", 1, 250)]), "n1")
        rig.dm.admit(pod)
        r = rig.dm.responses[("ml/p", "main")]
        gpu = rig.dm.devices_of[("ml/p", "main")][0].split("::")[0]
        names = set(strategy.split(","))
        if "envvar" in names:
            assert r.envs["NVIDIA_VISIBLE_DEVICES"] == gpu
        if "volume-mounts" in names:
            assert r.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
            assert [(m.container_path, m.host_path) for m in r.mounts
                    if m.host_path == "/dev/null"] == [
                (f"/var/run/nvidia-container-devices/{gpu}", "/dev/null")]
        cdi_names = [d.name for d in r.cdi_devices]
        cdi_ann = {k: v for k, v in r.annotations.items() if k.startswith("cdi.k8s.io/")}
        assert bool(cdi_names) == ("cdi-cri" in names)
        assert bool(cdi_ann) == ("cdi-annotations" in names)
        if "cdi-annotations" in names:
            (key, value), = cdi_ann.items()
            assert not qualified_name_problems(key)  # a valid annotation key
            cdi_names = value.split(",")
        spec_file = cdi_root / "gpuslice.io-gpu.json"
        if names & {"cdi-cri", "cdi-annotations"}:
            spec = json.loads(spec_file.read_text())
            cdi_validator().validate(spec)  # type: ignore[attr-defined]
            assert spec["kind"] == "gpuslice.io/gpu" and spec["cdiVersion"] in ("1.0.0", "1.1.0")
            listed = {f"{spec['kind']}={d['name']}" for d in spec["devices"]}
            assert cdi_names == [f"gpuslice.io/gpu={gpu}"] and set(cdi_names) <= listed
            assert not list(cdi_root.glob(".*tmp"))  # written atomically: no leftovers
        else:
            assert not spec_file.exists()


def test_device_list_strategy_names_are_checked() -> None:
    with pytest.raises(ValueError, match="device-list-strategy"):
        device_list_strategy("envvars")
    with pytest.raises(ValueError, match="device-list-strategy"):
        device_list_strategy("")
    assert device_list_strategy("cdi-cri, envvar") == ("cdi-cri", "envvar")
