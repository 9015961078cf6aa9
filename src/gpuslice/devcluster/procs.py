"""Processes, certificates, polling and settings for the dev cluster: what the control plane and
the real node have in common."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuslice.core.errors import GpusliceError

# beta (on by default) in 1.36; named anyway so that the DRA tests do not depend on defaults
FEATURE_GATES = ("DRAPartitionableDevices=true,DRAConsumableCapacity=true,"
                 "DRAExtendedResource=true,DRADeviceTaints=true")
# the API server's client certificate's user when it calls kubelets (logs, exec)
KUBELET_CLIENT_USER = "gpuslice-dev-apiserver-kubelet-client"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(what: str, check: Callable[[], bool], timeout_s: float,
               proc: subprocess.Popen[bytes] | None = None, log: Path | None = None,
               every_s: float = 0.25) -> None:
    """Poll ``check`` until it is true; fail naming ``what`` (and the log's tail) when the
    deadline passes or ``proc`` exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(Exception):
            if check():
                return
        if proc is not None and proc.poll() is not None:
            raise GpusliceError(f"{what}: the process exited with {proc.returncode}"
                                + tail(log))
        if time.monotonic() > deadline:
            raise GpusliceError(f"{what}: not ready after {timeout_s:.0f} s" + tail(log))
        time.sleep(every_s)


def tail(log: Path | None, lines: int = 25) -> str:
    if log is None or not log.exists():
        return ""
    text = log.read_text(errors="replace").splitlines()[-lines:]
    return f"\n--- last lines of {log} ---\n" + "\n".join(text)


def openssl(*args: str) -> None:
    try:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)
    except FileNotFoundError:
        raise GpusliceError("the openssl command line tool is needed to make the dev "
                            "cluster's certificates") from None
    except subprocess.CalledProcessError as exc:
        raise GpusliceError(f"openssl {args[0]} failed: {exc.stderr.decode()[-400:]}") from None


@dataclass
class Pki:
    """A CA and the certificates signed by it (EC P-256, valid for two days)."""

    folder: Path

    def __post_init__(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.ca_crt, self.ca_key = self.folder / "ca.crt", self.folder / "ca.key"
        openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-days", "2", "-subj", "/CN=gpuslice-dev-cluster-ca",
                 "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign",
                 "-keyout", str(self.ca_key), "-out", str(self.ca_crt))

    def issue(self, name: str, subject: str, *, server: bool = False,
              sans: str | None = None) -> tuple[Path, Path]:
        """A certificate and key; ``server``: also serverAuth, for ``sans`` (an openssl
        subjectAltName value; default: loopback and the API server's in-cluster names)."""
        crt, key, csr = (self.folder / f"{name}.{x}" for x in ("crt", "key", "csr"))
        ext = self.folder / f"{name}.ext"
        lines = ["basicConstraints=critical,CA:FALSE",
                 "keyUsage=critical,digitalSignature,keyEncipherment",
                 "extendedKeyUsage=" + ("serverAuth,clientAuth" if server else "clientAuth"),
                 "subjectKeyIdentifier=hash", "authorityKeyIdentifier=keyid"]
        if server:
            lines.append("subjectAltName=" + (sans or (
                "IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
                "DNS:kubernetes.default.svc,IP:10.96.0.1")))
        ext.write_text("\n".join(lines) + "\n")
        openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-subj", subject, "-keyout", str(key), "-out", str(csr))
        openssl("x509", "-req", "-in", str(csr), "-CA", str(self.ca_crt), "-CAkey",
                 str(self.ca_key), "-CAcreateserial", "-days", "2", "-extfile", str(ext),
                 "-out", str(crt))
        return crt, key


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str] | None = None) -> Proc:
        out = self.log.open("ab")
        try:
            self.popen = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          env=env)
        finally:
            out.close()
        return self

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def kill(self, timeout_s: float = 10.0) -> None:
        """SIGKILL: no chance to finish what it was doing (a crash, an OOM kill)."""
        p = self.popen
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        p.wait(timeout_s)

    def stop(self, timeout_s: float = 20.0) -> None:
        p = self.popen
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait(10)


def http_get(url: str, ctx: ssl.SSLContext | None = None, timeout_s: float = 5.0) -> bytes:
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=timeout_s) as r:
            return bytes(r.read()).strip()
    except urllib.error.HTTPError as exc:
        return bytes(exc.read()).strip()


def insecure() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def host_ip() -> str:
    """This host's IPv4 address on its default route (a real node's address; the kubelet
    refuses a loopback one)."""
    out = subprocess.run(["ip", "-4", "-o", "route", "get", "192.0.2.1"], capture_output=True,
                         text=True, timeout=10, check=False).stdout.split()
    if "src" in out:
        return out[out.index("src") + 1]
    raise GpusliceError("no IPv4 default route: a real node needs a non-loopback address")


def build_output(env: str, script: Path, flag: str) -> Path:
    """``$env`` when set, else the folder a ``tools/*/build.sh`` prints for ``flag`` (its
    cache folder keyed by the pinned modules; nothing is built)."""
    given = os.environ.get(env)
    if given:
        return Path(given)
    if not script.is_file():
        raise GpusliceError(f"no {script}: run from the repository root or set {env}")
    try:
        out = subprocess.run([str(script), flag], check=True, capture_output=True,
                             text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        raise GpusliceError(f"{script} {flag} failed: {exc}") from None
    return Path(out.splitlines()[-1])
