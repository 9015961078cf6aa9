"""A DRA driver on a fake node: fake NVML, the in-memory API server fake, its sockets and
files in short temporary directories (unix socket paths are limited to 107 bytes)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuslice.adapters.kube.fake import FakeApiServer
from gpuslice.adapters.nvml.port import FakeNvml
from gpuslice.core import dra
from gpuslice.services.dra_driver import DraConfig, DraDriver, DraServer
from tests.dra.kubelet import DraClient, register
from tests.fake_mps import write_fake_mps

NODE = "node-a"


def inventory(path: Path, gpus: list[dict[str, Any]]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({"driver": "580.95.05", "gpus": gpus}))
    return path


def claim(name: str, results: list[dict[str, Any]], config: list[dict[str, Any]] | None = None,
          uid: str | None = None, namespace: str = "default") -> dict[str, Any]:
    """A ResourceClaim as kube-scheduler leaves it allocated (``results`` default to this
    driver and this node's pool)."""
    res = [{"driver": dra.DRIVER, "pool": NODE, **r} for r in results]
    alloc: dict[str, Any] = {"devices": {"results": res, "config": config or []}}
    return {"metadata": {"name": name, "namespace": namespace,
                         "uid": uid or f"0000-{name}"},
            "spec": {"devices": {"requests": [{"name": r.get("request", "gpu")}
                                              for r in results]}},
            "status": {"allocation": alloc}}


def opaque(params: dict[str, Any], requests: list[str] | None = None,
           source: str = "FromClaim") -> dict[str, Any]:
    return {"source": source, "requests": requests or [],
            "opaque": {"driver": dra.DRIVER, "parameters": params}}


@dataclass
class Node:
    root: Path
    api: FakeApiServer
    nvml: FakeNvml
    cfg: DraConfig
    driver: DraDriver
    server: DraServer | None = None
    client: DraClient | None = None

    def ref(self, c: dict[str, Any]) -> tuple[str, str, str]:
        m = c["metadata"]
        return (m["namespace"], m["uid"], m["name"])

    def add(self, c: dict[str, Any]) -> tuple[str, str, str]:
        self.api.put_resource_claim(c)
        return self.ref(c)

    def serve(self) -> DraClient:
        self.server = DraServer(self.driver)
        self.server.start()
        self.client = DraClient(register(self.cfg.registration_socket))
        return self.client

    def restart(self) -> DraDriver:
        """A new driver process on the same node: same files, same API server."""
        self.stop()
        self.driver = DraDriver(self.cfg, self.nvml, self.api, features=self.driver.features)
        self.driver.start()
        return self.driver

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.server is not None:
            self.server.stop()
            self.server = None


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def make_node(root: Path, gpus: list[dict[str, Any]], modes: dict[str, str],
              features: dra.Features | None = None, **cfg: Any) -> Node:
    api = FakeApiServer()
    api.add_node({"metadata": {"name": NODE, "uid": "node-uid"}})
    nvml = FakeNvml.from_yaml(inventory(root / "gpus.yaml", gpus), NODE)
    mps = write_fake_mps(root / "mps-control")
    config = DraConfig(NODE, kubelet_dir=root / "k", cdi_dir=root / "cdi",
                       mps_pipe_dir=str(root / "mps"), mps_binary=str(mps), modes=modes,
                       **cfg)
    driver = DraDriver(config, nvml, api, features=features or dra.Features())
    driver.start()
    return Node(root, api, nvml, config, driver)


@pytest.fixture
def node(short_dir: Path) -> Iterator[Node]:
    """Two H100s (GPU 0 shared, GPU 1 MIG-enabled in MIG mode) and a T4 (whole)."""
    n = make_node(short_dir, [{"model": "H100-SXM"}, {"model": "H100-SXM", "mig_enabled": True},
                              {"model": "T4"}], {"0": dra.SHARE, "1": dra.MIG})
    yield n
    n.stop()
