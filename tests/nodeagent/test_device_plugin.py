"""The device plugin over real gRPC on unix sockets, against a kubelet-side driver written here."""

from __future__ import annotations

import json
import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from gpuslice.adapters.kube.annotation import encode
from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.kubelet import deviceplugin_pb2 as pb
from gpuslice.adapters.kubelet import deviceplugin_pb2_grpc as pbg
from gpuslice.adapters.kubelet import podresources_pb2 as prpb
from gpuslice.adapters.kubelet import podresources_pb2_grpc as prpbg
from gpuslice.adapters.nvml.port import FakeNvml
from gpuslice.core.assignment import Assignment, ContainerAssignment, GpuShare, Mode, sign
from gpuslice.core.devices import GpuDevice
from gpuslice.services.device_plugin import DevicePlugin, PluginConfig, PluginServer, wait_for

KEY = b"node-agent-key-0123456789"
GPUS = [GpuDevice(0, "GPU-aaa", "NVIDIA A100-80GB", "A100-80GB", 81920),
        GpuDevice(1, "GPU-bbb", "NVIDIA A100-80GB", "A100-80GB", 81920)]


class Kubelet(pbg.RegistrationServicer):
    """The kubelet side: a Registration server on kubelet.sock that, like the kubelet, dials
    the plugin back, asks its options and follows ListAndWatch."""

    def __init__(self, sock_dir: Path) -> None:
        self.dir = sock_dir
        self.lists: list[list[pb.Device]] = []
        self.resources: list[str] = []
        self.registered = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pbg.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{sock_dir / 'kubelet.sock'}")
        self.channel: grpc.Channel | None = None

    def start(self) -> Kubelet:
        self.server.start()
        return self

    def Register(self, request: pb.RegisterRequest, context: object) -> pb.Empty:
        assert request.version == "v1beta1" and request.resource_name.startswith("gpuslice.io/")
        self.resources.append(request.resource_name)
        self.channel = grpc.insecure_channel(f"unix://{self.dir / request.endpoint}")
        stub = pbg.DevicePluginStub(self.channel)
        opts = stub.GetDevicePluginOptions(pb.Empty(), timeout=5)
        assert opts.get_preferred_allocation_available

        def follow() -> None:
            try:
                for resp in stub.ListAndWatch(pb.Empty()):
                    self.lists.append(list(resp.devices))
            except grpc.RpcError:
                pass

        threading.Thread(target=follow, daemon=True).start()
        self.registered.set()
        return pb.Empty()

    def stub(self) -> pbg.DevicePluginStub:
        assert self.channel is not None
        return pbg.DevicePluginStub(self.channel)

    def stop(self) -> None:
        self.server.stop(grace=None)
        if self.channel is not None:
            self.channel.close()


@pytest.fixture
def env() -> Iterator[tuple[Kubelet, DevicePlugin, PluginServer, FakeApiServer, Path]]:
    with tempfile.TemporaryDirectory(prefix="dp-") as d:
        sock_dir = Path(d)
        api = FakeApiServer()
        kubelet = Kubelet(sock_dir).start()
        plugin = DevicePlugin(PluginConfig("node-1", sock_dir, KEY, replicas=4),
                              FakeNvml(list(GPUS)), api)
        server = PluginServer(plugin)
        server.start()
        assert kubelet.registered.wait(5)
        assert wait_for(lambda: bool(kubelet.lists), 5)
        yield kubelet, plugin, server, api, sock_dir
        server.stop()
        kubelet.stop()


def assign(api: FakeApiServer, pod: str, uuids: list[str], milli: int = 300,
           mem: int = 8192, node: str = "node-1", key: bytes = KEY, t: str = "t1", *,
           mode: Mode | None = None, mig: tuple[str, int] | None = None,
           annotations: dict[str, str] | None = None) -> None:
    """A pod in namespace ml bound to ``node`` with a signed assignment of ``uuids`` (inside
    MIG instance ``mig`` = (profile, start) when given), plus any other ``annotations``."""
    p = api.add_pod({"metadata": {"name": pod, "namespace": "ml"},
                     "spec": {"nodeName": node, "containers": [{"name": "main", "image": "m"}]}})
    mode = mode or (Mode.MPS if milli < 1000 else Mode.EXCLUSIVE)
    profile, start = mig or ("", -1)
    a = Assignment("ml", pod, p["metadata"]["uid"], node, (ContainerAssignment(
        "main", mode, tuple(GpuShare(u, milli, mem, profile, start) for u in uuids)),), t)
    api.patch_pod_annotations("ml", pod, {"gpuslice.io/assignment": encode(sign(a, key)),
                                          **(annotations or {})},
                              p["metadata"]["resourceVersion"])


def allocate(stub: pbg.DevicePluginStub, *ids: str) -> pb.ContainerAllocateResponse:
    resp = stub.Allocate(pb.AllocateRequest(container_requests=[
        pb.ContainerAllocateRequest(devices_ids=list(ids))]), timeout=5)
    return resp.container_responses[0]


def test_register_and_list(env) -> None:  # type: ignore[no-untyped-def]
    kubelet, *_ = env
    first = kubelet.lists[0]
    assert len(first) == 8 and {d.health for d in first} == {"Healthy"}
    assert {d.ID.split("::")[0] for d in first} == {"GPU-aaa", "GPU-bbb"}


def test_preferred_allocation_steers_to_the_assigned_gpu_and_allocate_executes_it(env) -> None:  # type: ignore[no-untyped-def]
    kubelet, _, _, api, _ = env
    assign(api, "p1", ["GPU-bbb"], milli=300, mem=8192)
    stub = kubelet.stub()
    pref = stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
        pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=[f"GPU-aaa::{k}" for k in range(4)] +
            [f"GPU-bbb::{k}" for k in range(4)], allocation_size=1)]), timeout=5)
    chosen = list(pref.container_responses[0].deviceIDs)
    assert [c.split("::")[0] for c in chosen] == ["GPU-bbb"]
    r = allocate(stub, *chosen)
    assert r.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-bbb"
    assert r.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert r.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
    assert r.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/run/gpuslice/mps"
    # the GPU's MPS pipe directory, and the daemons' /dev/shm (client and daemon exchange
    # shared memory there; the pod has its own IPC namespace)
    pipe, shm = r.mounts
    assert pipe.container_path == "/run/gpuslice/mps" and pipe.host_path.endswith("/GPU-bbb")
    assert (shm.container_path, shm.host_path) == ("/dev/shm", "/run/gpuslice/mps-shm")
    assert r.annotations["gpuslice.io/pod"] == "ml/p1"
    # advertised as not required, but answered when the kubelet calls it
    stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=chosen), timeout=5)


@pytest.mark.parametrize(
    ("setup", "ids", "code", "text"),
    [
        (lambda api: None, ["GPU-zzz::0"], grpc.StatusCode.INVALID_ARGUMENT, "unknown device"),
        (lambda api: None, ["GPU-aaa::0"], grpc.StatusCode.FAILED_PRECONDITION,
         "no verified gpuslice assignment"),
        (lambda api: assign(api, "forged", ["GPU-aaa"], key=b"some-other-key-0123456"),
         ["GPU-aaa::0"], grpc.StatusCode.FAILED_PRECONDITION, "no verified"),
        (lambda api: assign(api, "elsewhere", ["GPU-aaa"], node="node-2"),
         ["GPU-aaa::0"], grpc.StatusCode.FAILED_PRECONDITION, "no verified"),
    ],
)
def test_bad_allocations_are_refused_with_a_reason(env, setup, ids, code, text) -> None:  # type: ignore[no-untyped-def]
    kubelet, plugin, _, api, _ = env
    setup(api)
    with pytest.raises(grpc.RpcError) as exc:
        allocate(kubelet.stub(), *ids)
    assert exc.value.code() == code and text in (exc.value.details() or "")
    assert plugin._claimed == {}  # no state changed


def test_gpu_fault_and_recovery_are_streamed(env) -> None:  # type: ignore[no-untyped-def]
    kubelet, plugin, *_ = env
    plugin.set_health("GPU-aaa", False)
    assert wait_for(lambda: any(d.health == "Unhealthy" for d in kubelet.lists[-1]), 3)
    bad = {d.ID.split("::")[0] for d in kubelet.lists[-1] if d.health == "Unhealthy"}
    assert bad == {"GPU-aaa"}
    plugin.set_health("GPU-aaa", True)
    assert wait_for(lambda: all(d.health == "Healthy" for d in kubelet.lists[-1]), 3)


def test_kubelet_restart_re_registers_within_two_seconds(env) -> None:  # type: ignore[no-untyped-def]
    kubelet, _, server, _, sock_dir = env
    kubelet.stop()
    for f in sock_dir.iterdir():  # the kubelet wipes the directory on start
        f.unlink()
    again = Kubelet(sock_dir).start()
    try:
        ok = again.registered.wait(2.0)
        assert ok, server.errors
        assert wait_for(lambda: bool(again.lists), 2.0)
        assert wait_for(lambda: server.registrations == 2, 2.0)
    finally:
        again.stop()


def test_fifty_pods_admitted_back_to_back_each_get_their_own_assignment(env) -> None:  # type: ignore[no-untyped-def]
    kubelet, _, _, api, _ = env
    for i in range(50):
        assign(api, f"burst-{i:02d}", ["GPU-aaa"], milli=20, mem=1024, t=f"t{i:02d}")
    stub = kubelet.stub()
    with futures.ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(lambda k: allocate(stub, f"GPU-aaa::{k % 4}"), range(50)))
    pods = [r.envs["GPUSLICE_ASSIGNMENT"] for r in got]
    assert len(set(pods)) == 50 and all(p.startswith("ml/burst-") for p in pods)
    with pytest.raises(grpc.RpcError):
        allocate(stub, "GPU-aaa::0")  # nothing left to execute


def test_node_agent_publishes_inventory_and_recovers_a_faulty_gpu() -> None:
    import json

    from gpuslice.services.node_agent import NodeAgent

    with tempfile.TemporaryDirectory(prefix="na-") as d:
        sock_dir = Path(d)
        api = FakeApiServer()
        api.add_node({"metadata": {"name": "node-1"}})
        kubelet = Kubelet(sock_dir).start()
        nvml = FakeNvml(list(GPUS))
        now = [0.0]
        agent = NodeAgent(PluginConfig("node-1", sock_dir, KEY, replicas=2), nvml, api,
                          quiet_s=30, clock=lambda: now[0])
        t = threading.Thread(target=agent.run, daemon=True)
        t.start()
        try:
            assert kubelet.registered.wait(5)
            assert wait_for(lambda: "gpuslice.io/inventory" in api.list_nodes()[0]["metadata"]
                            .get("annotations", {}), 3)
            node = api.list_nodes()[0]["metadata"]
            assert node["labels"]["nvidia.com/gpu.count"] == "2"
            assert len(json.loads(node["annotations"]["gpuslice.io/inventory"])) == 2
            # the share total kube-scheduler counts (its preemption needs to see contention)
            status = api.list_nodes()[0]["status"]
            assert status["capacity"]["gpuslice.io/gpu-milli"] == "2000"
            assert status["allocatable"]["gpuslice.io/gpu-milli"] == "2000"
            # and the memory total the DRA extended-resource filter needs to find
            assert status["allocatable"]["gpuslice.io/gpu-memory"] == str(
                sum(g.memory_mib for g in nvml.devices()))
            nvml.inject("GPU-bbb", 43)  # an application error: the GPU stays healthy
            nvml.inject("GPU-aaa", 79)  # fell off the bus
            assert wait_for(lambda: any(dv.health == "Unhealthy" for dv in kubelet.lists[-1]), 3)
            assert wait_for(lambda: len(json.loads(api.list_nodes()[0]["metadata"][
                "annotations"]["gpuslice.io/inventory"])) == 1, 3)
            assert api.list_nodes()[0]["status"]["allocatable"]["gpuslice.io/gpu-milli"] == \
                "1000"  # the faulty GPU's share is no longer offered
            assert {dv.ID.split("::")[0] for dv in kubelet.lists[-1]
                    if dv.health == "Unhealthy"} == {"GPU-aaa"}
            now[0] = 31.0  # quiet long enough
            assert wait_for(lambda: all(dv.health == "Healthy" for dv in kubelet.lists[-1]), 3)
        finally:
            agent.stop()
            kubelet.stop()


def test_node_agent_command_on_a_fake_inventory(tmp_path: Path) -> None:
    import subprocess
    import sys

    with tempfile.TemporaryDirectory(prefix="nc-") as d:
        sock_dir = Path(d)
        kubelet = Kubelet(sock_dir).start()
        (tmp_path / "inv.yaml").write_text("gpus:\n  - model: T4\n  - model: T4\n")
        (tmp_path / "cluster.yaml").write_text("nodes:\n  - metadata: {name: n1}\n")
        (tmp_path / "key").write_bytes(KEY)
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuslice.cli", "node-agent", "--node", "n1", "--key-file",
             str(tmp_path / "key"), "--fake-gpus", str(tmp_path / "inv.yaml"), "--socket-dir",
             str(sock_dir), "--replicas", "3", "--fake-cluster", str(tmp_path / "cluster.yaml"),
             "--metrics", "off"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            assert kubelet.registered.wait(15)
            assert wait_for(lambda: bool(kubelet.lists), 5)
            assert len(kubelet.lists[0]) == 6
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            kubelet.stop()


def test_metrics_show_allocation_per_gpu(env) -> None:  # type: ignore[no-untyped-def]
    from gpuslice.services.node_agent import NodeAgent

    kubelet, plugin, _, api, _ = env
    assign(api, "m1", ["GPU-aaa"], milli=250)
    allocate(kubelet.stub(), "GPU-aaa::0")
    agent = NodeAgent(plugin.cfg, plugin.nvml, api)
    agent.plugin = plugin
    agent.update_metrics()
    text = agent.metrics.render().decode()
    assert 'gpuslice_gpu_allocated_milli{gpu="GPU-aaa",model="A100-80GB",node="node-1"} 250.0' \
        in text
    assert 'gpuslice_gpu_slices{gpu="GPU-bbb",model="A100-80GB",node="node-1"} 0.0' in text
    assert 'gpuslice_virtual_devices{node="node-1"} 8.0' in text


def test_an_mps_slice_starts_its_gpus_daemon_once_and_stop_quits_it(env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from gpuslice.services.node_agent import NodeAgent
    from tests.fake_mps import write_fake_mps

    kubelet, plugin, _, api, _ = env
    tool = write_fake_mps(tmp_path / "mps-control")
    plugin.cfg.mps_pipe_dir = str(tmp_path / "mps")
    agent = NodeAgent(plugin.cfg, plugin.nvml, api, mps=True, mps_binary=str(tool))
    plugin.ensure_mps = agent.ensure_mps
    assign(api, "s1", ["GPU-aaa"], milli=250)
    assign(api, "s2", ["GPU-aaa"], milli=250, t="t2")
    allocate(kubelet.stub(), "GPU-aaa::0")
    allocate(kubelet.stub(), "GPU-aaa::1")
    assert (tmp_path / "mps" / "GPU-aaa" / "control").exists()
    assert list(agent._mps) == ["GPU-aaa"]
    agent.quit_mps()
    assert not (tmp_path / "mps" / "GPU-aaa" / "control").exists()


def test_mixed_mig_strategy_serves_one_resource_per_profile(tmp_path: Path) -> None:
    from gpuslice.services.device_plugin import plugin_configs

    (tmp_path / "inv.yaml").write_text(
        'gpus:\n  - model: A100-80GB\n    mig: "3g.40gb@0,2g.20gb@4,1g.10gb@6"\n'
        '  - model: A100-80GB\n    mig: "3g.40gb@0,3g.40gb@4"\n')
    nvml = FakeNvml.from_yaml(tmp_path / "inv.yaml", node="n1")
    with tempfile.TemporaryDirectory(prefix="mx-") as d:
        sock_dir = Path(d)
        kubelet = Kubelet(sock_dir).start()
        base = PluginConfig("n1", sock_dir, KEY, mig_strategy="mixed")
        cfgs = plugin_configs(base, nvml)
        assert [c.resource for c in cfgs] == ["gpuslice.io/mig-1g.10gb",
                                             "gpuslice.io/mig-2g.20gb", "gpuslice.io/mig-3g.40gb"]
        servers = [PluginServer(DevicePlugin(c, nvml, FakeApiServer())) for c in cfgs]
        try:
            for s in servers:
                s.start()
            assert wait_for(lambda: len(kubelet.resources) == 3, 5)
            three = servers[2].plugin.devices()
            assert len(three) == 3 and all(dv.ID.startswith("MIG-") for dv in three)
            stub = pbg.DevicePluginStub(grpc.insecure_channel(
                f"unix://{sock_dir / cfgs[2].endpoint}"))
            r = allocate(stub, three[0].ID)
            assert r.envs["NVIDIA_VISIBLE_DEVICES"] == three[0].ID  # no assignment needed
            with pytest.raises(grpc.RpcError) as exc:
                allocate(stub, "GPU-whatever::0")
            assert "MIG instance UUIDs" in (exc.value.details() or "")
        finally:
            for s in servers:
                s.stop()
            kubelet.stop()
    single = PluginConfig("n1", Path("/tmp"), KEY, mig_strategy="single")
    assert len(DevicePlugin(single, nvml, FakeApiServer()).devices()) == 5
    # the count the metrics report, made without the devices, is the list's length in every
    # strategy
    for cfg in [single, *cfgs, PluginConfig("n1", Path("/tmp"), KEY, replicas=3)]:
        plugin = DevicePlugin(cfg, nvml, FakeApiServer())
        assert plugin.device_count() == len(plugin.devices()) > 0, cfg.mig_strategy


def test_a_mig_assignment_sees_the_instance_it_names() -> None:
    from gpuslice.core.devices import MigInstance

    gpu = GpuDevice(0, "GPU-mig", "NVIDIA A100-80GB", "A100-80GB", 81920, mig_enabled=True,
                    mig=(MigInstance("MIG-x-0", "4g.40gb", 0, 40192),
                         MigInstance("MIG-x-4", "3g.40gb", 4, 40192)))
    with tempfile.TemporaryDirectory(prefix="dp-") as d:
        sock = Path(d)
        api = FakeApiServer()
        kubelet = Kubelet(sock).start()
        server = PluginServer(DevicePlugin(PluginConfig("node-1", sock, KEY, replicas=2),
                                           FakeNvml([gpu]), api))
        server.start()
        try:
            assert kubelet.registered.wait(5)
            assign(api, "m", ["GPU-mig"], 428, 40192, mode=Mode.MIG, mig=("3g.40gb", 4))
            r = allocate(kubelet.stub(), "GPU-mig::0")
            assert r.envs["NVIDIA_VISIBLE_DEVICES"] == "MIG-x-4"
            assert r.annotations["gpuslice.io/mode"] == "mig"
            # an assignment naming an instance the GPU no longer has: refused, nothing held
            assign(api, "gone", ["GPU-mig"], 142, 9728, t="t2", mode=Mode.MIG,
                   mig=("1g.10gb", 6))
            with pytest.raises(grpc.RpcError) as exc:
                allocate(kubelet.stub(), "GPU-mig::1")
            assert "passed over, as they can no longer be executed: ml/gone: GPU GPU-mig has " \
                "no MIG instance 1g.10gb@6" in (exc.value.details() or "")
            # the stale assignment is older, but a newer one that can run is not held up by it
            assign(api, "next", ["GPU-mig"], 571, 40192, t="t3", mode=Mode.MIG,
                   mig=("4g.40gb", 0))
            r = allocate(kubelet.stub(), "GPU-mig::1")
            assert r.envs["GPUSLICE_ASSIGNMENT"] == "ml/next"
            assert r.envs["NVIDIA_VISIBLE_DEVICES"] == "MIG-x-0"
        finally:
            server.stop()
            kubelet.stop()


def test_an_mps_slice_inside_a_mig_instance_gets_the_instances_daemon(tmp_path: Path) -> None:
    """MPS inside MIG: the container sees the instance, its thread cap is its share of the
    instance (200 milli of the GPU in a 3g of 7 is 47%), and the MPS daemon is the instance's
    own, with its own pipe directory."""
    from gpuslice.core.devices import MigInstance
    from gpuslice.services.node_agent import NodeAgent
    from tests.fake_mps import write_fake_mps

    gpu = GpuDevice(0, "GPU-mig", "NVIDIA A100-80GB", "A100-80GB", 81920, mig_enabled=True,
                    mig=(MigInstance("MIG-x-0", "3g.40gb", 0, 40192),
                         MigInstance("MIG-x-4", "3g.40gb", 4, 40192)))
    tool = write_fake_mps(tmp_path / "mps-control")
    with tempfile.TemporaryDirectory(prefix="dp-") as d:
        sock = Path(d)
        api = FakeApiServer()
        kubelet = Kubelet(sock).start()
        cfg = PluginConfig("node-1", sock, KEY, replicas=4, mps_pipe_dir=str(tmp_path / "mps"))
        agent = NodeAgent(cfg, FakeNvml([gpu]), api, mps=True, mps_binary=str(tool))
        server = PluginServer(agent.plugin)
        server.start()
        try:
            assert kubelet.registered.wait(5)
            for name, milli, start, t in (("a", 200, 0, "t1"), ("b", 100, 4, "t2")):
                assign(api, name, ["GPU-mig"], milli, 8192, t=t, mig=("3g.40gb", start))
            ra = allocate(kubelet.stub(), "GPU-mig::0")
            rb = allocate(kubelet.stub(), "GPU-mig::1")
            assert ra.envs["NVIDIA_VISIBLE_DEVICES"] == "MIG-x-0"
            assert ra.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "47"
            assert ra.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
            assert rb.envs["NVIDIA_VISIBLE_DEVICES"] == "MIG-x-4"
            assert rb.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "23"
            assert ra.mounts[0].host_path == str(tmp_path / "mps" / "MIG-x-0")
            assert sorted(agent._mps) == ["MIG-x-0", "MIG-x-4"]  # one daemon per instance
            assert (tmp_path / "mps" / "MIG-x-4" / "control").exists()
        finally:
            server.stop()
            kubelet.stop()
            agent.quit_mps()
    assert not any((tmp_path / "mps").glob("*/control"))


def test_a_best_effort_pod_runs_at_below_normal_mps_priority(env) -> None:  # type: ignore[no-untyped-def]
    kubelet, _, _, api, _ = env
    assign(api, "be", ["GPU-aaa"], milli=250,
           annotations={"gpuslice.io/priority": "best-effort"})
    assign(api, "lc", ["GPU-bbb"], milli=250, t="t2",
           annotations={"gpuslice.io/priority": "latency-critical"})
    be = allocate(kubelet.stub(), "GPU-aaa::0")
    lc = allocate(kubelet.stub(), "GPU-bbb::0")
    assert be.envs["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert "CUDA_MPS_CLIENT_PRIORITY" not in lc.envs  # normal is MPS's default
    assign(api, "odd", ["GPU-aaa"], milli=250, t="t3",
           annotations={"gpuslice.io/priority": "urgent"})
    with pytest.raises(grpc.RpcError) as exc:
        allocate(kubelet.stub(), "GPU-aaa::1")
    assert "gpuslice.io/priority: expected one of best-effort" in (exc.value.details() or "")


def test_after_an_agent_restart_running_pods_are_not_allocated_again(env) -> None:  # type: ignore[no-untyped-def]
    """A restarted agent remembers nothing it executed; the pods already running on a GPU
    must not be taken for the one being admitted (oldest first would pick them)."""
    _, plugin, server, api, sock_dir = env
    assign(api, "old", ["GPU-aaa"], milli=600, t="t1")
    api.set_pod_status("ml", "old", {"phase": "Running"})
    assign(api, "new", ["GPU-aaa"], milli=200, t="t2")
    fresh = DevicePlugin(plugin.cfg, plugin.nvml, api)  # as a restarted agent's plugin
    assert [a.pod for a in fresh._pending()] == ["new"]
    r = allocate_after_restart(server, fresh, sock_dir, "GPU-aaa::0")
    assert r.envs["GPUSLICE_ASSIGNMENT"] == "ml/new"
    assert r.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"


def allocate_after_restart(server: PluginServer, fresh: DevicePlugin, sock_dir: Path,
                           device: str) -> pb.ContainerAllocateResponse:
    """Stop ``server`` and serve ``fresh`` (a restarted agent's plugin) on its socket; the
    kubelet's Allocate of ``device`` there."""
    server.stop()
    restarted = PluginServer(fresh)
    restarted.start()
    try:
        with grpc.insecure_channel(f"unix://{sock_dir / fresh.cfg.endpoint}") as ch:
            return allocate(pbg.DevicePluginStub(ch), device)
    finally:
        restarted.stop()


class PodResourcesKubelet(prpbg.PodResourcesListerServicer):
    """The kubelet's PodResources API on a unix socket: the pods it gave devices to."""

    def __init__(self, socket: Path, held: dict[tuple[str, str], list[str]]) -> None:
        self.held = held
        self.calls = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        prpbg.add_PodResourcesListerServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{socket}")
        self.server.start()

    def List(self, request: prpb.ListPodResourcesRequest,
             context: object) -> prpb.ListPodResourcesResponse:
        self.calls += 1
        return prpb.ListPodResourcesResponse(pod_resources=[
            prpb.PodResources(namespace=ns, name=name, containers=[prpb.ContainerResources(
                name="main", devices=[prpb.ContainerDevices(resource_name="gpuslice.io/gpu",
                                                            device_ids=ids)])])
            for (ns, name), ids in self.held.items()])


def test_after_an_agent_restart_a_pending_pod_the_kubelet_gave_devices_is_not_taken_again(
        env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A pod still Pending while it pulls its image was admitted already: the kubelet's
    PodResources API says so, and the pod admitted next gets its own assignment."""
    from dataclasses import replace

    _, plugin, server, api, sock_dir = env
    assign(api, "pulling", ["GPU-aaa"], milli=600, t="t1")  # allocated, image still pulling
    assign(api, "next", ["GPU-aaa"], milli=200, t="t2")
    socket = tmp_path / "pod-resources.sock"
    kubelet_side = PodResourcesKubelet(socket, {("ml", "pulling"): ["GPU-aaa::0"],
                                                ("other", "cpu-only"): []})
    try:
        guessing = DevicePlugin(plugin.cfg, plugin.nvml, api)  # without the API: a guess
        assert [a.pod for a in guessing._pending()] == ["pulling", "next"]
        fresh = DevicePlugin(replace(plugin.cfg, pod_resources=socket), plugin.nvml, api)
        r = allocate_after_restart(server, fresh, sock_dir, "GPU-aaa::1")
        assert r.envs["GPUSLICE_ASSIGNMENT"] == "ml/next"
        assert r.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"
        assert kubelet_side.calls >= 1 and fresh.problems == []
    finally:
        kubelet_side.server.stop(grace=None)



def test_without_the_kubelets_answer_allocate_fails_closed(env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """After an agent restart, with the PodResources API not answering, the pending pod the
    kubelet admitted already looks like the oldest waiting one: executing it for the next
    pod's Allocate would put two pods on one share. Allocate refuses (UNAVAILABLE, naming
    the socket) instead, and the preferred allocation only does not steer."""
    from dataclasses import replace

    _, plugin, server, api, sock_dir = env
    assign(api, "pulling", ["GPU-aaa"], milli=600, t="t1")  # allocated, image still pulling
    assign(api, "next", ["GPU-aaa"], milli=200, t="t2")
    gone = DevicePlugin(replace(plugin.cfg, pod_resources=tmp_path / "none.sock"), plugin.nvml,
                        api)
    with pytest.raises(grpc.RpcError) as exc:
        allocate_after_restart(server, gone, sock_dir, "GPU-aaa::1")
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "none.sock" in (exc.value.details() or "") and "no assignment is executed" in (
        exc.value.details() or "")
    assert gone.executed() == [] and gone._target(1) == []
    assert len(gone.problems) == 1 and "PodResources" in gone.problems[0]


def test_the_cdi_spec_follows_a_mig_layout_change(tmp_path: Path) -> None:
    """With a cdi-* strategy, Allocate names the MIG instance's CDI device; a layout change
    (the reconfiguration controller's, or instances made again after a reboot) gives the
    instance a new UUID, and the spec on disk must name it before the runtime reads it
    (it was written once, at the plugin's start)."""
    from gpuslice.core.devices import MigInstance

    gpu = GpuDevice(0, "GPU-mig", "NVIDIA A100-80GB", "A100-80GB", 81920, mig_enabled=True,
                    mig=(MigInstance("MIG-x-0", "4g.40gb", 0, 40192),
                         MigInstance("MIG-x-4", "3g.40gb", 4, 40192)))
    nvml = FakeNvml([gpu])
    cdi = tmp_path / "cdi"
    with tempfile.TemporaryDirectory(prefix="dp-") as d:
        sock = Path(d)
        api = FakeApiServer()
        kubelet = Kubelet(sock).start()
        server = PluginServer(DevicePlugin(PluginConfig(
            "node-1", sock, KEY, replicas=2, device_list_strategy=("cdi-cri",),
            cdi_root=cdi), nvml, api))
        server.start()

        def names() -> set[str]:
            spec = json.loads((cdi / "gpuslice.io-gpu.json").read_text())
            return {dev["name"] for dev in spec["devices"]}

        try:
            assert kubelet.registered.wait(5)
            before = names()
            nvml.destroy_instance("GPU-mig", "3g.40gb", 4)
            nvml.create_instance("GPU-mig", "3g.40gb", 4)  # a new UUID: MIG-GPU-mig-4
            assign(api, "m", ["GPU-mig"], 428, 40192, mode=Mode.MIG, mig=("3g.40gb", 4))
            r = allocate(kubelet.stub(), "GPU-mig::0")
            (device,) = [c.name for c in r.cdi_devices]
            wanted = device.split("=", 1)[1]
            assert wanted not in before and wanted in names()
            (cdi / "gpuslice.io-gpu.json").unlink()  # /var/run/cdi emptied (a reboot's tmpfs)
            assign(api, "m2", ["GPU-mig"], 571, 40192, t="t2", mode=Mode.MIG,
                   mig=("4g.40gb", 0))
            allocate(kubelet.stub(), "GPU-mig::1")
            assert (cdi / "gpuslice.io-gpu.json").exists()
        finally:
            server.stop()
            kubelet.stop()


def test_the_node_totals_keep_what_running_pods_hold_on_a_faulty_gpu() -> None:
    """A GPU with an XID leaves the inventory, but its pods still run: the node's gpu-milli
    and gpu-memory totals drop by what is free on it, not by the whole GPU, so that a kubelet
    that restarts and admits its running pods again (against allocatable) rejects none."""
    import json

    from gpuslice.services.node_agent import NodeAgent

    api = FakeApiServer()
    api.add_node({"metadata": {"name": "node-1"}})
    nvml = FakeNvml(list(GPUS))
    agent = NodeAgent(PluginConfig("node-1", Path("/nonexistent"), KEY, replicas=2), nvml, api,
                      quiet_s=30, clock=lambda: 0.0)
    assign(api, "on-a", ["GPU-aaa"], milli=900, mem=20000, node="node-1")
    assign(api, "on-b", ["GPU-bbb"], milli=900, mem=20000, node="node-1", t="t2")
    assign(api, "forged", ["GPU-aaa"], milli=100, node="node-1", key=b"x" * 24, t="t3")
    agent.publish()
    nvml.inject("GPU-aaa", 79)
    agent.health_step(0.1)
    node = api.list_nodes()[0]
    assert len(json.loads(node["metadata"]["annotations"]["gpuslice.io/inventory"])) == 1
    # 1000 for the healthy GPU, and the 900 the running pod holds on the faulty one
    assert node["status"]["allocatable"]["gpuslice.io/gpu-milli"] == "1900"
    assert node["status"]["allocatable"]["gpuslice.io/gpu-memory"] == str(81920 + 20000)
    api.set_pod_status("ml", "on-a", {"phase": "Succeeded"})  # it ends: the total follows
    agent.publish()
    assert api.list_nodes()[0]["status"]["allocatable"]["gpuslice.io/gpu-milli"] == "1000"
