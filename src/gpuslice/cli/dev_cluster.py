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
from typing import Any

from rich.console import Console
from rich.table import Table

from gpuslice.adapters.proc import alive as _alive
from gpuslice.core.errors import GpusliceError, ValidationError

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
        "and remove its folder. status: what runs. Binaries: tools/cluster/build.sh.")
    d.add_argument("action", choices=("up", "down", "status"))
    d.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                   help=f"the cluster's folder (default {DEFAULT_DIR})")
    d.add_argument("--bin-dir", type=Path, help="folder of the cluster binaries (default "
                   "$GPUSLICE_CLUSTER_BIN, else what tools/cluster/build.sh --bin-dir names)")
    d.add_argument("--repo", type=Path, default=Path.cwd(),
                   help="the gpuslice checkout (deploy/, tools/; default: here)")
    d.add_argument("--nodes", type=int, default=2, help="up: kwok GPU nodes (default 2)")
    d.add_argument("--gpus", type=int, default=4, help="up: GPUs per node (default 4)")
    d.add_argument("--model", default="A100-80GB", help="up: GPU model (default A100-80GB)")
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
    dev = DevCluster(bin_dir, deploy, folder=folder)
    dev.start()
    try:
        dev.apply(deploy / "base")
        key = folder / "assignment.key"
        key.write_text(DEV_KEY)
        dev.start_extender(key)
        if args.nodes:
            dev.add_nodes([gpu_node(f"gpu-node-{i}", args.model, args.gpus)
                           for i in range(args.nodes)])
        dev.write_state()
    except BaseException:
        dev.stop()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    console.print(f"dev cluster up in {time.monotonic() - t0:.0f} s: API server {dev.server}, "
                  f"{args.nodes} kwok node(s) x {args.gpus} {args.model}", highlight=False)
    console.print(f"export KUBECONFIG={dev.kubeconfig}", highlight=False)
    console.print("pods with schedulerName: gpuslice-scheduler go through the extender; "
                  f"logs in {folder}; stop with: gpuslice dev-cluster down", highlight=False)
    return 0


def _down(folder: Path, console: Console) -> int:
    state = _state(folder)
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
    if args.nodes < 0:
        raise ValidationError("--nodes", "a number of nodes >= 0", args.nodes)
    if args.gpus < 1:
        raise ValidationError("--gpus", "at least 1 GPU per node", args.gpus)
