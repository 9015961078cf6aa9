"""The DRA driver on the real kubelet's DRA manager and containerd's CDI: ResourceClaims of
every device model (a share with consumable capacity and MPS caps, a MIG partition, a whole
GPU) allocated by the real kube-scheduler, prepared when the pod starts (NodePrepareResources
from kubernetes pkg/kubelet/cm/dra/manager.go, ``PrepareResources``), the CDI devices injected
by containerd into the container (the container reads its own caps), and unprepared when the
pod is deleted (``UnprepareResources``) -- also across a kubelet restart and a driver
restart."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice.devcluster import wait_until
from tests.node.conftest import DEPLOY
from tests.node.helpers import DEV_DIR, MPS_PIPE, MPS_SHM, NS, NodeEnv, claim_pod, make_dev_dir

DRIVER = "gpu.gpuslice.io"
CDI_DIR = Path("/var/run/cdi")
PLUGIN_DIR = Path("/var/lib/kubelet/plugins") / DRIVER
INVENTORY = {"driver": "580.95.05", "gpus": [
    {"model": "H100-SXM"}, {"model": "H100-SXM", "mig_enabled": True}, {"model": "A100-80GB"}]}


def share_template(name: str, compute: str, memory: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "share.gpuslice.io",
                "capacity": {"requests": {"compute": compute, "memory": memory}}}}]}}}}


class Driver:
    def __init__(self, env: NodeEnv) -> None:
        self.env, self.starts = env, 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.inv = env.dev.dir / "dra-gpus.yaml"
        self.inv.write_text(yaml.safe_dump(INVENTORY))
        self.kubeconfig = env.dev.service_account_kubeconfig("gpuslice-system",
                                                             "gpuslice-dra-driver")

    @property
    def log(self) -> Path:
        return self.env.dev.dir / f"dra-driver-{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        make_dev_dir(len(INVENTORY["gpus"]))
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpuslice.cli", "dra-driver", "--node",
                 self.env.node.name, "--fake-gpus", str(self.inv), "--kubeconfig",
                 str(self.kubeconfig), "--mode", "whole", "--gpu-mode", "0=share",
                 "--gpu-mode", "1=mig", "--dev-dir", str(DEV_DIR), "--mps-pipe-dir",
                 str(MPS_PIPE), "--mps-shm-dir", str(MPS_SHM), "--lease", "none",
                 "--metrics", "off"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        wait_until("dra-driver registered with the kubelet",
                   lambda: "registered with the kubelet" in self.log.read_text(), 60,
                   self.proc, self.log)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)

    def text(self) -> str:
        return "\n".join((self.env.dev.dir / f"dra-driver-{i}.log").read_text(errors="replace")
                         for i in range(1, self.starts + 1))


@pytest.fixture(scope="module")
def driver(env: NodeEnv) -> Iterator[Driver]:
    env.dev.apply(DEPLOY / "dra" / "namespace.yaml")
    env.dev.apply(DEPLOY / "dra" / "rbac.yaml", "-n", "gpuslice-system")
    env.dev.apply(DEPLOY / "dra" / "deviceclasses.yaml")
    docs = [d for d in yaml.safe_load_all((DEPLOY / "dra" / "examples" / "claims.yaml")
                                          .read_text()) if d and d["kind"] ==
            "ResourceClaimTemplate"]
    for d in [*docs, share_template("gpu-half", "50", "16Gi")]:
        d["metadata"]["namespace"] = NS
        env.dev.apply(json.dumps(d))
    d = Driver(env)
    d.start()

    def published() -> bool:
        out = env.dev.kubectl("get", "resourceslices", "-o", "json").stdout
        return any(s["spec"].get("nodeName") == env.node.name
                   for s in json.loads(out)["items"])

    wait_until("the driver's ResourceSlices", published, 60, d.proc, d.log)
    yield d
    d.stop()


def claim_uids(env: NodeEnv, pod: str) -> list[str]:
    names = [s["resourceClaimName"] for s in
             env.pod(pod)["status"].get("resourceClaimStatuses") or []]
    return [json.loads(env.dev.kubectl("get", "resourceclaim", n, "-n", NS, "-o", "json")
                       .stdout)["metadata"]["uid"] for n in names]


def cdi_specs() -> set[str]:
    return {p.name for p in CDI_DIR.glob(f"k8s.{DRIVER}-claim_*.json")}


def test_every_device_model_reaches_the_container_and_is_unprepared(
        env: NodeEnv, driver: Driver) -> None:
    pods = {"dra-quarter": "gpu-quarter", "dra-half": "gpu-half", "dra-mig": "mig-3g",
            "dra-whole": "whole-gpu"}
    for pod, template in pods.items():
        env.create(claim_pod(pod, {"gpu": template}))
    reports = {p: env.report(p) for p in pods}
    uids = {p: claim_uids(env, p) for p in pods}
    # two shares of one GPU, each held to its own caps (read inside the container)
    q, h = reports["dra-quarter"].env, reports["dra-half"].env
    assert q["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25", reports["dra-quarter"].text
    assert h["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert q["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    assert h["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=16384M"
    assert q["CUDA_VISIBLE_DEVICES"] == h["CUDA_VISIBLE_DEVICES"]
    assert q["GPUSLICE_SHARE"] != h["GPUSLICE_SHARE"]
    assert "/dev/shm" in reports["dra-quarter"].mount_points
    assert q["CUDA_MPS_PIPE_DIRECTORY"] in reports["dra-quarter"].mount_points
    # MIG: the instance the driver made, its capability nodes injected
    mig = reports["dra-mig"]
    assert mig.env["CUDA_VISIBLE_DEVICES"].startswith("MIG-"), mig.text
    assert "nvidia-caps" in mig.dev
    # whole GPU: the GPU and its device node (a stand-in: /dev/null's numbers)
    whole = reports["dra-whole"]
    assert whole.env["CUDA_VISIBLE_DEVICES"].startswith("GPU-")
    devs = whole.char_devices()
    assert devs.get("nvidiactl") == (1, 3) and any(
        n.startswith("nvidia") and n[6:].isdigit() for n in devs), whole.dev
    assert len(cdi_specs()) == 4
    env.delete(*pods)

    def unprepared() -> bool:
        return not cdi_specs()

    wait_until("CDI specs removed on unprepare", unprepared, 60)
    checkpoint = (PLUGIN_DIR / "checkpoint.json").read_text()
    assert not any(u in checkpoint for us in uids.values() for u in us)
    assert "NodeUnprepareResources" in driver.text()


def test_prepare_and_unprepare_across_kubelet_and_driver_restarts(
        env: NodeEnv, driver: Driver) -> None:
    env.create(claim_pod("dra-r1", {"gpu": "gpu-quarter"}))
    env.report("dra-r1")
    # the kubelet restarts: the driver registers again; a running pod keeps its devices,
    # a new one is prepared
    env.node.restart_kubelet()
    wait_until("the driver registered again", lambda: driver.text().count(
        "registered with the kubelet") >= 2, 60)
    env.create(claim_pod("dra-r2", {"gpu": "gpu-half"}))
    assert env.report("dra-r2").env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert env.pod("dra-r1")["status"]["containerStatuses"][0]["restartCount"] == 0
    # the driver restarts: its checkpoint lets it unprepare what the old one prepared
    driver.stop()
    driver.start()
    env.delete("dra-r1", "dra-r2")
    wait_until("CDI specs removed after the restarts", lambda: not cdi_specs(), 60)
    assert "NodeUnprepareResources" in driver.log.read_text()


def test_a_frozen_api_server_bounds_prepare_and_never_starves_unprepare(
        env: NodeEnv, driver: Driver) -> None:
    """kube-apiserver SIGSTOPped (connections hang): prepares of claims the driver must read
    answer each claim an error inside the driver's budget (20 s, under the kubelet's 45 s:
    kubernetes pkg/kubelet/cm/dra/plugin/dra_plugin.go's default timeout), while unprepare
    (from the checkpoint) and registration keep answering at once; after SIGCONT a new pod's
    claim is prepared by the real kubelet and deleted pods are unprepared."""
    import threading
    import time
    import uuid

    import grpc

    from gpuslice.adapters.kubelet import pluginregistration_v1_pb2 as rpb
    from gpuslice.adapters.kubelet import pluginregistration_v1_pb2_grpc as rpbg
    from tests.dra.kubelet import DraClient, register

    reg_socket = Path("/var/lib/kubelet/plugins_registry") / f"{DRIVER}-reg.sock"
    env.create(claim_pod("dra-f1", {"gpu": "gpu-quarter"}))
    env.report("dra-f1")
    [uid] = claim_uids(env, "dra-f1")
    claim_name = env.pod("dra-f1")["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    client = DraClient(register(reg_socket))
    answers: dict[str, tuple[float, str]] = {}
    env.dev.freeze_apiserver()
    try:
        t0 = time.monotonic()

        def prepare(i: int) -> None:
            ghost = str(uuid.uuid4())
            out = client.prepare([(NS, ghost, f"ghost-{i}")])
            answers[ghost] = (time.monotonic() - t0, out[ghost].error)

        threads = [threading.Thread(target=prepare, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # the four prepares are waiting on the frozen API server
        t1 = time.monotonic()
        assert client.unprepare([(NS, uid, claim_name)]) == {uid: ""}
        unprepare_s = time.monotonic() - t1
        t2 = time.monotonic()
        with grpc.insecure_channel(f"unix://{reg_socket}") as ch:
            info = rpbg.RegistrationStub(ch).GetInfo(rpb.InfoRequest(), timeout=5)
        assert info.name == DRIVER
        info_s = time.monotonic() - t2
        for t in threads:
            t.join(60)
        assert unprepare_s < 2.0 and info_s < 2.0, (unprepare_s, info_s)
        assert len(answers) == 4
        for took, error in answers.values():
            assert error and "did not answer" in error, error
            assert took < 30.0, answers  # the budget (20 s) plus slack, inside the 45 s
    finally:
        env.dev.thaw_apiserver()
        client.close()
    # everything catches up: the real kubelet prepares a new claim, unprepares deleted pods
    env.create(claim_pod("dra-f2", {"gpu": "gpu-half"}))
    assert env.report("dra-f2", timeout_s=120).env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    env.delete("dra-f1", "dra-f2")
    wait_until("CDI specs removed after the outage", lambda: not cdi_specs(), 60)


def test_after_a_reboot_the_driver_restores_its_claims_and_the_pod_runs_again(
        env: NodeEnv, driver: Driver) -> None:
    """A reboot on the real node: the kubelet, containerd and the driver stop, every
    container dies, and what a tmpfs and the GPU lose goes (the claims' CDI specs in
    /var/run/cdi, the MPS daemons and their folders; the stand-in GPUs' state lives in the
    driver's process). The driver's checkpoint survives. When all start again, the kubelet
    starts the pod anew with the CDI devices it holds for its claim: the driver restores them
    at start, and the container sees its caps again (before, it never started: the CDI
    devices did not resolve)."""
    import contextlib
    import os
    import shutil
    import signal

    env.create(claim_pod("dra-reboot", {"gpu": "gpu-quarter"}))
    assert env.report("dra-reboot").env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    [uid] = claim_uids(env, "dra-reboot")

    def erase() -> None:
        assert driver.proc is not None
        driver.proc.kill()  # a reboot gives no SIGTERM
        driver.proc.wait(20)
        for spec in CDI_DIR.glob(f"k8s.{DRIVER}-claim_*.json"):
            spec.unlink()
        for pidfile in MPS_PIPE.glob("*/nvidia-cuda-mps-control.pid"):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
        shutil.rmtree(MPS_PIPE, ignore_errors=True)

    env.node.simulate_reboot(erase)
    driver.start()
    assert any(uid in name for name in cdi_specs())

    def restarted() -> bool:
        st = (env.pod("dra-reboot")["status"].get("containerStatuses") or [{}])[0]
        return st.get("restartCount", 0) >= 1 and "running" in (st.get("state") or {})

    try:
        wait_until("the pod running again after the reboot", restarted, 180, every_s=1.0)
    except Exception as exc:
        raise AssertionError(f"{exc}\n{env.describe('dra-reboot')}\n{driver.text()[-3000:]}"
                             ) from None
    assert env.report("dra-reboot").env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert "restored the effects of" in driver.text()
    env.delete("dra-reboot")
    wait_until("its CDI spec removed", lambda: not any(uid in n for n in cdi_specs()), 60)
