from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from gpuslice.adapters.nvml.port import FakeNvml, NullNvml
from gpuslice.adapters.nvml.real import RealNvml, load
from gpuslice.core import catalog
from gpuslice.core.devices import inventory, node_labels
from gpuslice.core.errors import ValidationError

INVENTORY = """
driver: "580.95.05"
gpus:
  - model: A100-80GB
    mig: "3g.40gb@0,2g.20gb@4,1g.10gb@6"
  - model: A100-80GB
  - model: G2
    memory_mib: 32768
    faults: [79]
"""


def fake(tmp_path: Path, text: str = INVENTORY) -> FakeNvml:
    p = tmp_path / "inv.yaml"
    p.write_text(text)
    return FakeNvml.from_yaml(p, node="n1")


def test_fake_inventory_with_mig_and_opaque_models(tmp_path: Path) -> None:
    nv = fake(tmp_path)
    gpus = nv.devices()
    assert [g.model for g in gpus] == ["A100-80GB", "A100-80GB", "G2"]
    assert gpus[0].mig_enabled and [m.profile for m in gpus[0].mig] == \
        ["3g.40gb", "2g.20gb", "1g.10gb"]
    assert gpus[2].memory_mib == 32768 and gpus[2].sms is None
    assert [e.xid for e in nv.events(0.0)] == [79]
    assert nv.events(0.01) == []
    nv.inject(gpus[1].uuid, 48)
    assert [(e.uuid, e.xid) for e in nv.events(1.0)] == [(gpus[1].uuid, 48)]


@pytest.mark.parametrize(
    ("text", "field"),
    [("gpus: 3", "gpus"), ("gpus: [{model: H900}]", "gpu model"),
     ("gpus: [{model: T4, mig: '1g.5gb@0'}]", "mig"), ("[", "YAML")],
)
def test_fake_inventory_errors_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        fake(tmp_path, text)


def test_labels_and_inventory(tmp_path: Path) -> None:
    nv = fake(tmp_path)
    labels = node_labels(nv.devices(), nv.driver_version())
    assert labels["nvidia.com/gpu.product"] == "A100-80GB"
    assert labels["nvidia.com/gpu.count"] == "3"
    assert labels["nvidia.com/mig.capable"] == "true"
    assert labels["nvidia.com/cuda.driver.major"] == "580"
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    assert labels["nvidia.com/mig-3g.40gb.count"] == "1"
    nv.set_healthy(nv.devices()[2].uuid, False)
    inv = inventory(nv.devices())
    assert [i["model"] for i in inv] == ["A100-80GB", "A100-80GB"]  # the sick GPU is left out
    assert inv[0]["mig"][0] == {"uuid": inv[0]["mig"][0]["uuid"], "profile": "3g.40gb",
                                "start": 0, "memoryMiB": 40192}
    assert node_labels([]) == {"nvidia.com/gpu.present": "false"}


def test_null_nvml_says_why() -> None:
    nv = NullNvml("no driver")
    assert nv.devices() == [] and nv.why_empty() == "no driver" and nv.events(0) == []


def test_without_a_driver_load_returns_the_null_port_with_an_explanation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class NVMLError_LibraryNotFound(Exception):  # the name pynvml gives it
        pass

    def init() -> None:
        raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    mod = types.ModuleType("pynvml")
    mod.nvmlInit = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    nv = load()
    assert isinstance(nv, NullNvml)
    assert "libnvidia-ml.so is not on this node" in nv.why_empty()
    assert "install the NVIDIA driver" in nv.why_empty()


@pytest.mark.gpu
def test_real_gpu_discovery() -> None:
    pytest.importorskip("pynvml")
    nv = load()
    if isinstance(nv, NullNvml):
        pytest.skip(f"no NVIDIA GPU here: {nv.why_empty()}")
    assert isinstance(nv, RealNvml)
    gpus = nv.devices()
    assert gpus and all(g.uuid.startswith("GPU-") and g.memory_mib > 0 for g in gpus)
    for g in gpus:
        profiles = nv.mig_profiles(g.uuid)  # read with MIG enabled or not
        print(f"{g.index}: {g.name} ({g.model}) {g.memory_mib} MiB, {g.sms} SMs, CC "
              f"{g.compute_capability}, MIG {'on' if g.mig_enabled else 'off'}, "
              f"driver {nv.driver_version()}")
        for p in profiles:
            print(f"   {p.name:12} id {p.profile_id:2}  {p.compute_slices}g {p.memory_slices}m "
                  f"{p.memory_mib} MiB {p.sms} SMs  max {p.max_instances}  starts {p.starts}")
        model = catalog.lookup(g.model)
        if model is not None and model.mig is not None:
            assert sorted(profiles, key=lambda p: p.profile_id) == \
                sorted(model.mig.profiles, key=lambda p: p.profile_id), \
                f"the catalogue's MIG table for {g.model} differs from what NVML reports"
