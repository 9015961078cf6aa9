"""A node reboot: the driver's checkpoint survives (under the kubelet's plugin folder), but
the claims' CDI specs (/var/run/cdi, a tmpfs), the MIG instances the driver made, the MPS
daemons with their ceilings and a time-slice setting do not, and the kubelet, whose own
checkpoint says the claims are prepared, may not ask again. The driver restores them all at
start; a restart without a reboot changes nothing."""

from __future__ import annotations

import json
import os
import shutil
import signal

from gpuslice.adapters.mps import MpsDaemon
from gpuslice.adapters.proc import running
from tests.dra.conftest import Node, claim
from tests.dra.test_shares import share
from tests.dra.test_upstream_slices import _ts


def _prepare_three(node: Node) -> list[tuple[str, str, str]]:
    client = node.serve()
    refs = [node.add(share("quarter", "5f0a-aaaa", "25", "20Gi")),
            node.add(claim("mig", [{"request": "mig", "device": "gpu-1-mig-3g40gb-4"}])),
            node.add(claim("ts", [{"request": "gpu", "device": "gpu-2"}], config=[_ts("Long")]))]
    got = client.prepare(refs)
    assert all(got[r[1]].error == "" for r in refs), got
    return refs


def _reboot(node: Node) -> None:
    """What a reboot erases, with the driver stopped: the CDI specs, the MIG instance, the
    MPS daemon and its pipe folders and records (tmpfs), the time-slice."""
    node.stop()
    shutil.rmtree(node.cfg.cdi_dir)
    node.nvml.destroy_instance("GPU-node-a-01", "3g.40gb", 4)
    d = MpsDaemon("GPU-node-a-00", node.root / "mps" / "GPU-node-a-00",
                  node.root / "mps" / "GPU-node-a-00.log")
    pid = d.pid()
    assert pid is not None and running(pid)
    os.kill(pid, signal.SIGKILL)
    shutil.rmtree(node.root / "mps")
    node.nvml.timeslice.clear()


def test_a_reboot_erases_the_effects_and_the_driver_restores_them_at_start(
        node: Node) -> None:
    refs = _prepare_three(node)
    specs = {r[1]: node.driver.cdi.path(r[1]).read_text() for r in refs}
    _reboot(node)
    driver = node.restart()
    assert driver.problems == []
    for r in refs:  # the same CDI devices, so the IDs the kubelet holds resolve
        assert json.loads(driver.cdi.path(r[1]).read_text())["devices"][0]["name"] == \
            json.loads(specs[r[1]])["devices"][0]["name"]
    gpu1 = next(g for g in node.nvml.devices() if g.uuid == "GPU-node-a-01")
    assert [(m.profile, m.start) for m in gpu1.mig] == [("3g.40gb", 4)]
    mig_env = json.loads(driver.cdi.path(refs[1][1]).read_text())["devices"][0]
    assert f"CUDA_VISIBLE_DEVICES={gpu1.mig[0].uuid}" in mig_env["containerEdits"]["env"]
    state = json.loads((node.root / "mps" / "GPU-node-a-00" / "fake-state.json").read_text())
    assert state == {"pct": 25.0, "mem": "20480M"}  # the daemon again, with its ceiling
    assert node.nvml.timeslice["GPU-node-a-02"] == 3
    client = node.serve()  # and the claims unprepare as ever
    assert client.unprepare(refs) == {r[1]: "" for r in refs}


def test_a_claim_that_cannot_be_restored_is_said_loudly(node: Node) -> None:
    refs = _prepare_three(node)
    _reboot(node)
    node.nvml.fail_next_create("GPU-node-a-01", times=1)
    driver = node.restart()
    assert len(driver.problems) == 1 and refs[1][1] in driver.problems[0]
    assert "cannot be restored" in driver.problems[0]
    events = [e for e in node.api.events if e.get("reason") == "ClaimNotRestored"]
    assert len(events) == 1
    assert driver.cdi.path(refs[0][1]).exists() and driver.cdi.path(refs[2][1]).exists()
    assert refs[1][1] in driver.checkpoint.claims  # kept for the kubelet's unprepare
