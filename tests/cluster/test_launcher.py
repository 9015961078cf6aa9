"""The dev cluster's pieces that need no binaries: the scheduler configuration derived from
deploy/base/scheduler-config.yaml, the certificates, the kwok node objects, and a clear error
when the binaries are missing."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gpuslice.core.errors import GpusliceError
from gpuslice.devcluster import DevCluster, Pki, gpu_node, scheduler_config
from tests.cluster.conftest import DEPLOY

CONFIG = DEPLOY / "base" / "scheduler-config.yaml"


def test_the_scheduler_config_keeps_deploys_extender_stanza_and_points_it_here(
        tmp_path: Path) -> None:
    deployed = yaml.safe_load(yaml.safe_load(CONFIG.read_text())["data"]["config.yaml"])
    cfg = scheduler_config(CONFIG, tmp_path / "kc", "https://127.0.0.1:4443", tmp_path / "ca")
    (ext,) = cfg["extenders"]
    want = deployed["extenders"][0]
    for k in ("filterVerb", "prioritizeVerb", "preemptVerb", "bindVerb", "weight",
              "nodeCacheCapable", "managedResources", "ignorable", "httpTimeout"):
        assert ext[k] == want[k], k
    assert ext["urlPrefix"] == "https://127.0.0.1:4443" and ext["enableHTTPS"] is True
    assert ext["tlsConfig"] == {"insecure": False, "caFile": str(tmp_path / "ca")}
    assert [p["schedulerName"] for p in cfg["profiles"]] == ["gpuslice-scheduler",
                                                             "default-scheduler"]
    assert cfg["leaderElection"] == {"leaderElect": False}
    assert cfg["clientConnection"]["kubeconfig"] == str(tmp_path / "kc")
    assert (cfg["clientConnection"]["qps"], cfg["clientConnection"]["burst"]) == (200, 400)
    plain = scheduler_config(CONFIG, tmp_path / "kc", None, None, qps=5000)
    assert "extenders" not in plain and len(plain["profiles"]) == 2
    # the benchmark's: the scheduler alone's Bindings not held by its client rate limit
    assert (plain["clientConnection"]["qps"], plain["clientConnection"]["burst"]) == (5000, 10000)
    with pytest.raises(GpusliceError, match=r"qps: expected a rate of 1 or more"):
        scheduler_config(CONFIG, tmp_path / "kc", None, None, qps=0)
    ours = {p["schedulerName"]: p for p in cfg["profiles"]}["gpuslice-scheduler"]
    assert ours["percentageOfNodesToScore"] == 1  # deployed: kube-scheduler's smallest window
    every = scheduler_config(CONFIG, tmp_path / "kc", None, None, nodes_to_score=100)
    by_name = {p["schedulerName"]: p for p in every["profiles"]}
    assert by_name["gpuslice-scheduler"]["percentageOfNodesToScore"] == 100
    assert "percentageOfNodesToScore" not in by_name["default-scheduler"]
    with pytest.raises(GpusliceError, match=r"percentageOfNodesToScore: expected 0"):
        scheduler_config(CONFIG, tmp_path / "kc", None, None, nodes_to_score=101)


def test_a_config_without_an_extender_is_refused_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "cm.yaml"
    bad.write_text(yaml.safe_dump({"data": {"config.yaml": "profiles: []\n"}}))
    with pytest.raises(GpusliceError, match=r"data.config.yaml"):
        scheduler_config(bad, tmp_path / "kc", "http://x", None)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_certificates_chain_to_the_generated_ca(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    crt, _ = pki.issue("server", "/CN=kube-apiserver", server=True)
    ok = subprocess.run(["openssl", "verify", "-CAfile", str(pki.ca_crt), "-purpose",
                         "sslserver", str(crt)], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    client, _ = pki.issue("admin", "/O=system:masters/CN=admin")
    text = subprocess.run(["openssl", "x509", "-in", str(client), "-noout", "-subject",
                           "-ext", "extendedKeyUsage"], capture_output=True, text=True,
                          check=True).stdout
    assert "O = system:masters" in text and "Client Authentication" in text
    san = subprocess.run(["openssl", "x509", "-in", str(crt), "-noout", "-ext",
                          "subjectAltName"], capture_output=True, text=True, check=True).stdout
    assert "IP Address:127.0.0.1" in san


def test_a_kwok_gpu_node_carries_what_the_node_agent_publishes() -> None:
    n = gpu_node("n1", "A100-80GB", count=2, mig="3g.40gb@0,3g.40gb@4")
    assert n["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    inv = json.loads(n["metadata"]["annotations"]["gpuslice.io/inventory"])
    assert [g["model"] for g in inv] == ["A100-80GB", "A100-80GB"]
    assert [m["profile"] for m in inv[0]["mig"]] == ["3g.40gb", "3g.40gb"]
    assert n["metadata"]["labels"]["nvidia.com/gpu.count"] == "2"
    assert n["status"]["allocatable"]["gpuslice.io/gpu"] == "20"  # 10 devices per GPU


def test_missing_binaries_are_named(tmp_path: Path) -> None:
    (tmp_path / "etcd").write_text("")
    with pytest.raises(GpusliceError, match=r"kube-apiserver.*tools/cluster/build.sh"):
        DevCluster(tmp_path, DEPLOY)


def test_a_node_lease_under_a_second_is_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(GpusliceError, match=r"node_lease_s: expected a Lease duration"):
        DevCluster(tmp_path, DEPLOY, node_lease_s=0)


def test_without_the_pod_lifecycle_kwok_runs_only_the_node_stages(tmp_path: Path) -> None:
    bins = tmp_path / "bin"
    bins.mkdir()
    for b in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
              "kubectl", "kwok"):
        (bins / b).write_text("#!/bin/sh\n")
        (bins / b).chmod(0o755)
    stages = [{"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage",
               "metadata": {"name": name},
               "spec": {"resourceRef": {"apiGroup": "v1", "kind": kind}}}
              for name, kind in (("node-initialize", "Node"), ("pod-ready", "Pod"),
                                 ("node-heartbeat-with-lease", "Node"), ("pod-delete", "Pod"))]
    (bins / "kwok-stages.yaml").write_text(yaml.safe_dump_all(stages))
    full = DevCluster(bins, DEPLOY, folder=tmp_path / "a")
    assert full._kwok_stages() == bins / "kwok-stages.yaml"  # as build.sh wrote it
    bare = DevCluster(bins, DEPLOY, folder=tmp_path / "b", pod_lifecycle=False)
    kept = list(yaml.safe_load_all(bare._kwok_stages().read_text()))
    assert [d["metadata"]["name"] for d in kept] == ["node-initialize",
                                                     "node-heartbeat-with-lease"]
