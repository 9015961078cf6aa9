"""The node tier: a real kubelet with containerd on this host (tools/node/build.sh), registered
with the real control plane of the cluster tier (tools/cluster/build.sh), running our device
plugin and DRA driver as host processes and the busybox image as pods.

Without root, the binaries or the host's runc / CNI plugins / iptables the tier is skipped with
what is missing, except under ``CI=true`` where that is a failure (CI installs and builds them
first). One real node runs per host: each module starts its own and stops it, and the host must
be as it was afterwards (:mod:`gpuslice.devcluster.host`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuslice.devcluster import DevCluster, find_bin_dir, missing_binaries
from gpuslice.devcluster.realnode import RealNode, find_node_dir, missing_prerequisites
from tests.cluster.helpers import EXTENDER_KEY, ExtenderProcess
from tests.node.helpers import NodeEnv

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.node)
            item.add_marker(pytest.mark.slow)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(600))


# what tests measured (the upgrade test's per-step figures), printed at the end of the run so
# that CI's log carries them (docs/testing.md quotes them)
FIGURES: list[str] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if FIGURES:
        terminalreporter.section("node tier figures")
        for line in FIGURES:
            terminalreporter.write_line(line)


def _fail_or_skip(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason + " -- required under CI=true")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def node_bins() -> tuple[Path, Path]:
    """(cluster binaries, node build folder); skip or fail naming what is missing."""
    pytest.importorskip("kubernetes", reason="the Kubernetes client (gpuslice[kube]) is needed")
    try:
        bin_dir = find_bin_dir(REPO)
        missing = [f"{bin_dir}/{m}" for m in missing_binaries(bin_dir)]
        node_dir = find_node_dir(REPO)
        missing += missing_prerequisites(node_dir)
    except Exception as exc:  # no Go, no build script
        _fail_or_skip(f"the real node tier cannot start: {exc}")
        raise
    if missing:
        _fail_or_skip("the real node tier needs " + "; ".join(missing)
                      + " (tools/cluster/build.sh, tools/node/build.sh, run as root)")
    return bin_dir, node_dir


@pytest.fixture(scope="module")
def env(node_bins: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory,
        ) -> Iterator[NodeEnv]:
    """The control plane with deploy/base applied, the extender, and the real node."""
    t0 = time.monotonic()
    bin_dir, node_dir = node_bins
    dev = DevCluster(bin_dir, DEPLOY, folder=tmp_path_factory.mktemp("nodecluster"))
    dev.start()
    ext = None
    try:
        dev.apply(DEPLOY / "base")
        key = dev.dir / "assignment.key"
        key.write_text(EXTENDER_KEY)
        ext = ExtenderProcess(dev, dev.service_account_kubeconfig(
            "gpuslice-system", "gpuslice-extender"), key)
        ext.start()
        node = RealNode(dev, node_dir).start()
        sys.stderr.write(f"\n[node tier] control plane and real node up in "
                         f"{time.monotonic() - t0:.0f} s ({dev.dir})\n")
        e = NodeEnv(dev, node, key)
        yield e
        e.close()
    finally:
        if ext is not None:
            ext.stop()
        dev.stop()
    assert dev.host_left == [], "the real node left the host changed:\n" + "\n".join(
        dev.host_left)


@pytest.fixture(scope="module")
def image() -> dict[str, Any]:
    """The image scripts/build-image.sh built ($GPUSLICE_IMAGE_JSON, as CI sets it), else built
    here (minutes; reused when its inputs are unchanged)."""
    given = os.environ.get("GPUSLICE_IMAGE_JSON")
    if given:
        return dict(json.loads(Path(given).read_text()))
    missing = [t for t in ("umoci", "skopeo", "mmdebstrap") if shutil.which(t) is None]
    if missing:
        _fail_or_skip(f"building the image needs {', '.join(missing)}")
    out = REPO / "dist" / "image"
    subprocess.run([str(REPO / "scripts" / "build-image.sh"), "--out", str(out)], check=True,
                   timeout=3000)
    return dict(json.loads((out / "image.json").read_text()))


@pytest.fixture(scope="module")
def helm() -> str:
    found = shutil.which("helm") or str(Path.home() / ".cache/gpuslice-tools/bin/helm")
    if not os.access(found, os.X_OK):
        _fail_or_skip("helm is needed (.ci/run installs it: go install helm.sh/helm/v3/cmd/helm)")
    return found


@pytest.fixture(scope="module")
def net(node_bins: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory,
        ) -> Iterator[NodeEnv]:
    """A control plane whose API server pods reach (default scheduler only: the chart brings
    the gpuslice one) and the real node with kube-proxy and CoreDNS."""
    bin_dir, node_dir = node_bins
    dev = DevCluster(bin_dir, DEPLOY, scheduler="default", pod_network=True,
                     folder=tmp_path_factory.mktemp("netcluster"))
    dev.start()
    try:
        node = RealNode(dev, node_dir, network=True).start()
        yield NodeEnv(dev, node, Path("/nonexistent"))
    finally:
        dev.stop()
    assert dev.host_left == [], "the real node left the host changed:\n" + "\n".join(
        dev.host_left)
