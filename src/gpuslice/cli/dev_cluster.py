"""``gpuslice dev-cluster up|down|status``: the real control plane on this machine (etcd,
kube-apiserver, kube-controller-manager, kube-scheduler with deploy/'s gpuslice profile, kwok)
with deploy/base applied, kwok GPU nodes, and ``gpuslice extender`` on its service account; see
:mod:`gpuslice.devcluster` and docs/testing.md."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from gpuslice.adapters.proc import alive as _alive
from gpuslice.cli.common import examples
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.devcluster.realnode import BUSYBOX, NODE_LABEL, NODE_NAME

if TYPE_CHECKING:
    from gpuslice.devcluster import DevCluster

DEFAULT_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpuslice" / \
    "dev-cluster"
DEV_KEY = "dev-only-key-0123456789abcdef0123456789abcdef"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser(
        "dev-cluster", help="a real Kubernetes control plane on loopback (kwok nodes) with "
        "the gpuslice scheduler profile and extender",
        description="up: start etcd, kube-apiserver, kube-controller-manager, kube-scheduler "
        "(deploy/'s gpuslice-scheduler profile) and kwok on 127.0.0.1, apply deploy/base, add "
        "kwok GPU nodes and run `gpuslice extender`; prints the kubeconfig. down: stop all of it "
        "and remove its folder. status: what runs. Binaries: tools/cluster/build.sh.",
        epilog=examples("gpuslice dev-cluster up --nodes 2 --gpus 4",
                        "gpuslice dev-cluster down"))
    d.add_argument("action", choices=("up", "down", "status"),
                   help="up: start the cluster; down: stop it and remove its folder; status: "
                   "what runs")
    d.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                   help=f"the cluster's folder (default {DEFAULT_DIR})")
    d.add_argument("--bin-dir", type=Path, help="folder of the cluster binaries (default "
                   "$GPUSLICE_CLUSTER_BIN, else what tools/cluster/build.sh --bin-dir names)")
    d.add_argument("--repo", type=Path, default=Path.cwd(),
                   help="the gpuslice checkout (deploy/, tools/; default: here)")
    d.add_argument("--nodes", type=int, default=2, help="up: kwok GPU nodes (default 2)")
    d.add_argument("--gpus", type=int, default=4, help="up: GPUs per node (default 4)")
    d.add_argument("--model", default="A100-80GB", help="up: GPU model (default A100-80GB)")
    d.add_argument("--real-node", action="store_true",
                   help="up: also run containerd and a real kubelet on this host (root; "
                   "binaries from tools/node/build.sh) as node gpuslice-real-node, with "
                   "`gpuslice node-agent --fake-gpus` serving --gpus stand-in GPUs on it; down "
                   "restores the host as it was")
    d.add_argument("--node-dir", type=Path, help="folder of tools/node/build.sh's output "
                   "(default $GPUSLICE_NODE_DIR, else what tools/node/build.sh --dir names)")
    d.add_argument("--bare", action="store_true",
                   help="up: Kubernetes alone, to install gpuslice into (the Helm chart or "
                   "deploy/): no deploy/base, no extender, no node agent, kube-scheduler's "
                   "default profile, the API server reachable from pods; with --real-node, "
                   "the node gets pod networking (kube-proxy for Services, CoreDNS for their "
                   "names), which the chart's own pods need")
    d.add_argument("--network", action="store_true",
                   help="up --real-node: pod networking on the real node (kube-proxy, CoreDNS; "
                   "implied by --bare)")
    d.set_defaults(handler=_dev_cluster)


def _dev_cluster(args: argparse.Namespace, console: Console) -> int:
    if args.action == "up":
        return _up(args, console)
    if args.action == "down":
        return _down(args.dir, console)
    return _status(args.dir, console)


def _state(folder: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((folder / "state.json").read_text()))
    except (OSError, ValueError):
        raise GpusliceError(f"no dev cluster in {folder} (gpuslice dev-cluster up)") from None


def _up(args: argparse.Namespace, console: Console) -> int:
    from gpuslice.devcluster import DevCluster, find_bin_dir, gpu_node

    _validate(args)
    folder: Path = args.dir
    if (folder / "state.json").exists():
        raise GpusliceError(f"a dev cluster already has {folder}: gpuslice dev-cluster down "
                            "first (or --dir elsewhere)")
    deploy = args.repo / "deploy"
    if not (deploy / "base" / "scheduler-config.yaml").is_file():
        raise ValidationError("--repo", "the gpuslice checkout (with deploy/base)", args.repo)
    bin_dir = args.bin_dir or find_bin_dir(args.repo)
    t0 = time.monotonic()
    network = args.bare or args.network
    dev = DevCluster(bin_dir, deploy, folder=folder, pod_network=network,
                     scheduler="default" if args.bare else "extender")
    dev.start()
    try:
        key = folder / "assignment.key"
        if not args.bare:
            dev.apply(deploy / "base")
            key.write_text(DEV_KEY)
            dev.start_extender(key)
        if args.nodes:
            dev.add_nodes([gpu_node(f"gpu-node-{i}", args.model, args.gpus)
                           for i in range(args.nodes)])
        if args.real_node:
            _up_real_node(args, dev, None if args.bare else key, console, network)
        dev.write_state()
    except BaseException:
        dev.stop()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    console.print(f"dev cluster up in {time.monotonic() - t0:.0f} s: API server {dev.server}, "
                  f"{args.nodes} kwok node(s) x {args.gpus} {args.model}", highlight=False)
    if args.bare:
        console.print("bare: no gpuslice installed (no deploy/base, extender or node agent); "
                      "install the chart (deploy/README.md, 'Try it on this machine')"
                      + (f"; node {NODE_NAME} has pod networking" if args.real_node else ""),
                      highlight=False)
    if args.real_node and not args.bare:
        console.print(f"real node {NODE_NAME}: containerd + kubelet, node agent on "
                      f"{args.gpus} fake {args.model}; pods select it with nodeSelector "
                      f"{NODE_LABEL}=real (image {BUSYBOX}, imagePullPolicy: Never)",
                      highlight=False)
    console.print(f"export KUBECONFIG={dev.kubeconfig}", highlight=False)
    console.print("pods with schedulerName: gpuslice-scheduler go through the extender; "
                  f"logs in {folder}; stop with: gpuslice dev-cluster down", highlight=False)
    return 0


def _up_real_node(args: argparse.Namespace, dev: DevCluster, key: Path | None,
                  console: Console, network: bool = False) -> None:
    """containerd + the kubelet (RealNode, with pod networking when ``network``) and, with a
    ``key``, the node agent on fake GPUs with stand-in device nodes, on the node agent's
    service account."""
    import sys

    from gpuslice.devcluster import wait_until
    from gpuslice.devcluster.realnode import (
        STATE_DIR,
        RealNode,
        find_node_dir,
        make_stand_in_devices,
    )

    node_dir = args.node_dir or find_node_dir(args.repo)
    console.print("starting containerd and the kubelet ...")
    node = RealNode(dev, node_dir, network=network).start()
    if key is None:
        return  # bare: what runs on the node is what the user installs
    dev_dir = make_stand_in_devices(STATE_DIR / "dev", args.gpus)
    inv = node.folder / "inventory.yaml"
    inv.write_text("gpus:\n" + "".join(f"  - model: {args.model}\n" for _ in range(args.gpus)))
    kubeconfig = dev.service_account_kubeconfig("gpuslice-system", "gpuslice-node-agent")
    for d in ("mps", "mps-shm"):
        (STATE_DIR / d).mkdir(exist_ok=True)
    agent = dev._add("gpuslice-node-agent", [
        sys.executable, "-m", "gpuslice.cli", "node-agent", "--node", node.name,
        "--key-file", str(key), "--fake-gpus", str(inv), "--metrics", "off",
        "--dev-dir", str(dev_dir), "--mps-pipe-dir", str(STATE_DIR / "mps"),
        "--mps-shm-dir", str(STATE_DIR / "mps-shm"), "--kubeconfig", str(kubeconfig)])

    def served() -> bool:
        out = dev.kubectl("get", "node", node.name, "-o",
                          "jsonpath={.status.allocatable.gpuslice\\.io/gpu}", check=False)
        return out.returncode == 0 and out.stdout.strip() not in ("", "0")

    wait_until("node agent: gpuslice.io/gpu on the real node", served, 90, agent.popen,
               agent.log)


def _down(folder: Path, console: Console) -> int:
    state = _state(folder)
    if state.get("real_node"):
        _down_real_node(state, console)
    pids = {n: int(p) for n, p in (state.get("pids") or {}).items() if p}
    for name, pid in reversed(list(pids.items())):
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            console.print(f"stopping {name} (pid {pid})")
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids.values():
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    shutil.rmtree(folder, ignore_errors=True)
    console.print(f"dev cluster stopped; {folder} removed")
    return 0


def _down_real_node(state: dict[str, Any], console: Console) -> None:
    """Delete the real node's pods (while the API server still runs), stop the node agent, the
    kubelet and containerd, and restore the host from the snapshot taken at up."""
    import subprocess

    from gpuslice.devcluster.realnode import NodeState, teardown

    node = NodeState.read(Path(state["real_node"]))
    kubectl_bin = Path(state["bin_dir"]) / "kubectl"

    def kubectl(*args: str, check: bool = False, timeout_s: float = 120.0,
                ) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(kubectl_bin), f"--kubeconfig={state['kubeconfig']}", *args],
                              capture_output=True, text=True, timeout=timeout_s, check=check)

    console.print(f"stopping the real node {node.name} (pods, kubelet, containerd) ...")
    agent = (state.get("pids") or {}).get("gpuslice-node-agent")
    if agent and _alive(int(agent)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(agent), signal.SIGTERM)
    left = teardown(node, kubectl)
    if left:
        console.print("[yellow]the host still differs from before up:[/]\n  "
                      + "\n  ".join(left))
    else:
        console.print("host restored: sysctls, iptables, mounts, cgroups, links and files as "
                      "before up")


def _status(folder: Path, console: Console) -> int:
    state = _state(folder)
    t = Table(title=f"dev cluster in {folder}")
    t.add_column("component")
    t.add_column("pid")
    t.add_column("running")
    down = 0
    for name, pid in (state.get("pids") or {}).items():
        up = bool(pid) and _alive(int(pid))
        down += not up
        t.add_row(name, str(pid), "yes" if up else "NO")
    console.print(t)
    console.print(f"API server {state['server']}; KUBECONFIG={state['kubeconfig']}",
                  highlight=False)
    return 0 if down == 0 else 1


def _validate(args: argparse.Namespace) -> None:
    if args.network and not args.real_node:
        raise ValidationError("--network", "with --real-node (pod networking is the real "
                              "node's)", "without it")
    if args.nodes < 0:
        raise ValidationError("--nodes", "a number of nodes >= 0", args.nodes)
    if args.gpus < 1:
        raise ValidationError("--gpus", "at least 1 GPU per node", args.gpus)
