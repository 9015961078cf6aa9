"""A claim whose containers run several CUDA processes: the opaque config's
``mps.processes`` divides the share's pinned memory among them (MPS caps each client), in
the CDI environment and in the server's ceiling (tests/nodeagent/test_processes.py: the
device-plugin path)."""

from __future__ import annotations

import json

from tests.dra.conftest import Node, opaque
from tests.dra.test_shares import env_of, share


def test_a_claim_with_four_processes_gets_a_quarter_per_process(node: Node) -> None:
    client = node.serve()
    a = node.add(share("llm", "5f0a-aaaa", "50", "16Gi", config=[opaque(
        {"apiVersion": "gpuslice.io/v1alpha1", "kind": "MpsConfig",
         "mps": {"processes": 4}})]))
    assert client.prepare([a])[a[1]].error == ""
    (env,) = env_of(node, a[1])
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    state = json.loads((node.root / "mps" / "GPU-node-a-00" / "fake-state.json").read_text())
    assert state["mem"] == "4096M"  # the server's ceiling: one process's part
    bad = node.add(share("odd", "5f0a-bbbb", "10", "1Gi", config=[opaque(
        {"apiVersion": "gpuslice.io/v1alpha1", "kind": "MpsConfig",
         "mps": {"processes": 0}})]))
    assert "mps.processes" in client.prepare([bad])[bad[1]].error


def test_a_restarted_driver_adopts_its_daemon_and_quits_it_with_the_last_share(
        node: Node) -> None:
    """The driver's daemon outlives the driver (killed, upgraded); the next driver adopts it
    from its record, with its ceiling, and quits it when the GPU's last share goes (before,
    an adopted daemon was never quit: a leak with every driver restart)."""
    from gpuslice.adapters.mps import Ceiling
    from gpuslice.adapters.mps.host import read_want

    client = node.serve()
    a = node.add(share("quarter", "5f0a-aaaa", "25", "20Gi"))
    assert client.prepare([a])[a[1]].error == ""
    control = node.root / "mps" / "GPU-node-a-00" / "control"
    pid = node.driver.effects.keeper.daemon("GPU-node-a-00").pid()
    driver = node.restart()  # no unprepare, no quit: as after kill -9
    assert driver.effects.ceilings["GPU-node-a-00"] == Ceiling(25, 20480)
    assert driver.effects.keeper.daemon("GPU-node-a-00").pid() == pid and control.exists()
    client = node.serve()
    assert client.unprepare([a]) == {a[1]: ""}
    assert not control.exists() and read_want(node.root / "mps", "GPU-node-a-00") is None
