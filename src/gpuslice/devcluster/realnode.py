"""A real node beside the dev cluster's kwok nodes: containerd and the kubelet on this host.

containerd (CRI, CDI on, a CNI bridge) and the kubelet come from ``tools/node/build.sh`` (their
official Go modules, pinned); no registry is needed: the build's pause and busybox images are
imported into containerd and the sandbox image is pinned. Facts this relies on:

- kubelet 1.35+ refuses cgroup v1 unless ``failCgroupV1: false``; no systemd here, so
  ``cgroupDriver: cgroupfs``; swap may be on (``failSwapOn: false``).
- A host without CAP_SYS_RESOURCE cannot lower a process's oom_score_adj: containerd's
  ``restrict_oom_score_adj`` keeps runc from trying (else "can't get final child's PID").
- The device plugin socket folder is a kubelet constant (``/var/lib/kubelet/device-plugins``),
  so the kubelet keeps its default root folder and one real node runs per host.

Everything it changes on the host is recorded first (:mod:`.host`) and undone by
:func:`teardown`, which ``gpuslice dev-cluster down`` also calls from another process.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from gpuslice.core.errors import GpusliceError
from gpuslice.devcluster import host
from gpuslice.devcluster.procs import (
    FEATURE_GATES,
    KUBELET_CLIENT_USER,
    Proc,
    build_output,
    free_port,
    host_ip,
    http_get,
    wait_until,
)

if TYPE_CHECKING:
    from gpuslice.devcluster.cluster import DevCluster

NODE_NAME = "gpuslice-real-node"
NODE_LABEL = "gpuslice.io/dev-node"  # =real on the real node
STATE_DIR = Path("/run/gpuslice-node")  # containerd's state and socket, CNI IPAM
ROOT_DIR = Path("/var/lib/gpuslice-node")  # containerd's images and snapshots
SOCKET = STATE_DIR / "containerd.sock"
KUBELET_DIR = Path("/var/lib/kubelet")
KUBELET_HEALTHZ = "http://127.0.0.1:10248/healthz"
BRIDGE = "gpuslice0"
POD_SUBNET = "10.89.0.0/16"
CLUSTER_DOMAIN = "cluster.local"
CNI_DIRS = ("/usr/lib/cni", "/opt/cni/bin")
CNI_PLUGINS = ("bridge", "host-local", "loopback")
NODE_BINARIES = ("containerd", "containerd-shim-runc-v2", "ctr", "kubelet", "kube-proxy",
                 "coredns")
IMAGES = ("pause.tar", "busybox.tar")
SCHEDULER_IMAGE = "kube-scheduler.tar"  # localhost/kube-scheduler:v1.36.3, for the chart
BUSYBOX = "localhost/busybox:test"  # tools/node/build.sh's busybox_ref
KUBE_SCHEDULER = "localhost/kube-scheduler:v1.36.3"  # its scheduler_ref
PAUSE = "registry.k8s.io/pause:3.10.1"  # tools/node/build.sh's pause_ref


def find_node_dir(repo: Path | None = None) -> Path:
    """``$GPUSLICE_NODE_DIR``, else what ``tools/node/build.sh --dir`` names."""
    return build_output("GPUSLICE_NODE_DIR",
                        (repo or Path.cwd()) / "tools" / "node" / "build.sh", "--dir")


def make_stand_in_devices(folder: Path, gpus: int) -> Path:
    """Character devices with /dev/null's numbers (c 1 3) named as the NVIDIA driver's, for
    fake GPUs whose CDI specs and device plugin responses name device nodes: the control
    nodes, ``nvidia0..``, and the MIG capability nodes as the fake NVML numbers them
    (1 + 100 * minor + 2 * GI ...)."""
    import stat

    (folder / "nvidia-caps").mkdir(parents=True, exist_ok=True)
    caps = [f"nvidia-caps/nvidia-cap{i}" for i in range(1, 100 * gpus + 20)]
    for name in ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools",
                 *(f"nvidia{i}" for i in range(gpus)), *caps]:
        if not (folder / name).exists():
            os.mknod(folder / name, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return folder


def missing_prerequisites(node_dir: Path) -> list[str]:
    """What this host lacks to run a real node (empty: it can)."""
    out = []
    if os.geteuid() != 0:
        out.append("root (the kubelet and containerd manage mounts, cgroups and iptables)")
    out += [f"{node_dir}/bin/{b} (tools/node/build.sh)" for b in NODE_BINARIES
            if not os.access(node_dir / "bin" / b, os.X_OK)]
    out += [f"{node_dir}/images/{i} (tools/node/build.sh)" for i in (*IMAGES, SCHEDULER_IMAGE)
            if not (node_dir / "images" / i).is_file()]
    if shutil.which("runc") is None:
        out.append("runc (apt-get install runc)")
    if shutil.which("iptables") is None:
        out.append("iptables (apt-get install iptables)")
    if _cni_dir() is None:
        out.append(f"CNI plugins {', '.join(CNI_PLUGINS)} in {' or '.join(CNI_DIRS)} "
                   "(apt-get install containernetworking-plugins)")
    return out


def _cni_dir() -> str | None:
    return next((d for d in CNI_DIRS if all(os.access(f"{d}/{p}", os.X_OK)
                                            for p in CNI_PLUGINS)), None)


def _cgroup_v1() -> bool:
    return not (host.CGROUP_ROOT / "cgroup.controllers").exists()


@dataclass
class NodeState:
    """What :func:`teardown` needs, kept in ``<folder>/node.json``."""

    name: str
    folder: str
    node_dir: str
    kubeconfig: str  # the admin kubeconfig of the cluster
    pids: dict[str, int] = field(default_factory=dict)

    def write(self) -> None:
        Path(self.folder, "node.json").write_text(json.dumps(self.__dict__, indent=1))

    @classmethod
    def read(cls, folder: Path) -> NodeState:
        return cls(**json.loads((folder / "node.json").read_text()))


class RealNode:
    """containerd + the kubelet registered with ``cluster`` as node ``name``. Start with
    :meth:`start`; :meth:`stop` deletes its pods, stops both and restores the host."""

    def __init__(self, cluster: DevCluster, node_dir: Path, name: str = NODE_NAME,
                 ready_timeout_s: float = 180.0, network: bool = False) -> None:
        """``network``: also Services for pods (kube-proxy, and CoreDNS as the kubelet's
        cluster DNS), which needs the cluster's ``pod_network`` and tools/node/build.sh's
        ``net`` binaries."""
        self.cluster, self.node_dir, self.name = cluster, node_dir, name
        self.network = network
        self.folder = cluster.dir / "node"
        self.ready_timeout_s = ready_timeout_s
        self.procs: dict[str, Proc] = {}
        self.state = NodeState(name, str(self.folder), str(node_dir), str(cluster.kubeconfig))

    def bin(self, name: str) -> str:
        return str(self.node_dir / "bin" / name)

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        res = subprocess.run([self.bin("ctr"), "--address", str(SOCKET), "-n", "k8s.io",
                              *args], capture_output=True, text=True, timeout=120,
                             check=False)
        if check and res.returncode != 0:
            raise GpusliceError(f"ctr {' '.join(args)}: {res.stderr.strip()[-400:]}")
        return res

    # -- start ---------------------------------------------------------------------------

    def start(self) -> RealNode:
        missing = missing_prerequisites(self.node_dir)
        if missing:
            raise GpusliceError("the real node needs: " + "; ".join(missing))
        if SOCKET.exists() or (KUBELET_DIR / "device-plugins" / "kubelet.sock").exists():
            raise GpusliceError(f"a kubelet or node already runs on this host ({SOCKET} or "
                                f"{KUBELET_DIR}/device-plugins/kubelet.sock exists): stop it "
                                "first (gpuslice dev-cluster down)")
        self.folder.mkdir(parents=True, exist_ok=True)
        # the host as it is, before anything changes it: what teardown restores
        (self.folder / "host-before.json").write_text(json.dumps(host.snapshot().to_json()))
        self.state.write()
        if self.cluster.real_node is not None:
            raise GpusliceError(f"the cluster already has the real node "
                                f"{self.cluster.real_node.name}")
        self.cluster.real_node = self  # stopped first by DevCluster.stop
        try:
            self._start_containerd()
            self._import_images()
            self._start_kubelet(first=True)
            if self.network:
                self._start_network()
        except BaseException:
            self.cluster.real_node = None
            self.stop()
            raise
        self.cluster.write_state()
        return self

    def _start_containerd(self) -> None:
        cni_conf = self.folder / "cni"
        cni_conf.mkdir(exist_ok=True)
        (cni_conf / "10-gpuslice.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "gpuslice-dev", "plugins": [{
                "type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False,
                "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]],
                         "routes": [{"dst": "0.0.0.0/0"}],
                         "dataDir": str(STATE_DIR / "ipam")}}]}))
        runc = shutil.which("runc")
        config = self.folder / "containerd.toml"
        config.write_text(f"""version = 3
root = '{ROOT_DIR}/containerd'
state = '{STATE_DIR}/containerd'
[grpc]
  address = '{SOCKET}'
[ttrpc]
  address = '{SOCKET}.ttrpc'
[plugins.'io.containerd.internal.v1.opt']
  path = '{ROOT_DIR}/opt'
[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{PAUSE}'
[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = ['/etc/cdi', '/var/run/cdi']
  # without CAP_SYS_RESOURCE runc cannot lower oom_score_adj (the sandbox asks for -998)
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
    BinaryName = '{runc}'
    SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['{_cni_dir()}']
    conf_dir = '{cni_conf}'
""")
        p = self._add("containerd", [self.bin("containerd"), "--config", str(config)])
        wait_until("containerd", lambda: self.ctr("version").returncode == 0,
                   60, p.popen, p.log, every_s=0.25)

    def _import_images(self) -> None:
        for image in IMAGES + ((SCHEDULER_IMAGE,) if self.network else ()):
            self.ctr("images", "import", str(self.node_dir / "images" / image))

    def _kubelet_files(self) -> tuple[Path, Path]:
        pki = self.cluster.pki
        ip = host_ip()
        serving = pki.issue("kubelet-serving", f"/CN={self.name}", server=True,
                            sans=f"IP:{ip},IP:127.0.0.1,DNS:{self.name}")
        client = pki.issue("kubelet-client", f"/O=system:nodes/CN=system:node:{self.name}")
        kubeconfig = self.folder / "kubelet.kubeconfig"
        self.cluster._write_kubeconfig(kubeconfig, user={
            "client-certificate": str(client[0]), "client-key": str(client[1])})
        # the API server's kubelet client may read logs and exec (kubectl logs/exec)
        self.cluster.apply(yaml.safe_dump({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "gpuslice-dev-apiserver-kubelet"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "system:kubelet-api-admin"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                          "name": KUBELET_CLIENT_USER}]}))
        gates = dict(g.split("=") for g in FEATURE_GATES.split(","))
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "failCgroupV1": not _cgroup_v1(), "cgroupDriver": "cgroupfs",
            "failSwapOn": False, "containerRuntimeEndpoint": f"unix://{SOCKET}",
            "readOnlyPort": 0, "tlsCertFile": str(serving[0]),
            "tlsPrivateKeyFile": str(serving[1]),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.cluster.ca_crt)}},
            "authorization": {"mode": "Webhook"},
            "podLogsDir": str(KUBELET_DIR / "pod-logs"),
            "rotateCertificates": False, "serializeImagePulls": False,
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "featureGates": {k: v == "true" for k, v in gates.items()},
            # node status (allocatable: healthy devices) written within 2 s of a change
            **({"clusterDNS": [host_ip()], "clusterDomain": CLUSTER_DOMAIN}
               if self.network else {}),
            "nodeStatusUpdateFrequency": "2s", "nodeStatusReportFrequency": "10s",
            "syncFrequency": "10s",
        }
        path = self.folder / "kubelet-config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path, kubeconfig

    def _start_kubelet(self, first: bool = False) -> None:
        if first:
            self._kubelet_config = self._kubelet_files()
        config, kubeconfig = self._kubelet_config
        p = self._add("kubelet", [
            self.bin("kubelet"), f"--config={config}", f"--kubeconfig={kubeconfig}",
            f"--hostname-override={self.name}", f"--node-ip={host_ip()}",
            f"--node-labels={NODE_LABEL}=real", "--v=2"])
        wait_until("kubelet /healthz", lambda: http_get(KUBELET_HEALTHZ) == b"ok",
                   self.ready_timeout_s, p.popen, p.log)
        wait_until(f"node {self.name} Ready", self.ready, self.ready_timeout_s, p.popen,
                   p.log, every_s=0.5)

    def _start_network(self) -> None:
        """CoreDNS on this host's address (the kubelet's clusterDNS), answering Service names
        from the API server, and kube-proxy in iptables mode (ClusterIPs, 10.96.0.1 for the
        API server among them), both as host processes on the admin kubeconfig."""
        if not self.cluster.pod_network:
            raise GpusliceError("a real node's network needs the cluster's pod_network (the API "
                                "server reachable from pods)")
        ip, admin = host_ip(), self.cluster.kubeconfig
        corefile = self.folder / "Corefile"
        corefile.write_text(f""".:53 {{
    bind {ip}
    errors
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {admin} dev
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
""")
        p = self._add("coredns", [self.bin("coredns"), "-conf", str(corefile)])
        wait_until("coredns", lambda: _udp_dns_ready(ip), 60, p.popen, p.log)
        config = self.folder / "kube-proxy.yaml"
        health = free_port()
        config.write_text(yaml.safe_dump({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(admin)}, "mode": "iptables",
            "hostnameOverride": self.name, "clusterCIDR": POD_SUBNET,
            "healthzBindAddress": f"127.0.0.1:{health}",
            "metricsBindAddress": f"127.0.0.1:{free_port()}",
            # leave the host's conntrack sysctls and route_localnet alone
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                          "tcpCloseWaitTimeout": "0s"},
            "iptables": {"localhostNodePorts": False},
        }))
        p = self._add("kube-proxy", [self.bin("kube-proxy"), f"--config={config}"])
        wait_until("kube-proxy /healthz", lambda: http_get(
            f"http://127.0.0.1:{health}/healthz").startswith(b"{"), 60, p.popen, p.log)

    def ready(self) -> bool:
        out = self.cluster.kubectl("get", "node", self.name, "-o", "json", check=False)
        if out.returncode != 0:
            return False
        conds = (json.loads(out.stdout).get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)

    def _add(self, name: str, argv: list[str]) -> Proc:
        proc = Proc(name, argv, self.folder / f"{name}.log").start()
        self.procs[name] = proc
        assert proc.pid is not None
        self.state.pids[name] = proc.pid
        self.state.write()
        return proc

    # -- faults --------------------------------------------------------------------------

    def restart_kubelet(self) -> None:
        """Stop the kubelet (SIGTERM) and start it again with the same configuration: its
        plugins must register again, its running pods keep running."""
        self.procs["kubelet"].stop()
        self._start_kubelet()

    def restart_containerd(self) -> None:
        """Stop containerd (SIGTERM) and start it again with the same configuration: the
        containers keep running under their shims (separate processes, left alone), and the
        kubelet reconnects to the runtime."""
        self.procs["containerd"].stop()
        self._start_containerd()
        wait_until(f"node {self.name} Ready after containerd's restart", self.ready,
                   self.ready_timeout_s, every_s=0.5)

    def simulate_reboot(self, while_down: Callable[[], None] | None = None) -> None:
        """What a reboot does to the node's workloads: the kubelet stops, every container
        dies at once (SIGKILL), containerd and its shims stop; ``while_down`` then erases
        what a reboot erases besides (a tmpfs's files, GPU state); containerd and the kubelet
        start again, and the kubelet starts the node's pods anew. (The host's own state, its
        network namespaces and mounts, is left to the kubelet and containerd to clean.)"""
        self.procs["kubelet"].stop()
        for task in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
            self.ctr("tasks", "kill", "-s", "SIGKILL", task, check=False)
        time.sleep(0.5)
        self.procs["containerd"].stop()
        for pid in _pids_of(self.bin("containerd-shim-runc-v2")):
            _kill(pid, 5.0)
        if while_down is not None:
            while_down()
        self._start_containerd()
        self._start_kubelet()

    # -- stop ----------------------------------------------------------------------------

    def stop(self) -> list[str]:
        """Delete this node's pods, stop the kubelet and containerd, restore the host; returns
        what still differs from the host as it was (empty when clean)."""
        left = teardown(self.state, self.cluster.kubectl if self._api_up() else None)
        self.procs.clear()
        return left

    def _api_up(self) -> bool:
        p = self.cluster.procs.get("kube-apiserver")
        return p is not None and p.popen is not None and p.popen.poll() is None


def _udp_dns_ready(ip: str) -> bool:
    """Whether a DNS server answers on ``ip``:53 (a query for kubernetes.default's name)."""
    import socket
    import struct

    query = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + b"".join(
        bytes([len(p)]) + p.encode() for p in f"kubernetes.default.svc.{CLUSTER_DOMAIN}".split(
            ".")) + b"\x00" + struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(1.0)
        s.sendto(query, (ip, 53))
        data = s.recv(512)
    return data[:2] == b"\x12\x34" and (data[3] & 0x0F) == 0  # our id, NOERROR


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a child of ours that exited is reaped here: a zombie is not
    running)."""
    from gpuslice.adapters.proc import alive

    with contextlib.suppress(ChildProcessError, OSError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    return alive(pid)


def _kill(pid: int, timeout_s: float = 20.0) -> None:
    if not _alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, 0)


def _pids_of(exe: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(d / "exe") == exe:
                    out.append(int(d.name))
    return out


def _step(what: str, t0: float) -> None:
    if os.environ.get("GPUSLICE_NODE_DEBUG"):
        print(f"teardown: {what} at {time.monotonic() - t0:.1f} s", flush=True)


def teardown(state: NodeState, kubectl: Callable[..., Any] | None) -> list[str]:
    """Undo a real node: its pods deleted through the API (the kubelet unprepares devices and
    deletes CNI networks), then the kubelet, what containerd still runs, containerd and its
    shims stopped, then the host restored from the snapshot taken before start. Returns what
    still differs from that snapshot."""
    t0 = time.monotonic()
    if kubectl is not None and state.pids.get("kubelet"):
        with contextlib.suppress(Exception):
            kubectl("delete", "pods", "-A", f"--field-selector=spec.nodeName={state.name}",
                    "--grace-period=1", "--wait=true", "--timeout=60s", check=False,
                    timeout_s=90)
        with contextlib.suppress(Exception):
            kubectl("delete", "node", state.name, "--wait=false", check=False)
    _step("pods deleted", t0)
    for name in ("kube-proxy", "coredns"):
        if name in state.pids:
            _kill(state.pids[name])
    if "kubelet" in state.pids:
        _kill(state.pids["kubelet"])
    _step("kubelet stopped", t0)
    ctr = [f"{state.node_dir}/bin/ctr", "--address", str(SOCKET), "-n", "k8s.io"]

    def run(*args: str) -> str:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            return subprocess.run([*ctr, *args], capture_output=True, text=True, timeout=60,
                                  check=False).stdout
        return ""

    if SOCKET.exists():
        for task in run("tasks", "ls", "-q").split():
            run("tasks", "kill", "-s", "SIGKILL", task)
        time.sleep(0.5)
        for task in run("tasks", "ls", "-q").split():
            run("tasks", "delete", "-f", task)
        for c in run("containers", "ls", "-q").split():
            run("containers", "delete", c)
    _step("containers deleted", t0)
    if "containerd" in state.pids:
        _kill(state.pids["containerd"])
    _step("containerd stopped", t0)
    for pid in _pids_of(f"{state.node_dir}/bin/containerd-shim-runc-v2"):
        _kill(pid, 5.0)
    before_file = Path(state.folder) / "host-before.json"
    if not before_file.exists():
        return ["no host snapshot: nothing restored"]
    before = host.Snapshot.from_json(json.loads(before_file.read_text()))
    return host.restore(before)
