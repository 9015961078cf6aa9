"""deploy/dra: renders with kustomize, validates against the Kubernetes 1.35 schemas
(kubernetes-validate knows resource.k8s.io/v1), grants the driver only what it calls, and
the driver, through the real Kubernetes client with that ServiceAccount's token, does its
whole job against the REST API fake that enforces those RBAC rules."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpuslice.adapters.kube.client import KubeClient
from gpuslice.adapters.nvml.port import FakeNvml, GpuProcess
from gpuslice.adapters.proc.pods import PodProcess
from gpuslice.core import dra
from gpuslice.core.errors import GpusliceError
from gpuslice.services.dra_driver import DraConfig, DraDriver
from tests.dra.conftest import NODE, claim, inventory
from tests.dra.kubelet import DraClient, register
from tests.fake_mps import write_fake_mps
from tests.kube.rest_fake import DEPLOY, EXAMPLES, Rbac, RestApiServer

DRA = Path(__file__).resolve().parents[2] / "deploy" / "dra"


def render(path: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: cannot render deploy/dra with kustomize")
    out = subprocess.run([kubectl, "kustomize", str(path)], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.mark.parametrize("path", [DRA, DRA / "examples"])
def test_every_object_validates_against_the_1_35_schemas(path: Path) -> None:
    for d in render(path):
        kubernetes_validate.validate(d, "1.35", strict=True)


def test_rbac_grants_only_what_the_driver_calls() -> None:
    (role,) = [d for d in render(DRA) if d["kind"] == "ClusterRole"]
    rules = {(g, r): set(rule["verbs"]) for rule in role["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}
    assert rules == {
        ("resource.k8s.io", "resourceslices"): {"get", "list", "watch", "create", "update",
                                                "delete"},
        ("resource.k8s.io", "resourceclaims"): {"get"},
        ("", "nodes"): {"get"}, ("", "events"): {"create"}, ("", "pods"): {"list", "patch"}}
    # and Leases in its namespace: the claim allocator's, read only (its taint), and the gate
    # keepers' (services.dra_gate.GateKeeper: elected while the allocator's is stale; create
    # cannot be limited to a name)
    (lease_role,) = [d for d in render(DRA) if d["kind"] == "Role"]
    assert lease_role["metadata"]["namespace"] == "gpuslice-system"
    assert lease_role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": ["gpuslice-dra-allocator"], "verbs": ["get"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": ["gpuslice-dra-gate-keeper"], "verbs": ["get", "update"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]}]


def test_device_classes_select_the_published_types_and_the_examples_fit_the_policies() -> None:
    classes = {d["metadata"]["name"]: d for d in render(DRA) if d["kind"] == "DeviceClass"}
    assert set(classes) == {"gpu.gpuslice.io", "mig.gpuslice.io", "share.gpuslice.io"}
    for name, t in (("gpu", dra.TYPE_GPU), ("mig", dra.TYPE_MIG), ("share", dra.TYPE_SHARE)):
        expr = classes[f"{name}.gpuslice.io"]["spec"]["selectors"][0]["cel"]["expression"]
        assert f"device.driver == '{dra.DRIVER}'" in expr and f".type == '{t}'" in expr
    assert classes["gpu.gpuslice.io"]["spec"]["extendedResourceName"] == "gpuslice.io/gpu"
    ds = next(d for d in render(DRA) if d["kind"] == "DaemonSet")
    mounts = {m["mountPath"] for m in ds["spec"]["template"]["spec"]["containers"][0][
        "volumeMounts"]}
    assert {"/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins",
            "/var/run/cdi"} <= mounts
    quarter = next(d for d in render(DRA / "examples") if d["metadata"]["name"] ==
                   "gpu-quarter")
    asked = quarter["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"][
        "requests"]
    plan = dra.pool_slices([dra.GpuFacts(FakeNvml.from_yaml(inventory(
        Path("/tmp") / f"inv-{id(asked)}.yaml", [{"model": "H100-SXM"}])).devices()[0])],
        {"GPU-node-00": dra.SHARE}, "580.95.05", dra.Features())
    cap = plan.slices[0]["devices"][0]["capacity"]
    for key, want in asked.items():
        rng = cap[key]["requestPolicy"]["validRange"]
        q = dra.parse_quantity(want, key)
        assert dra.parse_quantity(rng["min"], "min") <= q <= dra.parse_quantity(rng["max"],
                                                                               "max")
        assert q % dra.parse_quantity(rng["step"], "step") == 0


def test_the_driver_does_its_job_with_its_service_account_only(tmp_path: Path) -> None:
    import tempfile

    rest = RestApiServer(rbac=Rbac((DEPLOY, EXAMPLES, DRA))).start()
    short = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))
    try:
        rest.add_node({"metadata": {"name": NODE, "uid": "node-uid"}})
        c = claim("whole", [{"request": "gpu", "device": "gpu-1"}])
        rest.put_resource_claim(c)
        kc = rest.kubeconfig(tmp_path / "kc", token="sa:gpuslice-system:gpuslice-dra-driver")
        api = KubeClient(str(kc))
        nvml = FakeNvml.from_yaml(inventory(tmp_path / "g.yaml", [{"model": "T4"},
                                                                  {"model": "T4"}]), NODE)
        cfg = DraConfig(NODE, kubelet_dir=short / "k", cdi_dir=short / "cdi",
                        mps_pipe_dir=str(short / "mps"),
                        mps_binary=str(write_fake_mps(short / "mps-control")),
                        modes={"0": dra.SHARE})
        driver = DraDriver(cfg, nvml, api)
        driver.start()  # detects features (dry-run creates), publishes
        assert driver.features == dra.Features(True, True, True)
        slices = rest.list_resource_slices(dra.DRIVER, NODE)
        assert [d["attributes"]["type"]["string"] for s in slices
                for d in s["spec"]["devices"]] == ["share", "gpu"]
        from gpuslice.services.dra_driver import DraServer

        server = DraServer(driver)
        server.start()
        client = DraClient(register(cfg.registration_socket))
        try:
            ref = ("default", c["metadata"]["uid"], "whole")
            cc = claim("share", [{"request": "gpu", "device": "gpu-0", "shareID": "s-1",
                                  "consumedCapacity": {"compute": "50", "memory": "4Gi"}}])
            rest.put_resource_claim(cc)
            got = client.prepare([ref, ("default", cc["metadata"]["uid"], "share")])
            assert got[ref[1]].error == ""  # both claims read with "get resourceclaims"
            assert got[cc["metadata"]["uid"]].error == ""
            assert got[cc["metadata"]["uid"]].devices[0].share_id == "s-1"
            # what the pods use of their shares: the node's pods listed with its account
            from prometheus_client import CollectorRegistry

            nvml.set_processes(nvml.devices()[0].uuid, [GpuProcess(4242, 100)])
            usage = driver.measure_usage(CollectorRegistry(), api,
                                         pod_of_pid=lambda pid: PodProcess(pid, "u1", "c1"))
            usage.step()
            assert usage.problems == []
        finally:
            client.close()
            server.stop()
        rest.dra_gates = set()  # an API server with the gates off: fallback + an Event
        driver.features = None
        driver.start()
        assert driver.features == dra.Features(False, False, False)
        assert any(e["reason"] == "DeviceModelFallback" for e in rest.events)
        assert not rest.denied
        with pytest.raises(GpusliceError, match="403"):
            api.list_nodes()  # nothing else
    finally:
        rest.stop()
        shutil.rmtree(short, ignore_errors=True)


def test_the_drivers_dev_shm_is_the_directory_its_cdi_specs_mount() -> None:
    """The driver starts the MPS control daemons and its CDI specs mount ``--mps-shm-dir`` at
    /dev/shm in each share's container: the driver's own /dev/shm must be that host directory
    (daemon and clients exchange shared memory there)."""
    from gpuslice.cli import _build_parser

    (ds,) = [d for d in render(DRA) if d["kind"] == "DaemonSet"
             and d["metadata"]["name"] == "gpuslice-dra-driver"]
    spec = ds["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["command"][0] == "gpuslice"
    args = _build_parser().parse_args(c["command"][1:])
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert vol["hostPath"]["path"] == args.mps_shm_dir != ""
