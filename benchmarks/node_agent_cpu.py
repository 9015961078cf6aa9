"""Steady-state CPU use of the node agent: 8 GPUs, 80 virtual devices, a kubelet following
ListAndWatch. Measures the agent process's CPU time over a window (from /proc), next to an idle
Python process measured over the same window as the baseline.

    python benchmarks/node_agent_cpu.py [--seconds 20]
    python benchmarks/node_agent_cpu.py --real   # on this machine's GPUs (NVML), gate 0.5%
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' kubelet-side driver
from tests.nodeagent.test_device_plugin import KEY, Kubelet

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--real", action="store_true",
                    help="serve this machine's GPUs through NVML (with MPS on) instead of 8 "
                         "simulated ones; the gate is then the GPU tier's 0.5%% of a core")
    args = ap.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="na-bench-") as d:
        work = Path(d)
        sock = work / "dp"
        sock.mkdir()
        (work / "inv.yaml").write_text("gpus:\n" + "".join("  - model: H100-SXM\n"
                                                             for _ in range(8)))
        (work / "cluster.yaml").write_text("nodes:\n  - metadata: {name: n1}\n")
        (work / "key").write_bytes(KEY)
        kubelet = Kubelet(sock).start()
        gpus = (["--mps-pipe-dir", str(work / "mps")] if args.real
                else ["--fake-gpus", str(work / "inv.yaml")])
        agent = subprocess.Popen(
            [sys.executable, "-m", "gpuslice.cli", "node-agent", "--node", "n1", "--key-file",
             str(work / "key"), *gpus, "--socket-dir", str(sock),
             "--replicas", "10", "--fake-cluster", str(work / "cluster.yaml"),
             "--metrics", "127.0.0.1:0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        try:
            if not kubelet.registered.wait(20):
                console.print("[red]the agent did not register[/]")
                return 1
            while not kubelet.lists:
                time.sleep(0.05)
            devices = len(kubelet.lists[0])
            time.sleep(3)  # start-up done
            a0, i0, t0 = cpu_seconds(agent.pid), cpu_seconds(idle.pid), time.monotonic()
            time.sleep(args.seconds)
            a1, i1, t1 = cpu_seconds(agent.pid), cpu_seconds(idle.pid), time.monotonic()
        finally:
            agent.terminate()
            idle.terminate()
            agent.wait(10)
            idle.wait(10)
            kubelet.stop()
    wall = t1 - t0
    pct = 100 * (a1 - a0) / wall
    base = 100 * (i1 - i0) / wall
    what = "this machine's GPUs (NVML)" if args.real else "8 GPUs"
    console.print(f"node agent, {what} x 10 = {devices} virtual devices, {wall:.0f} s: "
                  f"{pct:.2f}% of a core (idle Python process in the same window: {base:.2f}%)",
                  highlight=False)
    gate = 0.5 if args.real else 1.0
    ok = pct < gate
    console.print(f"[{'green' if ok else 'red'}]{'PASS' if ok else 'FAIL'}[/] steady-state CPU "
                  f"{pct:.2f}% < {gate:g}% of a core")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
