"""Steady-state CPU use of the node agent: 8 GPUs, 80 virtual devices, a kubelet following
ListAndWatch, and (``--pods``, default 56) pods using the GPUs: one CUDA process each, with
memory in use and SM samples, mapped to its pod through a stand-in /proc of their cgroups,
which the agent measures every 10 s (services/pod_usage.py), and a Prometheus scrape of its
metrics every ``--scrape`` seconds (default 15, Prometheus's own default). Measures the agent
process's CPU time over a window (from /proc), next to an idle Python process measured over the
same window as the baseline.

    python benchmarks/node_agent_cpu.py [--seconds 20] [--pods 56] [--scrape 15]
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def count_pod_series(port: int) -> int:
    """Scrape the agent's metrics; the pods whose memory in use they carry."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(1 for line in text.splitlines()
               if line.startswith("gpuslice_pod_gpu_memory_used_bytes{"))


def write_inputs(work: Path, pods: int) -> None:
    """The inventory (8 simulated H100s, the pods' processes on them), the fake cluster (the
    node, the pods with signed assignments and container IDs), the key, and a stand-in /proc
    whose cgroup files name each process's pod and container."""
    import yaml

    from gpuslice.adapters.kube.annotation import encode
    from gpuslice.core.assignment import Assignment, ContainerAssignment, GpuShare, Mode, sign

    (work / "key").write_bytes(KEY)
    gpus: list[dict[str, object]] = [{"model": "H100-SXM", "processes": []} for _ in range(8)]
    docs = []
    for i in range(pods):
        g, pid, uid, cid = i % 8, 10_000 + i, f"00000000-0000-0000-0000-{i:012d}", f"c{i:06d}"
        uuid = f"GPU-n1-{g:02d}"
        procs = gpus[g]["processes"]
        assert isinstance(procs, list)
        procs.append({"pid": pid, "used_mib": 1000 + i, "sm": 5 + i % 10})
        (work / "proc" / str(pid)).mkdir(parents=True)
        (work / "proc" / str(pid) / "cgroup").write_text(
            f"0::/kubepods/besteffort/pod{uid}/{cid}\n")
        a = Assignment("ml", f"p{i}", uid, "n1", (ContainerAssignment(
            "server", Mode.MPS, (GpuShare(uuid, 125, 10000),)),), "t0")
        docs.append({"metadata": {"name": f"p{i}", "namespace": "ml", "uid": uid,
                                  "annotations": {"gpuslice.io/assignment":
                                                  encode(sign(a, KEY))}},
                     "spec": {"nodeName": "n1", "containers": [{"name": "server"}]},
                     "status": {"phase": "Running", "containerStatuses": [
                         {"name": "server", "containerID": f"containerd://{cid}"}]}})
    (work / "inv.yaml").write_text(yaml.safe_dump({"gpus": gpus}))
    (work / "cluster.yaml").write_text(yaml.safe_dump(
        {"nodes": [{"metadata": {"name": "n1"}}], "pods": docs}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--real", action="store_true",
                    help="serve this machine's GPUs through NVML (with MPS on) instead of 8 "
                         "simulated ones; the gate is then the GPU tier's 0.5%% of a core")
    ap.add_argument("--pods", type=int, default=56,
                    help="pods using the 8 simulated GPUs, one CUDA process each (default 56)")
    ap.add_argument("--scrape", type=float, default=15.0,
                    help="seconds between scrapes of the agent's metrics (default 15)")
    args = ap.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="na-bench-") as d:
        work = Path(d)
        sock = work / "dp"
        sock.mkdir()
        write_inputs(work, 0 if args.real else args.pods)
        kubelet = Kubelet(sock).start()
        gpus = (["--mps-pipe-dir", str(work / "mps")] if args.real
                else ["--fake-gpus", str(work / "inv.yaml"), "--proc-root", str(work / "proc")])
        port = free_port()
        agent = subprocess.Popen(
            [sys.executable, "-m", "gpuslice.cli", "node-agent", "--node", "n1", "--key-file",
             str(work / "key"), *gpus, "--socket-dir", str(sock),
             "--replicas", "10", "--fake-cluster", str(work / "cluster.yaml"),
             "--pod-resources-socket", "off", "--metrics", f"127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        try:
            if not kubelet.registered.wait(20):
                console.print("[red]the agent did not register[/]")
                return 1
            while not kubelet.lists:
                time.sleep(0.05)
            devices = len(kubelet.lists[0])
            time.sleep(3)  # start-up done
            series = count_pod_series(port)
            a0, i0, t0 = cpu_seconds(agent.pid), cpu_seconds(idle.pid), time.monotonic()
            while time.monotonic() - t0 < args.seconds:
                time.sleep(min(args.scrape, max(0.0, args.seconds - (time.monotonic() - t0))))
                if time.monotonic() - t0 < args.seconds:
                    series = count_pod_series(port)  # a Prometheus scrape
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
    what = "this machine's GPUs (NVML)" if args.real else f"8 GPUs, {args.pods} pods using them"
    console.print(f"node agent, {what}, x 10 = {devices} virtual devices, {wall:.0f} s, a "
                  f"scrape every {args.scrape:g} s ({series} per-pod series): {pct:.2f}% of a "
                  f"core (idle Python process in the same window: {base:.2f}%)",
                  highlight=False)
    if not args.real and args.pods and series < args.pods:
        console.print(f"[red]FAIL[/] the metrics carry {series} pods' memory, not {args.pods}")
        return 1
    gate = 0.5
    ok = pct < gate
    console.print(f"[{'green' if ok else 'red'}]{'PASS' if ok else 'FAIL'}[/] steady-state CPU "
                  f"{pct:.2f}% < {gate:g}% of a core")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
