"""A real Kubernetes control plane on loopback for the cluster test tier and for trying gpuslice
against the official components: etcd, kube-apiserver, kube-controller-manager, kube-scheduler
(a ``gpuslice-scheduler`` profile built from deploy/base/scheduler-config.yaml, its extender
pointed at a local URL) and kwok (fake nodes, fake pod lifecycle).

The binaries come from ``tools/cluster/build.sh`` (official Go modules, pinned there). Every
component listens on 127.0.0.1 on a free port; certificates, the service-account signing key and
kubeconfigs are generated at start in the cluster's folder; :meth:`DevCluster.stop` ends every
process it started and removes the folder.

This module runs processes and is not imported by the rest of gpuslice; tests use it through a
session fixture (tests/cluster/conftest.py), people through ``gpuslice dev-cluster``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.devcluster.nodes import KWOK_NODE_ANNOTATION
from gpuslice.devcluster.procs import (
    FEATURE_GATES,
    KUBELET_CLIENT_USER,
    Pki,
    Proc,
    build_output,
    free_port,
    host_ip,
    http_get,
    insecure,
    openssl,
    wait_until,
)

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl",
            "kwok")
SERVICE_CIDR = "10.96.0.0/16"
SCHEDULER_NAME = "gpuslice-scheduler"


def find_bin_dir(repo: Path | None = None) -> Path:
    """``$GPUSLICE_CLUSTER_BIN``, else what ``tools/cluster/build.sh --bin-dir`` names (the cache
    folder keyed by the pinned modules) under ``repo`` (default: the current directory)."""
    return build_output("GPUSLICE_CLUSTER_BIN",
                        (repo or Path.cwd()) / "tools" / "cluster" / "build.sh", "--bin-dir")


KWOK_STAGES = "kwok-stages.yaml"  # written by build.sh from the kwok module's stage files


def missing_binaries(bin_dir: Path) -> list[str]:
    missing = [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)]
    return missing + ([] if (bin_dir / KWOK_STAGES).is_file() else [KWOK_STAGES])


def scheduler_config(deploy_config: Path, kubeconfig: Path, extender_url: str | None,
                     ca_file: Path | None, *, client_cert: tuple[Path, Path] | None = None,
                     leader_elect: bool = False, qps: int = 200,
                     nodes_to_score: int | None = None) -> dict[str, Any]:
    """deploy/base/scheduler-config.yaml's KubeSchedulerConfiguration with the extender pointed
    at ``extender_url`` (its CA file ``ca_file`` when https, and the scheduler's client
    certificate and key ``client_cert`` for mutual TLS), a kubeconfig, no leader election
    (one scheduler), and a ``default-scheduler`` profile beside ``gpuslice-scheduler`` for pods
    that ask for no GPU. ``extender_url=None``: the same profiles without the extender (the
    benchmark's baseline). ``qps``: the scheduler's client rate limit (burst twice that), which
    its own Binding writes are held to (the extender's are not). ``nodes_to_score``: the
    ``gpuslice-scheduler`` profile's percentageOfNodesToScore instead of the deployed one (0,
    kube-scheduler's adaptive share; 100: every node)."""
    doc = yaml.safe_load(deploy_config.read_text())
    try:
        cfg = yaml.safe_load(doc["data"]["config.yaml"])
        ext = cfg["extenders"][0]
    except (KeyError, IndexError, TypeError, yaml.YAMLError):
        raise ValidationError(f"{deploy_config}: data.config.yaml",
                              "a KubeSchedulerConfiguration with one extender", None) from None
    if qps < 1:
        raise ValidationError("qps", "a rate of 1 or more", qps)
    cfg["clientConnection"] = {"kubeconfig": str(kubeconfig), "qps": qps, "burst": 2 * qps}
    if not leader_elect:
        cfg["leaderElection"] = {"leaderElect": False}
    if nodes_to_score is not None:
        if not 0 <= nodes_to_score <= 100:
            raise ValidationError("percentageOfNodesToScore", "0 (adaptive) to 100",
                                  nodes_to_score)
        for p in cfg.get("profiles") or []:
            if p.get("schedulerName") == "gpuslice-scheduler":
                p["percentageOfNodesToScore"] = nodes_to_score
    names = {p.get("schedulerName") for p in cfg.get("profiles") or []}
    if "default-scheduler" not in names:
        cfg.setdefault("profiles", []).append({"schedulerName": "default-scheduler"})
    if extender_url is None:
        del cfg["extenders"]
        return dict(cfg)
    ext["urlPrefix"] = extender_url
    https = extender_url.startswith("https://")
    ext["enableHTTPS"] = https
    if https and ca_file is not None:
        ext["tlsConfig"] = {"insecure": False, "caFile": str(ca_file)}
        if client_cert is not None:
            ext["tlsConfig"].update(certFile=str(client_cert[0]), keyFile=str(client_cert[1]))
    else:
        ext.pop("tlsConfig", None)
    return dict(cfg)


class RealNodeLike(Protocol):
    name: str
    folder: Path

    def stop(self) -> list[str]: ...


@dataclass
class DevCluster:
    """Start with :meth:`start`, end with :meth:`stop` (also a context manager).

    ``scheduler``: ``"extender"`` (the gpuslice profile calls the extender at
    ``extender_url``), ``"plain"`` (the same profiles, no extender) or ``"none"``."""

    bin_dir: Path
    deploy_dir: Path
    scheduler: str = "extender"
    folder: Path | None = None
    extender_port: int = 0
    extender_tls: bool = True
    # the API server reachable from pods on a real node: listening on every address and
    # advertised at this host's (the ``kubernetes`` Service's endpoint; kube-proxy routes
    # 10.96.0.1 to it); off: loopback only
    pod_network: bool = False
    ready_timeout_s: float = 240.0
    # kube-scheduler's client rate limit (its burst twice that): 200 by default; the
    # throughput benchmark lifts it so that the scheduler alone's Bindings are not held
    scheduler_qps: int = 200
    # the gpuslice profile's percentageOfNodesToScore, when not the deployed one
    nodes_to_score: int | None = None
    # kwok's node Lease duration (it renews a quarter of it apart): 40 s, so 1000 nodes write
    # 100 Leases a second; the throughput benchmark lengthens it with the node count so that
    # 5000 nodes' heartbeats do not take the two cores it measures the scheduler on
    node_lease_s: int = 40
    # kwok plays the pods' lifecycle (Running on their node, Succeeded, deleted) with the
    # kwok module's Pod stages; off: only the node stages, so a bound pod stays as it was
    # bound (the throughput benchmark's choice, as kube-scheduler's own scheduler_perf runs
    # no kubelet: the status writes a kubelet makes are not the scheduler's work)
    pod_lifecycle: bool = True
    # kube-apiserver's /debug/pprof (for system:masters, as its /metrics): off, as a
    # hardened control plane has it; the throughput benchmark's --go-profile turns it on
    apiserver_profiling: bool = False
    procs: dict[str, Proc] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.node_lease_s < 1:
            raise ValidationError("node_lease_s", "a Lease duration of 1 s or more",
                                  self.node_lease_s)
        if self.scheduler not in ("extender", "plain", "default", "none"):
            raise ValidationError("scheduler", "extender, plain, default or none",
                                  self.scheduler)
        missing = missing_binaries(self.bin_dir)
        if missing:
            raise GpusliceError(f"cluster binaries missing in {self.bin_dir}: "
                                f"{', '.join(missing)} (build them: tools/cluster/build.sh)")
        self._own_folder = self.folder is None
        self.folder = Path(tempfile.mkdtemp(prefix="gpuslice-devcluster-")) \
            if self.folder is None else self.folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.extender_port = self.extender_port or free_port()
        self.ports: dict[str, int] = {}
        # a real node on this host (realnode.RealNode registers itself here; stopped first)
        self.real_node: RealNodeLike | None = None
        self.frozen = False  # kube-apiserver SIGSTOPped (freeze_apiserver)
        self.host_left: list[str] = []  # what a stopped real node left changed on the host

    # -- paths and URLs ------------------------------------------------------------------

    @property
    def dir(self) -> Path:
        assert self.folder is not None
        return self.folder

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "admin.kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    @property
    def extender_url(self) -> str:
        scheme = "https" if self.extender_tls else "http"
        return f"{scheme}://127.0.0.1:{self.extender_port}"

    @property
    def ca_crt(self) -> Path:
        return self.dir / "pki" / "ca.crt"

    def bin(self, name: str) -> str:
        return str(self.bin_dir / name)

    # -- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> DevCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> DevCluster:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        pki = Pki(self.dir / "pki")
        self.apiserver_cert = pki.issue("apiserver", "/CN=kube-apiserver", server=True)
        self.admin_cert = pki.issue("admin", "/O=system:masters/CN=gpuslice-dev-admin")
        self.extender_cert = pki.issue("extender", "/CN=gpuslice-extender", server=True)
        # kube-scheduler's client certificate for the extender (mutual TLS, as deploy/ runs
        # it: the extender's --client-ca is this cluster's CA)
        self.scheduler_client_cert = pki.issue("scheduler-client", "/CN=gpuslice-scheduler")
        # the API server's client certificate for kubelets (logs, exec, port-forward on a
        # real node; a RealNode binds it to system:kubelet-api-admin)
        self.kubelet_client_cert = pki.issue("apiserver-kubelet-client",
                                             f"/CN={KUBELET_CLIENT_USER}")
        self.pki = pki
        self.sa_key = self.dir / "pki" / "sa.key"
        openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out",
                 str(self.sa_key))
        self.sa_pub = self.dir / "pki" / "sa.pub"
        openssl("ec", "-in", str(self.sa_key), "-pubout", "-out", str(self.sa_pub))
        for name in ("etcd", "etcd-peer", "apiserver", "kcm", "scheduler", "kwok"):
            self.ports[name] = free_port()
        self._write_kubeconfig(self.kubeconfig, user={
            "client-certificate": str(self.admin_cert[0]),
            "client-key": str(self.admin_cert[1])})
        self._on_free_port(("etcd", "etcd-peer"), self._start_etcd)
        self._on_free_port(("apiserver",), self._start_apiserver)
        self._on_free_port(("kcm",), self._start_controller_manager)
        self._on_free_port(("kwok",), self._start_kwok)
        if self.scheduler != "none":
            self.start_scheduler(self.scheduler == "extender",
                                 default_only=self.scheduler == "default")
        self.write_state()

    def _on_free_port(self, keys: tuple[str, ...], start: Callable[[], None],
                      tries: int = 3) -> None:
        """Run ``start``; when its process could not bind (a port :func:`free_port` found free
        was taken by another process before the component bound it), pick new ports for
        ``keys`` and start it again."""
        for attempt in range(tries):
            try:
                start()
                return
            except GpusliceError as exc:
                if "address already in use" not in str(exc) or attempt == tries - 1:
                    raise
                for k in keys:
                    self.ports[k] = free_port()
                if "apiserver" in keys:  # the admin kubeconfig names its port
                    self._write_kubeconfig(self.kubeconfig, user={
                        "client-certificate": str(self.admin_cert[0]),
                        "client-key": str(self.admin_cert[1])})

    def _add(self, name: str, argv: list[str]) -> Proc:
        proc = Proc(name, argv, self.dir / f"{name}.log").start()
        self.procs[name] = proc
        return proc

    def _start_etcd(self) -> None:
        client = f"http://127.0.0.1:{self.ports['etcd']}"
        peer = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        p = self._add("etcd", [
            self.bin("etcd"), "--name", "dev", "--data-dir", str(self.dir / "etcd"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"dev={peer}", "--unsafe-no-fsync",
            "--quota-backend-bytes", str(4 << 30), "--log-level", "warn"])
        wait_until("etcd /health", lambda: b'"health":"true"' in http_get(client + "/health"),
                   self.ready_timeout_s, p.popen, p.log)

    def _apiserver_argv(self) -> list[str]:
        crt, key = self.apiserver_cert
        return [
            self.bin("kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
            *self._apiserver_address(),
            f"--secure-port={self.ports['apiserver']}",
            f"--tls-cert-file={crt}", f"--tls-private-key-file={key}",
            f"--client-ca-file={self.ca_crt}",
            "--authorization-mode=Node,RBAC",
            f"--kubelet-client-certificate={self.kubelet_client_cert[0]}",
            f"--kubelet-client-key={self.kubelet_client_cert[1]}",
            f"--kubelet-certificate-authority={self.ca_crt}",
            # a real node's hostname need not resolve: the API server dials its InternalIP
            "--kubelet-preferred-address-types=InternalIP",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={self.sa_pub}",
            f"--service-account-signing-key-file={self.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--runtime-config=resource.k8s.io/v1=true",
            f"--feature-gates={FEATURE_GATES}",
            f"--profiling={str(self.apiserver_profiling).lower()}",
            f"--cert-dir={self.dir / 'apiserver-certs'}",
        ]

    def _apiserver_address(self) -> list[str]:
        if not self.pod_network:
            return ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                    "--endpoint-reconciler-type=none"]
        return ["--bind-address=0.0.0.0", f"--advertise-address={host_ip()}"]

    def _start_apiserver(self) -> None:
        p = self._add("kube-apiserver", self._apiserver_argv())
        wait_until("kube-apiserver /readyz", lambda: http_get(self.server + "/readyz",
                                                          self._ssl()) == b"ok",
                   self.ready_timeout_s, p.popen, p.log)

    def restart_apiserver(self) -> None:
        """Stop kube-apiserver and start it again on the same port and etcd (clients see
        refused connections, then watches that must be re-established)."""
        self.procs["kube-apiserver"].stop()
        self._start_apiserver()
        self.write_state()

    def stop_apiserver(self) -> None:
        self.procs["kube-apiserver"].stop()

    def freeze_apiserver(self) -> None:
        """SIGSTOP kube-apiserver: connections are accepted by the kernel and never answered
        (an outage clients cannot tell from a slow server). :meth:`thaw_apiserver` ends it."""
        pid = self.procs["kube-apiserver"].pid
        if pid is not None:
            os.kill(pid, signal.SIGSTOP)
            self.frozen = True

    def thaw_apiserver(self) -> None:
        pid = self.procs["kube-apiserver"].pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.frozen = False

    def start_apiserver(self) -> None:
        self._start_apiserver()

    def _start_controller_manager(self) -> None:
        p = self._add("kube-controller-manager", [
            self.bin("kube-controller-manager"),
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--bind-address=127.0.0.1", f"--secure-port={self.ports['kcm']}",
            f"--cert-dir={self.dir / 'kcm-certs'}",
            f"--service-account-private-key-file={self.sa_key}",
            f"--root-ca-file={self.ca_crt}",
            "--use-service-account-credentials=true",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--leader-elect=false",
            f"--feature-gates={FEATURE_GATES}",
            "--kube-api-qps=200", "--kube-api-burst=400",
        ])
        # the service-account controller creates 'default' in every namespace: pods need it
        wait_until("kube-controller-manager (ServiceAccount default/default)",
                   lambda: self.kubectl("get", "serviceaccount", "default", "-n", "default",
                                        check=False).returncode == 0,
                   self.ready_timeout_s, p.popen, p.log, every_s=1.0)

    def _start_kwok(self) -> None:
        p = self._add("kwok", [
            self.bin("kwok"), f"--kubeconfig={self.kubeconfig}",
            f"--config={self._kwok_stages()}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
            "--cidr=10.128.0.1/12", "--node-ip=10.0.0.1",
            f"--server-address=127.0.0.1:{self.ports['kwok']}",
            f"--node-lease-duration-seconds={self.node_lease_s}",
        ])
        wait_until("kwok /healthz", lambda: http_get(
            f"http://127.0.0.1:{self.ports['kwok']}/healthz") == b"ok",
            self.ready_timeout_s, p.popen, p.log)

    def _kwok_stages(self) -> Path:
        """The stage file kwok runs: build.sh's, or without its Pod stages."""
        stages = self.bin_dir / KWOK_STAGES
        if self.pod_lifecycle:
            return stages
        docs = [d for d in yaml.safe_load_all(stages.read_text()) if d is not None and
                ((d.get("spec") or {}).get("resourceRef") or {}).get("kind") != "Pod"]
        out = self.dir / "kwok-node-stages.yaml"
        out.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        return out

    def scheduler_config_path(self, with_extender: bool, default_only: bool = False) -> Path:
        cfg = scheduler_config(self.deploy_dir / "base" / "scheduler-config.yaml",
                               self.kubeconfig, self.extender_url if with_extender else None,
                               self.ca_crt, client_cert=self.scheduler_client_cert,
                               qps=self.scheduler_qps, nodes_to_score=self.nodes_to_score)
        if default_only:  # the gpuslice profile is left to a scheduler installed in the cluster
            cfg["profiles"] = [p for p in cfg["profiles"]
                               if p.get("schedulerName") == "default-scheduler"]
        path = self.dir / ("scheduler-extender.yaml" if with_extender else
                           "scheduler-default.yaml" if default_only else "scheduler-plain.yaml")
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    def start_scheduler(self, with_extender: bool = True, default_only: bool = False,
                        wait: bool = True) -> None:
        """(Re)start kube-scheduler, with or without the gpuslice extender (``default_only``:
        the default-scheduler profile alone); ``wait``: until it answers /healthz."""
        if "kube-scheduler" in self.procs:
            self.procs["kube-scheduler"].stop()
        self._scheduler_mode = (with_extender, default_only)
        config = self.scheduler_config_path(with_extender, default_only)
        p = self._add("kube-scheduler", [
            self.bin("kube-scheduler"), f"--config={config}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--bind-address=127.0.0.1", f"--secure-port={self.ports['scheduler']}",
            f"--cert-dir={self.dir / 'scheduler-certs'}",
            # /debug/pprof: CPU profiles of the scheduler on loopback (cluster_scale --go-profile)
            "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics,"
            "/debug/pprof,/debug/pprof/*",
            f"--feature-gates={FEATURE_GATES}",
        ])
        if wait:
            wait_until("kube-scheduler /healthz", lambda: http_get(
                f"https://127.0.0.1:{self.ports['scheduler']}/healthz",
                insecure()) == b"ok", self.ready_timeout_s, p.popen, p.log)

    def restart_scheduler(self, *, kill: bool = True, wait: bool = True) -> None:
        """kube-scheduler ended (SIGKILL when ``kill``: its queue and in-flight binds lost;
        else SIGTERM) and started again with the profiles it last ran with; ``wait``: until
        it answers /healthz (off: a caller that must not block while the API server is
        away)."""
        with_extender, default_only = getattr(self, "_scheduler_mode", (True, False))
        proc = self.procs.get("kube-scheduler")
        if proc is not None and kill:
            proc.kill()
        self.start_scheduler(with_extender, default_only, wait=wait)
        self.write_state()

    def extender_tls_args(self) -> list[str]:
        """``gpuslice extender``'s serving flags for :attr:`extender_url`: mutual TLS as
        deploy/base runs it (a server certificate of this cluster's CA; only clients with a
        certificate of that CA, kube-scheduler's ``scheduler_client_cert``, may call the
        verbs), or plain HTTP without client authentication when ``extender_tls`` is off."""
        if not self.extender_tls:
            return ["--insecure-no-client-auth"]
        crt, key = self.extender_cert
        return ["--tls-cert", str(crt), "--tls-key", str(key), "--client-ca", str(self.ca_crt)]

    def start_extender(self, key_file: Path, timeout_s: float = 120.0,
                       args: Sequence[str] = ()) -> Proc:
        """(Re)start ``gpuslice extender`` as deploy/base runs it: mutual TLS with a certificate
        of this cluster's CA at :attr:`extender_url` (:meth:`extender_tls_args`), the HMAC key
        in ``key_file``, the
        ``gpuslice-extender`` service account's token (its RBAC must be applied); returns once
        it answers /healthz; ``args``: more of its flags. Stopped with the cluster, or by the
        caller (``Proc.stop``)."""
        if "gpuslice-extender" in self.procs:
            self.procs["gpuslice-extender"].stop()
        kubeconfig = self.service_account_kubeconfig("gpuslice-system", "gpuslice-extender")
        p = self._add("gpuslice-extender", [
            sys.executable, "-m", "gpuslice.cli", "extender", "--listen",
            f"127.0.0.1:{self.extender_port}", *self.extender_tls_args(),
            "--key-file", str(key_file), "--kubeconfig", str(kubeconfig), *args])
        ctx = ssl.create_default_context(cafile=str(self.ca_crt))
        wait_until("gpuslice extender /healthz", lambda: urllib.request.urlopen(
            self.extender_url + "/healthz", context=ctx, timeout=5).status == 200,
            timeout_s, p.popen, p.log)
        return p

    def scheduler_metrics(self) -> str:
        return http_get(f"https://127.0.0.1:{self.ports['scheduler']}/metrics",
                    insecure()).decode()

    def stop(self) -> None:
        """Stop every process this cluster started (the reverse of the start order; a real
        node first, its host changes undone) and remove its folder when it made it."""
        if self.frozen:
            self.thaw_apiserver()
        if self.real_node is not None:
            self.host_left = self.real_node.stop()
            self.real_node = None
        for name in reversed(list(self.procs)):
            self.procs[name].stop()
        self.procs.clear()
        if self._own_folder and self.folder is not None and self.folder.exists():
            shutil.rmtree(self.folder, ignore_errors=True)

    def alive(self) -> dict[str, bool]:
        return {n: p.popen is not None and p.popen.poll() is None
                for n, p in self.procs.items()}

    def write_state(self) -> None:
        state = {"folder": str(self.dir), "kubeconfig": str(self.kubeconfig),
                 "bin_dir": str(self.bin_dir),
                 "server": self.server, "extender_url": self.extender_url,
                 "ports": self.ports, "pids": {n: p.pid for n, p in self.procs.items()},
                 "real_node": None if self.real_node is None else str(self.real_node.folder)}
        (self.dir / "state.json").write_text(json.dumps(state, indent=1))

    # -- clients -------------------------------------------------------------------------

    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_crt))
        ctx.load_cert_chain(str(self.admin_cert[0]), str(self.admin_cert[1]))
        return ctx

    def _write_kubeconfig(self, path: Path, user: dict[str, str]) -> Path:
        doc = {"apiVersion": "v1", "kind": "Config", "current-context": "dev",
               "clusters": [{"name": "dev", "cluster": {
                   "server": self.server, "certificate-authority": str(self.ca_crt)}}],
               "users": [{"name": "user", "user": user}],
               "contexts": [{"name": "dev", "context": {"cluster": "dev", "user": "user"}}]}
        path.write_text(yaml.safe_dump(doc))
        path.chmod(0o600)
        return path

    def kubectl(self, *args: str, kubeconfig: Path | None = None, input: str | None = None,
                check: bool = True, timeout_s: float = 120.0,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        argv = [self.bin("kubectl"), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        res = subprocess.run(argv, check=False, input=input, capture_output=True, text=True,
                             timeout=timeout_s, env=env)
        if check and res.returncode != 0:
            raise GpusliceError(f"kubectl {' '.join(args)} failed ({res.returncode}): "
                                f"{res.stderr.strip()[-600:]}")
        return res

    def service_account_kubeconfig(self, namespace: str, name: str,
                                   path: Path | None = None, duration: str = "6h") -> Path:
        """A kubeconfig with a token of the service account (``kubectl create token``)."""
        token = self.kubectl("create", "token", name, "-n", namespace,
                             f"--duration={duration}").stdout.strip()
        path = path or self.dir / f"sa-{namespace}-{name}.kubeconfig"
        return self._write_kubeconfig(path, user={"token": token})

    def apply(self, manifest: str | Path, *extra: str) -> str:
        """``kubectl apply --server-side`` of a file, a folder (-k when it has a
        kustomization) or YAML text."""
        if isinstance(manifest, Path):
            flag = "-k" if (manifest / "kustomization.yaml").exists() else "-f"
            return self.kubectl("apply", "--server-side", "--force-conflicts", flag,
                                str(manifest), *extra).stdout
        return self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", *extra,
                            input=manifest).stdout

    def add_nodes(self, nodes: Sequence[dict[str, Any]], ready_timeout_s: float = 120.0,
                  ) -> None:
        """Create kwok nodes (objects from :func:`kwok_node`) and wait until kwok has made
        them Ready."""
        text = yaml.safe_dump_all(nodes)
        self.kubectl("create", "-f", "-", input=text, timeout_s=600)
        names = {n["metadata"]["name"] for n in nodes}

        def ready() -> bool:
            out = self.kubectl("get", "nodes", "-o", "json", timeout_s=300).stdout
            ok = {n["metadata"]["name"] for n in json.loads(out)["items"]
                  if any(c.get("type") == "Ready" and c.get("status") == "True"
                         for c in (n.get("status") or {}).get("conditions") or [])}
            return names <= ok

        wait_until(f"{len(names)} kwok nodes Ready", ready, ready_timeout_s, every_s=1.0)


