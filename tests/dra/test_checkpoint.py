"""Idempotency, the checkpoint, restarts.

The kubelet retries a prepare that failed or whose answer it lost, and may unprepare through
another driver process (KEP-4381; the kubeletplugin helper keeps nothing for the driver:
"It is the responsibility of the DRA driver to cache whatever additional information it
might need", dynamic-resource-allocation kubeletplugin/draplugin.go). So a prepare is
recorded before any effect (PrepareStarted) and after the last (PrepareCompleted), in a
checksummed file written atomically."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuslice.adapters.dra.cdi import CdiDevice
from gpuslice.adapters.dra.checkpoint import COMPLETED, STARTED, Checkpoint, CheckpointError
from gpuslice.core import dra
from tests.dra.conftest import NODE, Node, claim, inventory
from tests.dra.kubelet import DraClient, register
from tests.fake_mps import write_fake_mps
from tests.kube.rest_fake import RestApiServer


def share(name: str, sid: str, compute: str, memory: str) -> dict:  # type: ignore[type-arg]
    return claim(name, [{"request": "gpu", "device": "gpu-0", "shareID": sid,
                         "consumedCapacity": {"compute": compute, "memory": memory}}])


def test_a_repeated_prepare_gives_the_same_answer_without_redoing_it(node: Node) -> None:
    client = node.serve()
    ref = node.add(share("s", "s-1", "30", "8Gi"))
    first = client.prepare([ref])[ref[1]]
    mtime = node.driver.cdi.path(ref[1]).stat().st_mtime_ns
    second = client.prepare([ref])[ref[1]]
    assert second == first
    assert node.driver.cdi.path(ref[1]).stat().st_mtime_ns == mtime
    # the claim is read first (kubeletplugin draplugin.go, getResourceClaims): a claim gone
    # from the API server is an error, and its preparation stays until it is unprepared
    node.api.delete_resource_claim("default", "s")
    assert "not found" in client.prepare([ref])[ref[1]].error
    assert node.driver.checkpoint.get(ref[1]) is not None
    assert client.unprepare([ref]) == {ref[1]: ""}


def test_a_restarted_driver_answers_and_unprepares_what_the_previous_one_prepared(
        node: Node) -> None:
    client = node.serve()
    ref = node.add(share("s", "s-1", "60", "8Gi"))
    first = client.prepare([ref])[ref[1]]
    node.restart()
    client = node.serve()
    assert client.prepare([ref])[ref[1]] == first
    # the restarted driver still counts the share: no double assignment
    over = node.add(share("over", "s-2", "50", "8Gi"))
    assert "over-committed" in client.prepare([over])[over[1]].error
    assert client.unprepare([ref]) == {ref[1]: ""}
    assert client.prepare([over])[over[1]].error == ""


def test_the_checkpoint_is_checksummed_and_a_corrupt_one_is_refused(tmp_path: Path) -> None:
    cp = Checkpoint(tmp_path / "cp.json")
    cp.put("u1", {"state": COMPLETED, "devices": []})
    doc = json.loads((tmp_path / "cp.json").read_text())
    assert doc["version"] == 1 and len(doc["checksum"]) == 64
    assert Checkpoint(tmp_path / "cp.json").get("u1") == {"state": COMPLETED, "devices": []}
    doc["data"]["claims"]["u1"]["state"] = STARTED  # changed without the checksum
    (tmp_path / "cp.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="corrupt"):
        Checkpoint(tmp_path / "cp.json")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_stale_cdi_specs_are_removed_at_start_and_checkpointed_ones_kept(node: Node) -> None:
    client = node.serve()
    ref = node.add(share("s", "s-1", "30", "8Gi"))
    assert client.prepare([ref])[ref[1]].error == ""
    node.driver.cdi.write("crashed-claim", [CdiDevice("crashed-claim-gpu-2")])
    assert node.driver.cdi.claims() == {ref[1], "crashed-claim"}
    node.restart()
    assert node.driver.cdi.claims() == {ref[1]}


def _driver_process(root: Path, kubeconfig: Path, hang: Path) -> subprocess.Popen[bytes]:
    inv = inventory(root / "gpus.yaml", [{"model": "H100-SXM"}])
    # the installed gpuslice (a non-editable install carries the compiled kubelet protos that
    # src/ lacks), as an operator runs it
    env = dict(os.environ, FAKE_MPS_HANG=str(hang))
    return subprocess.Popen(
        [sys.executable, "-m", "gpuslice.cli", "dra-driver",
         "--node", NODE, "--kubelet-dir", str(root / "k"), "--cdi-dir", str(root / "cdi"),
         "--mode", "share", "--fake-gpus", str(inv), "--kubeconfig", str(kubeconfig),
         "--mps-pipe-dir", str(root / "mps"), "--mps-binary", str(root / "mps-control"),
         "--poll", "0.2", "--metrics", "off"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait(path: Path, proc: subprocess.Popen[bytes], what: str) -> None:
    for _ in range(600):
        if path.exists():
            return
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"driver exited ({proc.returncode}) before {what}: {out}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_driver_killed_mid_prepare_loses_nothing_and_never_double_assigns(
        short_dir: Path) -> None:
    """The driver process is SIGKILLed while it starts the GPU's MPS daemon for a share
    (after reserving the share in its checkpoint); the restarted process finishes that claim
    on the kubelet's retry and still counts it against other shares."""
    rest = RestApiServer().start()
    try:
        rest.add_node({"metadata": {"name": NODE, "uid": "node-uid"}})
        kubeconfig = rest.kubeconfig(short_dir / "kubeconfig")
        write_fake_mps(short_dir / "mps-control")
        hang = short_dir / "hang"
        hang.touch()
        a = share("a", "s-a", "70", "40Gi")
        b = share("b", "s-b", "40", "10Gi")
        for c in (a, b):
            rest.put_resource_claim(c)
        ref_a = ("default", a["metadata"]["uid"], "a")
        ref_b = ("default", b["metadata"]["uid"], "b")
        reg_socket = short_dir / "k" / "plugins_registry" / f"{dra.DRIVER}-reg.sock"

        proc = _driver_process(short_dir, kubeconfig, hang)
        _wait(reg_socket, proc, "its registration socket")
        client = DraClient(register(reg_socket))
        import threading

        answer: list[object] = []
        t = threading.Thread(target=lambda: answer.append(
            _try(lambda: client.prepare([ref_a]))), daemon=True)
        t.start()
        _wait(Path(str(hang) + ".reached"), proc, "the MPS start of the share")
        cp = json.loads((short_dir / "k" / "plugins" / dra.DRIVER / "checkpoint.json")
                        .read_text())
        assert cp["data"]["claims"][ref_a[1]]["state"] == STARTED
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        t.join(10)
        client.close()
        assert answer and isinstance(answer[0], Exception)  # the kubelet saw no answer

        hang.unlink()  # the next MPS start works
        (short_dir / "k" / "plugins_registry" / f"{dra.DRIVER}-reg.sock").unlink()
        proc = _driver_process(short_dir, kubeconfig, hang)
        try:
            _wait(reg_socket, proc, "its registration socket after the restart")
            client = DraClient(register(reg_socket))
            got = client.prepare([ref_a, ref_b])  # the kubelet's retry, and another share
            assert got[ref_a[1]].error == ""
            assert got[ref_a[1]].devices[0].share_id == "s-a"
            assert "over-committed" in got[ref_b[1]].error  # 70% + 40% > 100%
            assert (short_dir / "cdi" / f"k8s.gpu.gpuslice.io-claim_{ref_a[1]}.json").exists()
            assert client.unprepare([ref_a]) == {ref_a[1]: ""}
            assert client.prepare([ref_b])[ref_b[1]].error == ""
            client.close()
            # its slices reached the API server through the real Kubernetes client
            slices = rest.list_resource_slices(dra.DRIVER, NODE)
            assert [d["name"] for s in slices for d in s["spec"].get("devices", [])] == \
                ["gpu-0"]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
    finally:
        rest.stop()


def _try(fn):  # type: ignore[no-untyped-def]
    try:
        return fn()
    except Exception as exc:
        return exc


def test_a_full_disk_fails_that_claim_only_and_memory_agrees_with_the_file(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint write that fails (ENOSPC) fails the claim it was for, not the batch, and
    leaves the checkpoint in memory as the file still holds it (before: memory changed first,
    and the OSError escaped the prepare of every claim in the call)."""
    import errno

    from gpuslice.adapters.dra import checkpoint as ckpt

    client = node.serve()
    a, b = node.add(share("a", "s-a", "20", "4Gi")), node.add(share("b", "s-b", "20", "4Gi"))
    real = ckpt.write_atomic
    full = {"on": "", "all": ""}  # "b": writes that record claim b fail; "all": every write

    def write(path: Path, data: bytes, mode: int = 0o644) -> None:
        if full["on"] == "all" or (full["on"] == "b" and b'"b"' in data):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data, mode)

    monkeypatch.setattr(ckpt, "write_atomic", write)
    full["on"] = "b"
    got = client.prepare([a, b])
    assert got[a[1]].error == "" and "No space left" in got[b[1]].error
    on_disk = Checkpoint(node.driver.checkpoint.path).claims
    assert on_disk == node.driver.checkpoint.claims and set(on_disk) == {a[1]}
    full["on"] = ""
    assert client.prepare([b])[b[1]].error == ""  # the kubelet's retry, with room again
    full["on"] = "all"  # and a full disk again when the kubelet unprepares b
    assert "No space left" in client.unprepare([b])[b[1]]
    assert set(node.driver.checkpoint.claims) == {a[1], b[1]}  # still there, as on disk
    assert Checkpoint(node.driver.checkpoint.path).claims == node.driver.checkpoint.claims
