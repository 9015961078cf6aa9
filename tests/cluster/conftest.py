"""The cluster tier: the real control plane (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler built from the official modules by tools/cluster/build.sh, kwok for nodes and
pod lifecycle) started once per test run, deploy/base applied with ``kubectl apply
--server-side``, and the gpuslice extender running as a process on its service account.

Without the binaries the tier is skipped with the command that builds them, except under
``CI=true`` where a missing build is a failure (CI builds them first)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice.devcluster import DevCluster, find_bin_dir, missing_binaries
from tests.cluster.helpers import (
    EXTENDER_KEY,
    ExtenderProcess,
    Kube,
)

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.cluster)
            item.add_marker(pytest.mark.slow)
            if item.get_closest_marker("timeout") is None:  # a loaded 2-core machine
                item.add_marker(pytest.mark.timeout(900))


@pytest.fixture(scope="session")
def cluster_bin() -> Path:
    pytest.importorskip("kubernetes", reason="the Kubernetes client (gpuslice[kube]) is needed")
    try:
        bin_dir = find_bin_dir(REPO)
        missing = missing_binaries(bin_dir)
    except Exception as exc:  # no Go, no build script: named in the message
        bin_dir, missing = Path("?"), [str(exc)]
    if missing:
        reason = (f"cluster binaries missing in {bin_dir} ({', '.join(missing)}): build them "
                  "with tools/cluster/build.sh (Go >= 1.26, about 25 min on 2 cores the first "
                  "time)")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason + " -- required under CI=true")
        pytest.skip(reason)
    return bin_dir


@pytest.fixture(scope="package")  # stopped after tests/cluster: no load on later tiers
def dev(cluster_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """The control plane, deploy/base applied server-side (namespace, CRD, RBAC, ...)."""
    t0 = time.monotonic()
    c = DevCluster(cluster_bin, DEPLOY, folder=tmp_path_factory.mktemp("devcluster"))
    c.start()
    try:
        c.apply(DEPLOY / "base")
        # the CRD is served once Established
        c.kubectl("wait", "--for=condition=Established", "--timeout=120s",
                  "crd/sliceschedules.gpuslice.io", timeout_s=150)
        sys.stderr.write(f"\n[cluster tier] control plane up in {time.monotonic() - t0:.0f} s "
                         f"({c.dir})\n")
        yield c
    finally:
        started = list(c.procs.values())
        c.stop()
    # nothing it started is left running
    assert started and all(p.popen is not None and p.popen.poll() is not None
                           for p in started)


@pytest.fixture(scope="package")  # stopped after tests/cluster: no load on later tiers
def kube(dev: DevCluster) -> Iterator[Kube]:
    k = Kube(dev)
    yield k
    k.close()


@pytest.fixture(scope="package")  # stopped after tests/cluster: no load on later tiers
def extender(dev: DevCluster) -> Iterator[ExtenderProcess]:
    """``gpuslice extender`` on the gpuslice-extender service account's token, serving HTTPS
    with a certificate of the cluster's CA at the URL the scheduler calls."""
    key = dev.dir / "assignment.key"
    key.write_text(EXTENDER_KEY)
    kubeconfig = dev.service_account_kubeconfig("gpuslice-system", "gpuslice-extender")
    ext = ExtenderProcess(dev, kubeconfig, key)
    ext.start()
    yield ext
    ext.stop()


@pytest.fixture
def group(request: pytest.FixtureRequest, kube: Kube, extender: ExtenderProcess,
          ) -> Iterator[str]:
    """A namespace and node group of the test's own (nodes labelled and pods selecting
    ``gpuslice.test/group``), deleted afterwards so tests do not share GPUs."""
    name = "t-" + request.node.name.removeprefix("test_").replace("_", "-")[:40].strip("-")
    kube.create_namespace(name)
    yield name
    kube.cleanup_group(name)


def run_gpuslice(*args: str, timeout_s: float = 120.0,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuslice.cli", *args], check=False,
                          capture_output=True,
                          text=True, timeout=timeout_s, env={**os.environ, **(env or {})})
