"""Helpers of the node tier: the node agent as a host process on the real kubelet, stand-in
NVIDIA device nodes for fake GPUs, and pods whose log says what their container saw."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpuslice.devcluster import DevCluster, wait_until
from gpuslice.devcluster.realnode import BUSYBOX, STATE_DIR, RealNode, make_stand_in_devices

DEV_DIR = STATE_DIR / "dev"  # stand-in /dev/nvidia* (c 1 3, /dev/null's numbers)
MPS_PIPE = STATE_DIR / "mps"
MPS_SHM = STATE_DIR / "mps-shm"
NS = "default"
END = "END-OF-REPORT"
# what a test container prints: its environment, its /dev, its mounts of interest
REPORT = ("env | sort; echo '--- dev'; ls -ln /dev /var/run/nvidia-container-devices 2>&1; "
          "echo '--- mounts'; cat /proc/self/mountinfo; echo " + END + "; ")


def fake_inventory(path: Path, gpus: int = 2, model: str = "A100-80GB",
                   mig: str | None = None, faults: dict[int, list[int]] | None = None) -> Path:
    """A stand-in inventory; ``faults``: GPU index -> XIDs it reports at the agent's start."""
    doc: dict[str, Any] = {"gpus": [{"model": model, **({"mig": mig} if mig else {}),
                                     **({"faults": faults[i]} if faults and i in faults
                                        else {})}
                                    for i in range(gpus)]}
    path.write_text(yaml.safe_dump(doc))
    return path


def make_dev_dir(gpus: int = 8) -> Path:
    """Stand-in NVIDIA device nodes in :data:`DEV_DIR`."""
    return make_stand_in_devices(DEV_DIR, gpus)


@dataclass
class Report:
    """What a container printed (:data:`REPORT`)."""

    text: str

    @property
    def env(self) -> dict[str, str]:
        head = self.text.split("--- dev", 1)[0]
        return dict(line.split("=", 1) for line in head.splitlines() if "=" in line)

    @property
    def dev(self) -> str:
        return self.text.split("--- dev", 1)[1].split("--- mounts", 1)[0]

    def char_devices(self) -> dict[str, tuple[int, int]]:
        """/dev entries that are character devices: name -> (major, minor)."""
        out = {}
        for line in self.dev.splitlines():
            parts = line.split()
            if line.startswith("c") and len(parts) >= 10:
                out[parts[-1]] = (int(parts[4].rstrip(",")), int(parts[5]))
        return out

    @property
    def mount_points(self) -> list[str]:
        body = self.text.split("--- mounts", 1)[1].split(END, 1)[0]
        return [line.split()[4] for line in body.splitlines() if len(line.split()) > 4]


@dataclass
class NodeEnv:
    dev: DevCluster
    node: RealNode
    key: Path
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    # -- the node agent ------------------------------------------------------------------

    def start_agent(self, *args: str, gpus: int = 2, model: str = "A100-80GB",
                    mig: str | None = None,
                    faults: dict[int, list[int]] | None = None) -> subprocess.Popen[bytes]:
        """``gpuslice node-agent --fake`` on the real kubelet's device plugin folder and
        PodResources socket, as its service account; returns once the node's allocatable
        carries the GPUs."""
        inv = fake_inventory(self.dev.dir / f"inventory-{len(self.agents)}.yaml", gpus, model,
                             mig, faults)
        make_dev_dir()
        MPS_PIPE.mkdir(parents=True, exist_ok=True)
        kubeconfig = self.dev.service_account_kubeconfig("gpuslice-system",
                                                         "gpuslice-node-agent")
        log = self.dev.dir / f"node-agent-{len(self.agents)}.log"
        self.logs.append(log)
        with log.open("wb") as out:
            p = subprocess.Popen(
                [sys.executable, "-m", "gpuslice.cli", "node-agent", "--node", self.node.name,
                 "--key-file", str(self.key), "--fake-gpus", str(inv), "--metrics", "off",
                 "--dev-dir", str(DEV_DIR), "--mps-pipe-dir", str(MPS_PIPE),
                 "--mps-shm-dir", str(MPS_SHM), "--kubeconfig", str(kubeconfig), *args],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        self.agents.append(p)
        wait_until("node agent: gpuslice.io/gpu on the real node",
                   lambda: int(self.allocatable().get("gpuslice.io/gpu", "0")) > 0, 60, p, log)
        return p

    def stop_agent(self, p: subprocess.Popen[bytes], kill: bool = False) -> None:
        """Stop it and wait until the kubelet counts its devices unhealthy (allocatable 0:
        the plugin's endpoint is gone), so that the next agent's devices are told apart."""
        if p.poll() is None:
            p.kill() if kill else p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        wait_until("the kubelet: the stopped plugin's devices unhealthy",
                   lambda: int(self.allocatable().get("gpuslice.io/gpu", "0")) == 0, 60)

    def agent_log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs if p.exists())

    def close(self) -> None:
        for p in self.agents:
            if p.poll() is None:
                self.stop_agent(p)

    # -- the node and its pods -----------------------------------------------------------

    def node_obj(self) -> dict[str, Any]:
        return dict(json.loads(self.dev.kubectl("get", "node", self.node.name, "-o",
                                                "json").stdout))

    def allocatable(self) -> dict[str, str]:
        return dict(self.node_obj()["status"].get("allocatable") or {})

    def pod(self, name: str) -> dict[str, Any]:
        return dict(json.loads(self.dev.kubectl("get", "pod", name, "-n", NS, "-o",
                                                "json").stdout))

    def create(self, pod: dict[str, Any]) -> None:
        self.dev.kubectl("create", "-f", "-", input=json.dumps(pod))

    def wait_running(self, name: str, timeout_s: float = 120.0) -> dict[str, Any]:
        def running() -> bool:
            return str(self.pod(name)["status"].get("phase")) in ("Running", "Succeeded")

        try:
            wait_until(f"pod {name} running", running, timeout_s, every_s=0.5)
        except Exception as exc:
            raise AssertionError(f"{exc}\n{self.describe(name)}") from None
        return self.pod(name)

    def report(self, name: str, container: str | None = None,
               timeout_s: float = 60.0) -> Report:
        self.wait_running(name)
        args = ["logs", name, "-n", NS] + (["-c", container] if container else [])
        out: list[str] = [""]

        def done() -> bool:
            out[0] = self.dev.kubectl(*args, check=False).stdout
            return END in out[0]

        try:
            wait_until(f"pod {name}: its report", done, timeout_s, every_s=0.5)
        except Exception as exc:
            err = self.dev.kubectl(*args, check=False)
            raise AssertionError(f"{exc}\nlogs: {err.stdout[-1500:]}{err.stderr[-500:]}\n"
                                 f"{self.describe(name)}") from None
        return Report(out[0])

    def delete(self, *names: str, timeout_s: float = 60.0) -> None:
        self.dev.kubectl("delete", "pod", "-n", NS, "--grace-period=1", "--wait=true",
                         f"--timeout={int(timeout_s)}s", *names, timeout_s=timeout_s + 30)

    def describe(self, name: str) -> str:
        res = self.dev.kubectl("describe", "pod", name, "-n", NS, check=False)
        return res.stdout[-3000:] + "\n--- node agent ---\n" + self.agent_log()[-3000:]


def claim_pod(name: str, claims: dict[str, str]) -> dict[str, Any]:
    """A busybox pod on the real node (default scheduler) with one container using the
    ResourceClaimTemplates ``claims`` (pod claim name -> template)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
            "spec": {"terminationGracePeriodSeconds": 1,
                     "nodeSelector": {"gpuslice.io/dev-node": "real"},
                     "resourceClaims": [{"name": n, "resourceClaimTemplateName": t}
                                        for n, t in claims.items()],
                     "containers": [{
                         "name": "c", "image": BUSYBOX, "imagePullPolicy": "Never",
                         "command": ["sh", "-c", REPORT + "sleep 3600"],
                         "resources": {"claims": [{"name": n} for n in claims]}}]}}


def busybox_pod(name: str, *, milli: int = 1000, memory: int | None = None, gpus: int = 1,
             containers: int = 1, init: bool = False, isolation: str | None = None,
             scheduler: str = "gpuslice-scheduler") -> dict[str, Any]:
    """A pod of the busybox image on the real node that prints :data:`REPORT` and sleeps.
    Every container asks for the same GPU slice; ``init``: an init container does too."""
    limits = {"gpuslice.io/gpu": str(gpus), "gpuslice.io/gpu-milli": str(milli)}
    if memory is not None:
        limits["gpuslice.io/gpu-memory"] = str(memory)

    def container(n: str, sleep: bool = True) -> dict[str, Any]:
        return {"name": n, "image": BUSYBOX, "imagePullPolicy": "Never",
                "command": ["sh", "-c", REPORT + ("sleep 3600" if sleep else "true")],
                "resources": {"limits": limits}}

    spec: dict[str, Any] = {
        "schedulerName": scheduler, "terminationGracePeriodSeconds": 1,
        "nodeSelector": {"gpuslice.io/dev-node": "real"},
        "containers": [container(f"c{i}") for i in range(containers)]}
    if init:
        spec["initContainers"] = [container("warmup", sleep=False)]
    ann = {"gpuslice.io/isolation": isolation} if isolation else {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "annotations": ann}, "spec": spec}


def since(t0: float) -> float:
    return time.monotonic() - t0


def kubectl_json(env: NodeEnv, *args: str) -> Any:
    return json.loads(env.dev.kubectl(*args, "-o", "json").stdout)


def wait_ready(env: NodeEnv, what: str, selector: str, count: int = 1,
               timeout_s: float = 240, namespace: str = "gpuslice-system") -> None:
    """Until ``count`` pods of ``selector`` in ``namespace`` are Ready; on time-out, their
    description and logs in the error."""
    def ready() -> bool:
        pods = kubectl_json(env, "get", "pods", "-n", namespace, "-l", selector)["items"]
        return sum(any(c["type"] == "Ready" and c["status"] == "True"
                       for c in p["status"].get("conditions") or []) for p in pods) >= count

    try:
        wait_until(what, ready, timeout_s, every_s=1.0)
    except Exception as exc:
        out = env.dev.kubectl("describe", "pods", "-n", namespace, "-l", selector, check=False)
        logs = env.dev.kubectl("logs", "-n", namespace, "-l", selector, "--tail=30",
                               "--all-containers", check=False)
        raise AssertionError(f"{exc}\n{out.stdout[-4000:]}\n{logs.stdout[-3000:]}"
                             f"{logs.stderr[-500:]}") from None
