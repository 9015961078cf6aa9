"""``gpuslice dra-driver`` as a process: on a fake inventory it needs no NVIDIA driver, MPS
included; its outage flags are checked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("kubernetes", reason="the Kubernetes client (gpuslice[kube]) is needed")

from gpuslice.cli import EXIT_USAGE, main
from gpuslice.core import dra
from tests.dra.conftest import NODE, claim, inventory
from tests.dra.kubelet import DraClient, register
from tests.kube.rest_fake import RestApiServer


def test_fake_share_mode_prepares_a_share_without_the_mps_binary(short_dir: Path) -> None:
    rest = RestApiServer().start()
    proc = None
    try:
        rest.add_node({"metadata": {"name": NODE, "uid": "node-uid"}})
        c = claim("s", [{"request": "gpu", "device": "gpu-0", "shareID": "s-1",
                         "consumedCapacity": {"compute": "30", "memory": "8Gi"}}])
        rest.put_resource_claim(c)
        # no nvidia-cuda-mps-control anywhere on PATH
        env = dict(os.environ, PATH=os.path.dirname(sys.executable))
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuslice.cli", "dra-driver", "--node", NODE,
             "--fake-gpus", str(inventory(short_dir / "gpus.yaml", [{"model": "T4"}])),
             "--mode", "share", "--kubeconfig", str(rest.kubeconfig(short_dir / "kc")),
             "--kubelet-dir", str(short_dir / "k"), "--cdi-dir", str(short_dir / "cdi"),
             "--mps-pipe-dir", str(short_dir / "mps"), "--lease", "none",
             "--metrics", "off"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        reg = short_dir / "k" / "plugins_registry" / f"{dra.DRIVER}-reg.sock"
        deadline = time.monotonic() + 30
        while not reg.exists():
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "no registration socket"
            time.sleep(0.05)
        client = DraClient(register(reg))
        try:
            ref = ("default", c["metadata"]["uid"], "s")
            got = client.prepare([ref])[ref[1]]
            assert got.error == "" and got.devices[0].share_id == "s-1"
        finally:
            client.close()
        gpu = "GPU-node-a-00"  # the fake inventory's UUID
        assert (short_dir / "mps" / gpu / "control").exists()  # the stand-in's daemon
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
        rest.stop()


@pytest.mark.parametrize(("flag", "value"), [("--claim-read-timeout", "0"),
                                             ("--claim-read-timeout", "45"),
                                             ("--max-prepares", "0")])
def test_outage_flags_are_checked(flag: str, value: str) -> None:
    try:  # refused at parse time (argparse exits), or by the command
        code = main(["dra-driver", "--node", NODE, flag, value])
    except SystemExit as exc:
        code = int(exc.code or 0)
    assert code == EXIT_USAGE
