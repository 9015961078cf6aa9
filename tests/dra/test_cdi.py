"""The CDI specs the driver writes validate against the CDI JSON definition (our schema,
tests/dra/cdi_schema.json, written from cncf-tags/container-device-interface SPEC.md), their
device names are unique per claim and share, and they are written atomically."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from gpuslice.adapters.dra.cdi import CdiDevice, CdiSpecs, device_name
from gpuslice.core.errors import ValidationError
from tests.dra.conftest import Node, claim

SCHEMA = json.loads((Path(__file__).with_name("cdi_schema.json")).read_text())


def test_the_schema_rejects_what_the_spec_forbids() -> None:
    v = jsonschema.Draft7Validator(SCHEMA)
    good = {"cdiVersion": "0.6.0", "kind": "vendor.com/class",
            "devices": [{"name": "0", "containerEdits": {"env": ["A=1"]}}]}
    assert not list(v.iter_errors(good))
    for bad in ({**good, "devices": []}, {**good, "kind": "foo"},
                {**good, "extra": 1}, {**good, "cdiVersion": "1.0"},
                {**good, "devices": [{"name": "-x", "containerEdits": {}}]},
                {**good, "devices": [{"name": "x", "containerEdits": {
                    "deviceNodes": [{"hostPath": "/dev/x"}]}}]}):
        assert list(v.iter_errors(bad)), bad


def test_every_spec_of_every_model_validates(node: Node) -> None:
    client = node.serve()
    refs = [node.add(claim("whole", [{"request": "gpu", "device": "gpu-2"}])),
            node.add(claim("mig", [{"request": "gpu", "device": "gpu-1-mig-1g10gb-3"}])),
            node.add(claim("two-shares", [
                {"request": "a", "device": "gpu-0", "shareID": "s-1",
                 "consumedCapacity": {"compute": "10", "memory": "1Gi"}},
                {"request": "b", "device": "gpu-0", "shareID": "s-2",
                 "consumedCapacity": {"compute": "20", "memory": "2Gi"}}]))]
    got = client.prepare(refs)
    ids: list[str] = []
    for ref in refs:
        assert got[ref[1]].error == ""
        spec = json.loads(node.driver.cdi.path(ref[1]).read_text())
        jsonschema.validate(spec, SCHEMA)
        ids += [i for d in got[ref[1]].devices for i in d.cdi_device_ids]
        names = [f"{spec['kind']}={d['name']}" for d in spec["devices"]]
        assert sorted(names) == sorted(i for d in got[ref[1]].devices
                                       for i in d.cdi_device_ids)
    assert len(ids) == len(set(ids)) == 4  # one per device and share, never shared


def test_device_names_reject_characters_cdi_does_not_allow() -> None:
    assert device_name("u-1", "gpu-0", "s:1") == "u-1-gpu-0-s:1"
    # a gpuslice error, so a claim refused for it says why without a Python type's name
    with pytest.raises(ValidationError, match="CDI device name"):
        device_name("u 1", "gpu-0")


def test_writes_are_atomic_and_leave_no_temporary_file(tmp_path: Path) -> None:
    specs = CdiSpecs(tmp_path / "cdi")
    specs.write("u1", [CdiDevice("u1-gpu-0", {"A": "1"})])
    specs.write("u1", [CdiDevice("u1-gpu-0", {"A": "2"})])
    assert [p.name for p in (tmp_path / "cdi").iterdir()] == ["k8s.gpu.gpuslice.io-claim_u1.json"]
    assert json.loads(specs.path("u1").read_text())["devices"][0]["containerEdits"]["env"] == \
        ["A=2"]
    assert specs.remove("u1") and not specs.remove("u1")


MPS = "/run/gpuslice/mps"
GPU0, GPU1, GPU2 = "GPU-node-a-00", "GPU-node-a-01", "GPU-node-a-02"
MIG_MPS = {"apiVersion": "gpuslice.io/v1alpha1", "kind": "MigConfig", "sharing": {
    "strategy": "MPS", "mps": {"activeThreadPercentage": 50, "pinnedMemoryLimit": "10Gi"}}}
GPU_MPS = {"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuConfig", "sharing": {
    "strategy": "MPS", "mps": {"activeThreadPercentage": 40, "pinnedMemoryLimit": "4Gi"}}}
# model -> (the allocation result, its opaque config, the container edits docs/dra.md says
# it gets: the GPU's device node minor, CUDA_VISIBLE_DEVICES, the MPS caps (None: no MPS) and
# the host MPS pipe directory mounted at /run/gpuslice/mps, whether MIG capability nodes)
EDITS = {
    "share": ({"device": "gpu-0", "shareID": "s-1",
               "consumedCapacity": {"compute": "25", "memory": "20Gi"}}, None,
              7, GPU0, ("25", "0=20480M"), GPU0, False),
    "mig": ({"device": "gpu-1-mig-3g40gb-4"}, None, 3, f"MIG-{GPU1}-4", None, None, True),
    "mig-mps": ({"device": "gpu-1-mig-3g40gb-0"}, MIG_MPS, 3, f"MIG-{GPU1}-0",
                ("50", "0=10240M"), f"MIG-{GPU1}-0", True),
    "whole": ({"device": "gpu-2"}, None, 0, GPU2, None, None, False),
    "whole-mps": ({"device": "gpu-2"}, GPU_MPS, 0, GPU2, ("40", "0=4096M"), GPU2, False),
}


@pytest.mark.parametrize("model", sorted(EDITS))
def test_each_models_cdi_edits_make_the_container_see_only_its_gpu(
        short_dir: Path, model: str) -> None:
    """Over gRPC as the kubelet calls it: the spec file written for the claim validates, and
    its one device carries what docs/dra.md (CDI) promises for that model."""
    from gpuslice.core import dra
    from tests.dra.conftest import make_node, opaque

    # minors that differ from the indexes: /dev/nvidia<minor> must follow NVML's minor
    node = make_node(short_dir, [{"model": "H100-SXM", "minor": 7},
                                 {"model": "H100-SXM", "mig_enabled": True, "minor": 3},
                                 {"model": "T4", "minor": 0}], {"0": dra.SHARE, "1": dra.MIG})
    try:
        result, config, minor, visible, caps, pipe, mig = EDITS[model]
        client = node.serve()
        ref = node.add(claim(model, [{"request": "gpu", **result}],
                             config=[opaque(config)] if config else None))
        got = client.prepare([ref])[ref[1]]
        assert got.error == ""
        spec = json.loads(node.driver.cdi.path(ref[1]).read_text())
        jsonschema.validate(spec, SCHEMA)
        (dev,) = spec["devices"]
        assert list(got.devices[0].cdi_device_ids) == [f"{spec['kind']}={dev['name']}"]
        edits = dev["containerEdits"]
        env = dict(e.split("=", 1) for e in edits["env"])
        nodes = [n["path"] for n in edits["deviceNodes"]]
        dev_dir = node.cfg.dev_dir
        assert nodes[:4] == [f"{dev_dir}/nvidiactl", f"{dev_dir}/nvidia-uvm",
                             f"{dev_dir}/nvidia-uvm-tools", f"{dev_dir}/nvidia{minor}"]
        assert all(not n.startswith(f"{dev_dir}/nvidia-caps/") for n in nodes[:4])
        assert len([n for n in nodes if n.startswith(f"{dev_dir}/nvidia-caps/nvidia-cap")]) \
            == (2 if mig else 0)
        assert env["CUDA_VISIBLE_DEVICES"] == visible
        mps_env = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                   "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
        if caps is None:
            assert not [k for k in mps_env if k in env]
            assert "mounts" not in edits
        else:
            assert (env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"],
                    env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == caps
            assert env["CUDA_MPS_PIPE_DIRECTORY"] == MPS
            # the daemon's pipe directory, and its /dev/shm (they exchange shared memory)
            assert [(m["hostPath"], m["containerPath"]) for m in edits["mounts"]] == [
                (f"{node.cfg.mps_pipe_dir}/{pipe}", MPS), (node.cfg.mps_shm_dir, "/dev/shm")]
            assert node.driver._mps[pipe].healthy()
        assert client.unprepare([ref]) == {ref[1]: ""}
        assert not node.driver.cdi.path(ref[1]).exists()
    finally:
        node.stop()
