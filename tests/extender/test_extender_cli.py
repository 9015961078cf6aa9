"""`gpuslice extender` as a process: mutual TLS (throw-away CA and certificates), and plain HTTP
only when asked for with --insecure-no-client-auth."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gpuslice.cli import main

FAKE = """
nodes:
  - metadata:
      name: t4-a
      annotations:
        gpuslice.io/inventory: '[{"uuid": "GPU-1", "index": 0, "model": "T4", "memoryMiB": 15360}]'
pods:
  - metadata: {name: p1, namespace: default}
    spec:
      containers:
        - name: c
          resources: {limits: {gpuslice.io/gpu: "1", gpuslice.io/gpu-milli: "600"}}
"""
POD = {"metadata": {"name": "p1", "namespace": "default"},
       "spec": {"containers": [{"name": "c", "resources": {"limits": {
           "gpuslice.io/gpu": "1", "gpuslice.io/gpu-milli": "600"}}}]}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], int]:
    (tmp_path / "fake.yaml").write_text(FAKE)
    (tmp_path / "key").write_text("test-key-0123456789abcdef")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuslice.cli", "extender", "--listen", f"127.0.0.1:{port}",
         "--key-file", str(tmp_path / "key"), "--fake-cluster", str(tmp_path / "fake.yaml"),
         *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, port
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read().decode() if proc.stdout else "exited")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("extender did not start")


def post(url: str, doc: object, ctx: ssl.SSLContext | None = None) -> dict[str, object]:
    req = urllib.request.Request(url, data=json.dumps(doc).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
        out: dict[str, object] = json.loads(r.read())
        return out


def test_http_filter_and_bind(tmp_path: Path) -> None:
    proc, port = start(tmp_path, "--insecure-no-client-auth")
    try:
        base = f"http://127.0.0.1:{port}"
        res = post(base + "/filter", {"Pod": POD, "NodeNames": ["t4-a"]})
        assert res["NodeNames"] == ["t4-a"]
        res = post(base + "/bind", {"PodName": "p1", "PodNamespace": "default",
                                    "PodUID": "uid-default-p1", "Node": "t4-a"})
        assert res["Error"] == ""
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_https_with_mutual_tls(tmp_path: Path) -> None:
    from gpuslice.devcluster.procs import Pki

    pki = Pki(tmp_path / "pki")
    crt, key = pki.issue("extender", "/CN=gpuslice-extender", server=True)
    client = pki.issue("scheduler", "/CN=gpuslice-scheduler")
    proc, port = start(tmp_path, "--tls-cert", str(crt), "--tls-key", str(key),
                       "--client-ca", str(pki.ca_crt))
    try:
        url = f"https://127.0.0.1:{port}"
        ctx = ssl.create_default_context(cafile=str(pki.ca_crt))
        with pytest.raises(urllib.error.HTTPError) as refused:  # no client certificate
            post(url + "/filter", {"Pod": POD, "NodeNames": ["t4-a"]}, ctx)
        assert refused.value.code == 403
        with urllib.request.urlopen(url + "/healthz", context=ctx, timeout=10) as r:
            assert r.status == 200  # the kubelet's probes present no certificate
        ctx.load_cert_chain(str(client[0]), str(client[1]))
        res = post(url + "/filter", {"Pod": POD, "NodeNames": ["t4-a"]}, ctx)
        assert res["NodeNames"] == ["t4-a"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize(
    ("args", "expect"),
    [(["--tls-cert", "x.pem"], "--tls-key is missing: expected a PEM file to go with "
      "--tls-cert"), (["--client-ca", "ca.pem"], "--client-ca"),
     (["--listen", "nope"], "--listen"),
     # issue 54: the file that is not there is named, with the option that named it
     (["--tls-cert", "nofile.crt", "--tls-key", "nokey.key"],
      "--tls-cert: expected a readable PEM file, got 'nofile.crt: No such file or directory'"),
     ([], "--insecure-no-client-auth")],  # no plain HTTP unless asked for by name
)
def test_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                     expect: str) -> None:
    (tmp_path / "key").write_text("test-key-0123456789abcdef")
    (tmp_path / "fake.yaml").write_text(FAKE)
    code = main(["extender", "--key-file", str(tmp_path / "key"), "--fake-cluster",
                 str(tmp_path / "fake.yaml"), *args])
    assert code == 2
    assert expect in capsys.readouterr().err


def test_short_key_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "key").write_text("short")
    assert main(["extender", "--key-file", str(tmp_path / "key"), "--fake-cluster",
                 str(tmp_path / "x.yaml")]) == 2
    assert "16 bytes" in capsys.readouterr().err
