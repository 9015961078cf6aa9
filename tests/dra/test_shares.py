"""Consumable capacity (KEP-5075): shares of one GPU, each with its own limits.

The scheduler gives each result of a device with ``allowMultipleAllocations`` a ``shareID``
and its ``consumedCapacity`` (k8s.io/api resource/v1 types.go, DeviceRequestAllocationResult);
the driver turns them into MPS caps for that share's clients, held in the CDI spec's
environment, under one MPS control daemon per GPU, and refuses a share that would over-commit
the GPU across claims (the kubeletplugin package's "last line of defense")."""

from __future__ import annotations

import json
from typing import Any

from tests.dra.conftest import Node, claim, opaque


def share(name: str, share_id: str, compute: str, memory: str, **kw: Any) -> dict[str, Any]:
    return claim(name, [{"request": "gpu", "device": "gpu-0", "shareID": share_id,
                         "consumedCapacity": {"compute": compute, "memory": memory}}], **kw)


def env_of(node: Node, uid: str) -> list[dict[str, str]]:
    spec = json.loads(node.driver.cdi.path(uid).read_text())
    return [dict(e.split("=", 1) for e in d["containerEdits"]["env"]) for d in spec["devices"]]


def test_two_shares_of_one_gpu_each_hold_their_own_limits(node: Node) -> None:
    client = node.serve()
    a = node.add(share("quarter", "5f0a-aaaa", "25", "20Gi"))
    b = node.add(share("half", "5f0a-bbbb", "50", "40Gi"))
    got = client.prepare([a, b])
    for ref, sid in ((a, "5f0a-aaaa"), (b, "5f0a-bbbb")):
        assert got[ref[1]].error == ""
        (dev,) = got[ref[1]].devices
        assert dev.share_id == sid
        assert list(dev.cdi_device_ids) == [f"k8s.gpu.gpuslice.io/claim={ref[1]}-gpu-0-{sid}"]
    (ea,), (eb,) = env_of(node, a[1]), env_of(node, b[1])
    assert (ea["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], ea["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) \
        == ("25", "0=20480M")
    assert (eb["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], eb["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) \
        == ("50", "0=40960M")
    assert ea["CUDA_MPS_PIPE_DIRECTORY"] == eb["CUDA_MPS_PIPE_DIRECTORY"]
    # one control daemon for the GPU, shared by both, its pipe directory mounted in both
    spec = json.loads(node.driver.cdi.path(a[1]).read_text())
    pipe, shm = spec["devices"][0]["containerEdits"]["mounts"]
    assert pipe["hostPath"] == f"{node.cfg.mps_pipe_dir}/GPU-node-a-00"
    assert (shm["hostPath"], shm["containerPath"]) == ("/run/gpuslice/mps-shm", "/dev/shm")
    assert list(node.driver._mps) == ["GPU-node-a-00"]
    assert node.driver._mps["GPU-node-a-00"].healthy()


def test_the_mps_server_holds_every_client_to_the_largest_share(node: Node) -> None:
    """A client may rewrite its own CUDA_MPS_* environment; MPS only lets a client's values
    lower the server's limits (measured on an H200: docs/gpu-results.md, issue 31), so the
    driver sets the server's own limits to the largest share prepared on the GPU: a 25%
    share, then a 50% one widening them, then a 10% one leaving them (the rule of
    adapters.mps.ensure_ceiling, shared with the node agent)."""
    client = node.serve()
    state = node.root / "mps" / "GPU-node-a-00" / "fake-state.json"
    a = node.add(share("quarter", "5f0a-aaaa", "25", "20Gi"))
    assert client.prepare([a])[a[1]].error == ""
    assert json.loads(state.read_text()) == {"pct": 25.0, "mem": "20480M"}
    b = node.add(share("half", "5f0a-bbbb", "50", "40Gi"))
    c = node.add(share("tenth", "5f0a-cccc", "10", "8Gi"))
    got = client.prepare([b, c])
    assert got[b[1]].error == got[c[1]].error == ""
    assert json.loads(state.read_text()) == {"pct": 50.0, "mem": "40960M"}
    assert node.driver.effects.ceilings["GPU-node-a-00"].thread_pct == 50


def test_a_share_that_would_over_commit_the_gpu_is_refused(node: Node) -> None:
    client = node.serve()
    a = node.add(share("big", "s-1", "60", "40Gi"))
    b = node.add(share("too-much-compute", "s-2", "50", "10Gi"))
    c = node.add(share("too-much-memory", "s-3", "10", "60Gi"))
    d = node.add(share("fits", "s-4", "40", "30Gi"))
    got = client.prepare([a, b, c, d])
    assert got[a[1]].error == ""
    assert "compute would be over-committed: 110%" in got[b[1]].error
    assert "memory would be over-committed" in got[c[1]].error
    assert got[d[1]].error == ""
    assert not node.driver.cdi.path(b[1]).exists()
    # once a share is unprepared, its capacity is free again
    assert client.unprepare([a]) == {a[1]: ""}
    assert client.prepare([b])[b[1]].error == ""


def test_mps_config_may_lower_a_shares_caps_but_not_raise_them(node: Node) -> None:
    client = node.serve()
    lower = node.add(share("lower", "s-1", "50", "20Gi", config=[opaque({
        "apiVersion": "gpuslice.io/v1alpha1", "kind": "MpsConfig",
        "mps": {"activeThreadPercentage": 30, "pinnedMemoryLimit": "10Gi"}})]))
    higher = node.add(share("higher", "s-2", "20", "10Gi", config=[opaque({
        "apiVersion": "gpuslice.io/v1alpha1", "kind": "MpsConfig",
        "mps": {"activeThreadPercentage": 40}})]))
    got = client.prepare([lower, higher])
    assert got[lower[1]].error == ""
    (e,) = env_of(node, lower[1])
    assert (e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], e["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == \
        ("30", "0=10240M")
    assert "activeThreadPercentage" in got[higher[1]].error
    assert "at most the share's compute (20)" in got[higher[1]].error


def test_a_share_result_without_share_id_or_with_bad_capacity_fails_that_claim(
        node: Node) -> None:
    client = node.serve()
    no_id = node.add(claim("no-id", [{"request": "gpu", "device": "gpu-0",
                                      "consumedCapacity": {"compute": "10"}}]))
    bad = node.add(share("bad", "s-9", "150", "1Gi"))
    unknown = node.add(claim("unknown", [{"request": "gpu", "device": "gpu-0",
                                          "shareID": "s-8",
                                          "consumedCapacity": {"sms": "4"}}]))
    got = client.prepare([no_id, bad, unknown])
    assert "shareID" in got[no_id[1]].error
    assert "consumedCapacity.compute" in got[bad[1]].error
    assert "consumedCapacity.sms" in got[unknown[1]].error


def test_whole_gpu_with_mps_config_gets_the_claims_defaults(node: Node) -> None:
    client = node.serve()
    ref = node.add(claim("mps", [{"request": "gpu", "device": "gpu-2"}], config=[opaque({
        "apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 50}}})]))
    assert client.prepare([ref])[ref[1]].error == ""
    (e,) = env_of(node, ref[1])
    assert e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert "GPU-node-a-02" in node.driver._mps


def test_unprepare_quits_the_daemon_it_started_when_the_gpus_last_share_goes(
        node: Node) -> None:
    """What prepare started, unprepare stops: the GPU's MPS daemon (started for its first
    share) runs while any share is prepared there and is quit with the last one, its
    server limits forgotten (the next share starts a new daemon held to its own size)."""
    client = node.serve()
    control = node.root / "mps" / "GPU-node-a-00" / "control"
    a = node.add(share("quarter", "5f0a-aaaa", "25", "20Gi"))
    b = node.add(share("half", "5f0a-bbbb", "50", "40Gi"))
    client.prepare([a, b])
    assert control.exists()
    assert client.unprepare([a]) == {a[1]: ""}
    assert control.exists() and node.driver._mps["GPU-node-a-00"].healthy()  # b is on it
    assert client.unprepare([b]) == {b[1]: ""}
    assert not control.exists() and "GPU-node-a-00" not in node.driver._mps
    # its folders go with it (no share is left on the GPU; issue 57 found them left behind)
    assert not control.parent.exists() and not (node.root / "mps" / "GPU-node-a-00.log").exists()
    c = node.add(share("tenth", "5f0a-cccc", "10", "8Gi"))
    assert client.prepare([c])[c[1]].error == ""
    state = json.loads((control.parent / "fake-state.json").read_text())
    assert state == {"pct": 10.0, "mem": "8192M"}


def test_a_daemon_found_running_is_left_running_on_unprepare(node: Node) -> None:
    """A daemon this driver did not start (the node agent's, or one an earlier driver left
    for running containers) serves its shares and stays after them."""
    from gpuslice.adapters.mps import MpsDaemon

    pipe = node.root / "mps" / "GPU-node-a-00"
    MpsDaemon("GPU-node-a-00", pipe, node.root / "mps" / "x.log",
              binary=node.cfg.mps_binary).start()
    client = node.serve()
    a = node.add(share("quarter", "5f0a-aaaa", "25", "20Gi"))
    assert client.prepare([a])[a[1]].error == ""
    assert client.unprepare([a]) == {a[1]: ""}
    assert (pipe / "control").exists()
