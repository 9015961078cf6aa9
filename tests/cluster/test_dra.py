"""The DRA driver on the real control plane: ``gpuslice dra-driver --fake`` as a process per
kwok node on the gpuslice-dra-driver service account publishes real ResourceSlices, the real
kube-scheduler (DRAConsumableCapacity, DRAPartitionableDevices on) allocates pods' claims from
them for the three models, and the test plays the kubelet (tests/dra/kubelet.py:
registration, NodePrepareResources over the driver's unix socket) and reads the CDI specs.

Rules checked (kubernetes release-1.36):

* ``staging/src/k8s.io/dynamic-resource-allocation/structured/internal/stable/allocator_stable.go``,
  ``allocateDevice``: a device without ``allowMultipleAllocations`` is given to one claim only;
  one with it gets a result with a fresh ``shareID`` and ``consumedCapacity``
  (``consumable_capacity.go``, ``CmpRequestOverCapacity``: the sum stays within capacity);
* the same file, ``checkAvailableCounters``: devices consuming ``sharedCounters`` are allocated
  only while the counter set has enough left (KEP-4815), so at most two 3g placements of one
  A100/H100 are ever allocated together;
* ``pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go``, ``PreBind`` /
  ``bindClaim``: the allocation is written to ``status.allocation`` and the pod added to
  ``status.reservedFor`` before the pod is bound."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice import devcluster
from gpuslice.devcluster import DevCluster, wait_until
from tests.cluster.conftest import DEPLOY
from tests.cluster.helpers import GROUP, Kube, bound, describe
from tests.dra.kubelet import DraClient, register
from tests.fake_mps import write_fake_mps

DRIVER = "gpu.gpuslice.io"
NS = "t-dra"
SHARE_NODE, WHOLE_NODE = "dra-share-mig", "dra-whole"
# node -> (GPUs of the fake inventory, --gpu-mode flags)
NODES: dict[str, tuple[list[dict[str, Any]], list[str]]] = {
    SHARE_NODE: ([{"model": "H100-SXM"}, {"model": "H100-SXM", "mig_enabled": True}],
                 ["0=share", "1=mig"]),
    WHOLE_NODE: ([{"model": "A100-80GB"}, {"model": "A100-80GB"}], []),
}


@dataclass
class DriverProc:
    node: str
    root: Path
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def kubelet_dir(self) -> Path:
        return self.root / "k"

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    def cdi_env(self, uid: str) -> list[dict[str, str]]:
        spec = json.loads((self.cdi_dir / f"k8s.{DRIVER}-claim_{uid}.json").read_text())
        return [dict(e.split("=", 1) for e in d["containerEdits"].get("env") or [])
                for d in spec["devices"]]


@dataclass
class DraCluster:
    dev: DevCluster
    kube: Kube
    drivers: dict[str, DriverProc] = field(default_factory=dict)

    @property
    def objects(self) -> Any:
        return self.kube.client.CustomObjectsApi(self.kube.api_client)

    def claims(self) -> dict[str, dict[str, Any]]:
        items = self.objects.list_namespaced_custom_object(
            "resource.k8s.io", "v1", NS, "resourceclaims")
        return {c["metadata"]["name"]: c for c in items["items"]}

    def slices(self) -> list[dict[str, Any]]:
        return list(self.objects.list_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices")["items"])

    def complete_pools(self) -> dict[str, list[dict[str, Any]]]:
        """Our pools as a consumer may use them: per pool, the slices of its newest generation,
        only once all ``resourceSliceCount`` of them are listed (types.go, ResourcePool: a
        pool is complete when every slice of its highest generation is seen; the driver
        publishes them one create at a time, so a list can fall between two)."""
        groups: dict[str, list[dict[str, Any]]] = {}
        for s in self.slices():
            if s["spec"]["driver"] == DRIVER:
                groups.setdefault(s["spec"]["pool"]["name"], []).append(s)
        out = {}
        for name, group in groups.items():
            gen = max(int(s["spec"]["pool"].get("generation") or 0) for s in group)
            newest = [s for s in group if int(s["spec"]["pool"].get("generation") or 0) == gen]
            if len(newest) == int(newest[0]["spec"]["pool"].get("resourceSliceCount") or 1):
                out[name] = newest
        return out


def _short_dir() -> Path:  # unix socket paths are limited to 107 bytes
    return Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))


def _start_driver(dev: DevCluster, node: str, kubeconfig: Path) -> DriverProc:
    gpus, modes = NODES[node]
    root = _short_dir()
    inv = root / "gpus.yaml"
    inv.write_text(yaml.safe_dump({"driver": "580.95.05", "gpus": gpus}))
    mps = write_fake_mps(root / "mps-control")
    log = dev.dir / f"dra-driver-{node}.log"
    argv = [sys.executable, "-m", "gpuslice.cli", "dra-driver", "--node", node,
            "--fake-gpus", str(inv), "--kubeconfig", str(kubeconfig),
            "--kubelet-dir", str(root / "k"), "--cdi-dir", str(root / "cdi"),
            "--mps-pipe-dir", str(root / "mps"), "--mps-binary", str(mps), "--metrics", "off",
            *[x for m in modes for x in ("--gpu-mode", m)]]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return DriverProc(node, root, proc, log)


@pytest.fixture(scope="module")
def dra(dev: DevCluster, kube: Kube) -> Iterator[DraCluster]:
    """deploy/dra's namespace, RBAC and DeviceClasses applied server-side (not the DaemonSet:
    kwok nodes run no containers), two kwok nodes in group ``t-dra`` and a driver process on
    each, on the driver's own service account."""
    dev.apply(DEPLOY / "dra" / "namespace.yaml")
    dev.apply(DEPLOY / "dra" / "rbac.yaml", "-n", "gpuslice-system")
    dev.apply(DEPLOY / "dra" / "deviceclasses.yaml")
    kube.create_namespace(NS)
    kube.add_nodes([devcluster.kwok_node(n, gpus=0, labels={GROUP: NS}) for n in NODES])
    sa = dev.service_account_kubeconfig("gpuslice-system", "gpuslice-dra-driver")
    c = DraCluster(dev, kube)
    try:
        for node in NODES:
            c.drivers[node] = _start_driver(dev, node, sa)

        def published() -> bool:
            for d in c.drivers.values():
                if d.proc.poll() is not None:
                    raise AssertionError(f"dra-driver on {d.node} exited:\n"
                                         f"{d.log.read_text(errors='replace')[-3000:]}")
            return set(NODES) <= set(c.complete_pools())

        wait_until("both drivers' complete ResourceSlice pools", published, 120, every_s=1.0)
        yield c
    finally:
        for d in c.drivers.values():
            if d.proc.poll() is None:
                d.proc.terminate()
                try:
                    d.proc.wait(20)
                except subprocess.TimeoutExpired:
                    d.proc.kill()
                    d.proc.wait(10)
            shutil.rmtree(d.root, ignore_errors=True)
        kube.cleanup_group(NS)
    assert all(d.proc.poll() is not None for d in c.drivers.values())


def _template(name: str, request: dict[str, Any], config: list[dict[str, Any]] | None = None,
              ) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": [{"name": "gpu", "exactly": request}]}
    if config:
        devices["config"] = config
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": NS}, "spec": {"spec": {"devices": devices}}}


def _example_templates() -> list[dict[str, Any]]:
    """deploy/dra/examples/claims.yaml's templates, unchanged (the quarter, the MIG 3g, the
    whole GPU), in the test's namespace."""
    docs = yaml.safe_load_all((DEPLOY / "dra" / "examples" / "claims.yaml").read_text())
    out = []
    for d in docs:
        if d and d["kind"] == "ResourceClaimTemplate":
            d["metadata"]["namespace"] = NS
            out.append(d)
    assert {d["metadata"]["name"] for d in out} == {"gpu-quarter", "mig-3g", "whole-gpu"}
    return out


def _pod(name: str, template: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"app": NS}},
            "spec": {"schedulerName": "default-scheduler",
                     "nodeSelector": {GROUP: NS},
                     "tolerations": [{"operator": "Exists"}],
                     "terminationGracePeriodSeconds": 0,
                     "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
                     "containers": [{"name": "server", "image": "registry.local/model:1",
                                     "resources": {"claims": [{"name": "gpu"}]}}]}}


def _claim_of(pod: dict[str, Any], claims: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (st,) = pod["status"]["resourceClaimStatuses"]
    return claims[st["resourceClaimName"]]


def _results(claim: dict[str, Any]) -> list[dict[str, Any]]:
    return list(claim["status"]["allocation"]["devices"]["results"])


def test_slices_keep_the_fields_of_all_three_models(dra: DraCluster) -> None:
    """What the API server stores (its gates drop fields they do not serve): shares with
    ``allowMultipleAllocations`` and request policies, MIG placements consuming counters of
    a counter slice, whole GPUs."""
    devices: dict[str, dict[str, Any]] = {}
    counters = []
    for s in (s for pool in dra.complete_pools().values() for s in pool):
        counters += [(s["spec"].get("nodeName"), c["name"])
                     for c in s["spec"].get("sharedCounters") or []]
        for d in s["spec"].get("devices") or []:
            devices[f"{s['spec']['pool']['name']}/{d['name']}"] = d
    share = devices[f"{SHARE_NODE}/gpu-0"]
    assert share["attributes"]["type"] == {"string": "share"}
    assert share.get("allowMultipleAllocations") is True, share
    assert "requestPolicy" in share["capacity"]["compute"], share["capacity"]
    migs = [d for k, d in devices.items() if k.startswith(f"{SHARE_NODE}/gpu-1-mig-")]
    assert migs and all(d.get("consumesCounters") for d in migs), migs[:2]
    assert counters, "no counter set published"
    assert {devices[f"{WHOLE_NODE}/gpu-{i}"]["attributes"]["type"]["string"]
            for i in (0, 1)} == {"gpu"}


def test_scheduler_allocates_all_three_models_and_the_driver_prepares_them(
        dra: DraCluster, kube: Kube) -> None:
    templates = [
        *_example_templates(),
        # a second share of the same GPU with other limits, and one that no longer fits
        _template("gpu-half", {"deviceClassName": "share.gpuslice.io",
                               "capacity": {"requests": {"compute": "50", "memory": "10Gi"}}}),
        _template("gpu-too-much", {"deviceClassName": "share.gpuslice.io",
                                   "capacity": {"requests": {"compute": "40",
                                                             "memory": "1Gi"}}}),
    ]
    for t in templates:
        dra.objects.create_namespaced_custom_object(
            "resource.k8s.io", "v1", NS, "resourceclaimtemplates", t)
    # MIG: an H100 holds two 3g placements, the third waits; whole: two GPUs, three pods
    pods = {"quarter": "gpu-quarter", "half": "gpu-half",
            "mig-a": "mig-3g", "mig-b": "mig-3g", "mig-c": "mig-3g",
            "whole-a": "whole-gpu", "whole-b": "whole-gpu", "whole-c": "whole-gpu"}
    kube.create(_pod(n, t) for n, t in pods.items())
    kube.wait_bound(NS, 6, timeout_s=240)
    # shares: 25 + 50 of the GPU's 100 compute are taken, a third of 40 does not fit
    pods["share-over"] = "gpu-too-much"
    kube.create([_pod("share-over", "gpu-too-much")])

    def unschedulable(ps: list[dict[str, Any]]) -> bool:
        return any(p["metadata"]["name"] == "share-over" and any(
            c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
            for c in (p.get("status") or {}).get("conditions") or []) for p in ps)

    placed = kube.wait_pods(NS, "share-over found unschedulable", unschedulable,
                            timeout_s=180)
    by_name = {p["metadata"]["name"]: p for p in bound(placed)}
    assert len(by_name) == 6, describe(placed)
    claims = dra.claims()

    # shares: same GPU, own shareIDs, consumed capacity as asked
    share_res = {n: _results(_claim_of(by_name[n], claims)) for n in ("quarter", "half")}
    for n, (compute, mem) in (("quarter", ("25", "20Gi")), ("half", ("50", "10Gi"))):
        (r,) = share_res[n]
        assert (r["driver"], r["pool"], r["device"]) == (DRIVER, SHARE_NODE, "gpu-0"), r
        assert r.get("shareID"), r
        assert r["consumedCapacity"]["compute"] == compute, r
        assert r["consumedCapacity"]["memory"] == mem, r
    assert share_res["quarter"][0]["shareID"] != share_res["half"][0]["shareID"]

    # MIG: two 3g placements of the one MIG GPU, different placements; whole: different GPUs
    migs = sorted({by_name[n]["metadata"]["name"] for n in by_name if n.startswith("mig-")})
    mig_devs = [_results(_claim_of(by_name[n], claims))[0]["device"] for n in migs]
    assert len(migs) == 2 and len(set(mig_devs)) == 2, mig_devs
    assert all(d.startswith("gpu-1-mig-3g") for d in mig_devs), mig_devs
    wholes = sorted(n for n in by_name if n.startswith("whole-"))
    whole_devs = [(r["pool"], r["device"]) for n in wholes
                  for r in _results(_claim_of(by_name[n], claims))]
    assert len(wholes) == 2 and len(set(whole_devs)) == 2, whole_devs
    assert all(pool == WHOLE_NODE for pool, _ in whole_devs)

    # the third of each waits: the scheduler did not over-allocate
    waiting = {n for n in pods if n not in by_name}
    assert len(waiting) == 3 and {n.split("-")[0] for n in waiting} == \
        {"share", "mig", "whole"}, waiting
    pods_now = {p["metadata"]["name"]: p for p in kube.pods(NS)}
    for n in waiting:
        for st in (pods_now[n].get("status") or {}).get("resourceClaimStatuses") or []:
            c = claims.get(st.get("resourceClaimName") or "")
            assert c is None or not (c.get("status") or {}).get("allocation"), c

    # reservedFor names the pod; the allocation's node selector is the pod's node
    for n, p in by_name.items():
        c = _claim_of(p, claims)
        assert [r["name"] for r in c["status"].get("reservedFor") or []] == [n]

    # play the kubelet: register with each node's driver, prepare the node's claims
    prepared: dict[str, tuple[DriverProc, str, Any]] = {}
    for node, d in dra.drivers.items():
        mine = [(n, _claim_of(p, claims)) for n, p in by_name.items()
                if p["spec"]["nodeName"] == node]
        if not mine:
            continue
        reg = register(d.kubelet_dir / "plugins_registry" / f"{DRIVER}-reg.sock")
        assert reg.name == DRIVER and reg.version == "v1.DRAPlugin"
        client = DraClient(reg)
        try:
            refs = [(c["metadata"]["namespace"], c["metadata"]["uid"], c["metadata"]["name"])
                    for _, c in mine]
            got = client.prepare(refs)
            for (n, _c), ref in zip(mine, refs, strict=True):
                ans = got[ref[1]]
                assert ans.error == "", (n, ans.error, d.log.read_text()[-2000:])
                prepared[n] = (d, ref[1], ans)
            # idempotent: the same answer again
            again = client.prepare(refs)
            assert {u: list(a.devices[0].cdi_device_ids) for u, a in again.items()} == \
                {u: list(a.devices[0].cdi_device_ids) for u, a in got.items()}
        finally:
            client.close()
    assert set(prepared) == set(by_name)

    # CDI: each share its own caps; one MPS pipe directory for the GPU
    (eq,) = prepared["quarter"][0].cdi_env(prepared["quarter"][1])
    (eh,) = prepared["half"][0].cdi_env(prepared["half"][1])
    assert (eq["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"],
            eq["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == ("25", "0=20480M")
    assert (eh["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"],
            eh["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == ("50", "0=10240M")
    assert eq["CUDA_MPS_PIPE_DIRECTORY"] == eh["CUDA_MPS_PIPE_DIRECTORY"]
    assert eq["GPUSLICE_DEVICE"] == eh["GPUSLICE_DEVICE"] == "gpu-0"
    assert (eq["GPUSLICE_SHARE"], eh["GPUSLICE_SHARE"]) == (
        share_res["quarter"][0]["shareID"], share_res["half"][0]["shareID"])
    # MIG: a MIG instance each (its UUID, not the parent's), different instances
    mig_vis = [prepared[n][0].cdi_env(prepared[n][1])[0]["CUDA_VISIBLE_DEVICES"] for n in migs]
    assert all(v.startswith("MIG-") for v in mig_vis) and len(set(mig_vis)) == 2, mig_vis
    # whole GPUs: the GPU itself, no MPS caps
    for n in wholes:
        (e,) = prepared[n][0].cdi_env(prepared[n][1])
        assert e["CUDA_VISIBLE_DEVICES"].startswith(f"GPU-{WHOLE_NODE}-")
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in e
    assert len({prepared[n][0].cdi_env(prepared[n][1])[0]["CUDA_VISIBLE_DEVICES"]
                for n in wholes}) == 2

    # freeing a whole GPU lets the waiting whole-GPU pod have it
    kube.core.delete_namespaced_pod("whole-a", NS, grace_period_seconds=0)
    kube.wait_pods(NS, "whole-c bound after whole-a left", lambda ps: any(
        p["metadata"]["name"] == "whole-c" and p["spec"].get("nodeName") for p in ps),
        timeout_s=180)
