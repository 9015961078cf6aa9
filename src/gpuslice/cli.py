"""``gpuslice`` command line.

``main()`` returns an exit code: 0 ok, 1 a checked layout is invalid, 2 bad input,
130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpuslice import __version__
from gpuslice.core import catalog, mig
from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.policies import make_policy, policy_names

if TYPE_CHECKING:
    from gpuslice.adapters.nvml.port import NvmlPort

KUBECONFIG_HELP = ("kubeconfig file (default: the service account's in a pod, else $KUBECONFIG "
                   "or ~/.kube/config)")
DEFAULT_POLICIES = ("random", "dotprod", "gpu-clustering", "gpu-packing", "bestfit", "fgd",
                    "ours")


def parse_seeds(text: str) -> list[int]:
    """``42-51``, ``42,43`` or ``42`` -> a list of seeds."""
    seeds: list[int] = []
    for part in text.split(","):
        item = part.strip()
        if not item:
            continue
        lo, sep, hi = item.partition("-")
        try:
            if sep:
                a, b = int(lo), int(hi)
                if b < a:
                    raise ValueError
                seeds.extend(range(a, b + 1))
            else:
                seeds.append(int(item))
        except ValueError:
            raise ValidationError("--seeds", "seeds like 42-51, 42,43 or 42", text) from None
    if not seeds:
        raise ValidationError("--seeds", "at least one seed", text)
    return seeds


def parse_policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise ValidationError("--policy", f"policy names from {', '.join(policy_names())}", text)
    for n in names:
        make_policy(n)
    return names


def _build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gpuslice", description=__doc__)
    ap.add_argument("--version", action="version", version=f"gpuslice {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    sim = sub.add_parser(
        "simulate",
        help="replay a cluster trace against placement policies (FGD protocol)",
        description="Replay a task trace against placement policies: tasks arrive one by one "
        "and never leave; metrics in 1%% bins of arrived GPU demand. With no --trace it runs "
        "an embedded generated scenario.",
    )
    src = sim.add_mutually_exclusive_group()
    src.add_argument("--trace", type=Path, help="pod list CSV (Alibaba openb format)")
    src.add_argument("--variant", help="a trace variant from the shared data folder "
                     "(default, gpushare40, ...); needs GPUSLICE_DATA or ../shared")
    sim.add_argument("--nodes", type=Path, help="node list CSV (with --trace)")
    sim.add_argument("--policy", default=",".join(DEFAULT_POLICIES),
                     help=f"comma-separated policies (default: all); known: "
                     f"{', '.join(policy_names())}")
    sim.add_argument("--seeds", default=None, help="seeds, e.g. 42-51 (default: 42-51 for a "
                     "trace, 42-44 for the embedded scenario)")
    sim.add_argument("--tune", type=float, default=1.3,
                     help="resize the task list to this multiple of GPU capacity (default 1.3)")
    sim.add_argument("--out", type=Path, default=Path("gpuslice-sim"),
                     help="output folder (default ./gpuslice-sim)")
    sim.add_argument("--workers", type=int, default=0, help="processes (default: CPU count)")
    sim.add_argument("--ties", choices=("order", "random"), default="order",
                     help="break score ties by a fixed random node order per seed (as the FGD "
                     "simulator does; default) or uniformly per decision")
    sim.add_argument("--compare", nargs="?", const="auto", default=None, metavar="CSV",
                     help="print the published FGD results beside ours (default file from "
                     "the shared data folder)")
    sim.add_argument("--no-plot", action="store_true", help="skip the PNG plot")

    g = sub.add_parser("gpus", help="list the GPU catalogue, or this machine's GPUs (--local)",
                       description="Without options: the catalogue of GPU models the planner and "
                       "extender know. --local: the GPUs NVML reports on this machine, with their "
                       "MIG profiles and placements checked against the catalogue.")
    g.add_argument("--local", action="store_true", help="this machine's GPUs, through NVML")
    g.add_argument("--fake-gpus", type=Path, help="with --local: a fake NVML inventory (YAML)")
    m = sub.add_parser("mig", help="MIG geometry of a GPU model: maximal layouts, or check one")
    m.add_argument("model", help="GPU model, e.g. A100-80GB, H100-SXM, A30")
    m.add_argument("--layout", help="check a layout such as '3g.40gb@0,2g.20gb@4,1g.10gb@6'")
    m.add_argument("--used", help="partly used GPU: list what still fits next to this layout")
    _add_router_parser(sub)
    _add_demo_parser(sub)
    _add_local_parsers(sub)
    _add_reconfig_parser(sub)
    _add_replan_parser(sub)
    _add_profile_parser(sub)
    _add_bench_parser(sub)
    _add_plan_parser(sub)
    e = sub.add_parser(
        "extender", help="kube-scheduler extender: filter, prioritize and bind over HTTP(S)",
        description="Serve kube-scheduler's extender verbs (POST /filter, /prioritize, /bind) "
        "with GPU-level accounting and signed assignments. Talks to the API server from "
        "--kubeconfig (else in-cluster), or runs on a local --fake-cluster file to try it out.",
    )
    e.add_argument("--listen", default="0.0.0.0:8443", help="HOST:PORT (default 0.0.0.0:8443)")
    e.add_argument("--key-file", type=Path, required=True,
                   help="file holding the HMAC key shared with the node agents (>= 16 bytes)")
    e.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    e.add_argument("--tls-key", help="the certificate's private key (PEM)")
    e.add_argument("--client-ca", help="require client certificates signed by this CA")
    e.add_argument("--policy", default="bestfit", help="core policy for prioritize (default "
                   "bestfit; one that needs no target workload)")
    src = e.add_mutually_exclusive_group()
    src.add_argument("--kubeconfig", help=KUBECONFIG_HELP)
    src.add_argument("--fake-cluster", type=Path,
                     help="YAML with 'nodes' and 'pods' lists: an in-memory API server")
    e.add_argument("--context", help="kubeconfig context")
    na = sub.add_parser(
        "node-agent", help="node agent: NVML discovery, kubelet device plugin, health, labels",
        description="Serve gpuslice.io/gpu to the kubelet (device plugin API v1beta1), execute "
        "the extender's signed assignments, publish the GPU inventory and GFD labels on the "
        "node, and follow GPU health. --fake runs it on a YAML inventory instead of NVML.",
    )
    ma = sub.add_parser(
        "mig-apply", help="apply a MIG layout from a mig-parted config (only on idle GPUs)",
        description="Apply one config of an NVIDIA mig-parted file (mig-devices counts, or "
        "gpuslice's mig-placements) to this node's MIG-enabled GPUs; never changes MIG mode; "
        "--dry-run prints what would change.",
    )
    ma.add_argument("file", type=Path, help="mig-parted YAML (version v1, mig-configs)")
    ma.add_argument("--config", required=True, help="the config name inside the file")
    ma.add_argument("--dry-run", action="store_true", help="show the changes, change nothing")
    ma.add_argument("--fake", type=Path, help="fake NVML: a YAML GPU inventory")
    ma.add_argument("--node", help="label this node with the progress (in-cluster access, "
                    "--kubeconfig or --fake-cluster)")
    msrc = ma.add_mutually_exclusive_group()
    msrc.add_argument("--kubeconfig", help=KUBECONFIG_HELP)
    msrc.add_argument("--fake-cluster", type=Path, help="YAML with 'nodes' (for trying it out)")
    na.add_argument("--node", help="this node's name (default $NODE_NAME)")
    na.add_argument("--key-file", type=Path, required=True,
                    help="file holding the HMAC key shared with the extender")
    na.add_argument("--fake", type=Path, help="fake NVML: a YAML GPU inventory")
    na.add_argument("--socket-dir", type=Path, default=Path("/var/lib/kubelet/device-plugins"),
                    help="the kubelet's device plugin directory")
    na.add_argument("--replicas", type=int, default=10, help="virtual devices per GPU")
    na.add_argument("--mig-strategy", choices=("none", "single", "mixed"), default="none",
                    help="none: the extender names GPUs and MIG instances (default); single: "
                    "every MIG instance is one gpuslice.io/gpu; mixed: gpuslice.io/mig-<profile>")
    na.add_argument("--quiet", type=float, default=60.0,
                    help="seconds without errors before a faulty GPU is healthy again")
    na.add_argument("--metrics", default="0.0.0.0:9402",
                    help="HOST:PORT of the Prometheus endpoint ('off' to disable)")
    na.add_argument("--no-mps", action="store_true",
                    help="do not start MPS control daemons (MPS slices then share the GPU "
                    "without caps)")
    na.add_argument("--quit-mps-on-exit", action="store_true",
                    help="quit the MPS daemons when the agent stops (default: leave them to "
                    "the pods using them; a restarted agent adopts them)")
    na.add_argument("--mps-pipe-dir", default="/run/gpuslice/mps",
                    help="host directory of the MPS pipe directories")
    na.add_argument("--pod-resources-socket",
                    default="/var/lib/kubelet/pod-resources/kubelet.sock",
                    help="the kubelet's PodResources API ('off' not to ask): pods it gave "
                    "devices to are not waiting for Allocate, even while Pending")
    nsrc = na.add_mutually_exclusive_group()
    nsrc.add_argument("--kubeconfig", help=KUBECONFIG_HELP)
    nsrc.add_argument("--fake-cluster", type=Path, help="YAML with 'nodes' and 'pods'")
    e.add_argument("--leader-elect", action="store_true",
                   help="several replicas: only the holder of the Lease binds")
    e.add_argument("--lease", default="gpuslice-system/gpuslice-extender",
                   help="NAMESPACE/NAME of the Lease (default gpuslice-system/gpuslice-extender)")
    e.add_argument("--resync", type=float, default=300.0,
                   help="seconds between full re-reads of nodes and pods, besides the watch "
                   "(default 300)")
    return ap


def _add_plan_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan", help="SLA planner: the fewest (or cheapest) GPU slices that meet every SLO",
        description="Plan MIG slices (with MPS processes inside) for services with request "
        "rates and latency SLOs, from measured profiles; check the plan by replaying Poisson "
        "arrivals through it; optionally export mig-parted configs and Kubernetes manifests.",
    )
    p.add_argument("--profiles", type=Path, required=True,
                   help="ParvaGPU folder (with prof_data/) or a gpuslice profile CSV")
    p.add_argument("--slo-rate", type=Path, help="ParvaGPU SLO_req_rate.csv (default: "
                   "PROFILES/SLO/SLO_req_rate.csv)")
    p.add_argument("--slo-latency", type=Path, help="ParvaGPU SLO_latency.csv (default: "
                   "PROFILES/SLO/SLO_latency.csv)")
    p.add_argument("--scenario", type=int, help="scenario (row) of the SLO files, from 1")
    p.add_argument("--services", type=Path,
                   help="services YAML/JSON: [{name, model, rate, slo_ms}] (instead of SLO files)")
    p.add_argument("--fleet", type=Path,
                   help="fleet YAML/JSON: [{gpu, count, cost_per_hour}] (default: unlimited "
                   "GPUs of every profiled type)")
    p.add_argument("--objective", choices=("gpus", "cost"), default="gpus")
    p.add_argument("--solver", choices=("auto", "milp", "greedy"), default="auto")
    p.add_argument("--latency-factor", type=float, default=0.45,
                   help="a configuration serves a model only if its batch latency <= this x "
                   "SLO (default 0.45, ParvaGPU's rule)")
    p.add_argument("--no-mix", action="store_true",
                   help="one service per MIG instance (no MPS sharing between services)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the replay-driven re-planning (the final replay still runs)")
    p.add_argument("--time-limit", type=float, default=1.0,
                   help="solver seconds per planning round (default 1.0)")
    p.add_argument("--json", type=Path, help="write the plan as JSON here")
    p.add_argument("--export", type=Path,
                   help="write plan.json, mig-parted.yaml and manifests.yaml into this folder")
    p.add_argument("--seed", type=int, default=1, help="seed of the replay")


def _add_router_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser(
        "router", help="HTTP reverse proxy routing inference requests to the replica that will "
        "answer soonest (or --export mesh weights)",
        description="Route each inference request to the replica that will answer it soonest. "
        "Replicas come from --config (JSON or TOML; reloaded when the file changes or on "
        "SIGHUP), the planner's --plan, or Kubernetes --endpointslices NAMESPACE/SERVICE.",
    )
    src = r.add_mutually_exclusive_group()
    src.add_argument("--config", type=Path, help="router config (JSON or TOML)")
    src.add_argument("--plan", type=Path, help="the planner's JSON plan (weights from it)")
    r.add_argument("--endpointslices", metavar="NS/SERVICE",
                   help="replicas from the EndpointSlices of a Service (weights from "
                   "--plan/--config when given, matched by pod name)")
    r.add_argument("--kube-api", help="API server URL (default: in-cluster)")
    r.add_argument("--port-name", help="EndpointSlice port name (default: the first port)")
    r.add_argument("--listen", default="0.0.0.0:8080", help="HOST:PORT (default 0.0.0.0:8080)")
    r.add_argument("--admin", default="0.0.0.0:9901",
                   help="HOST:PORT for /metrics, /replicas, /reload, /healthz ('off' to disable)")
    r.add_argument("--policy", help="routing policy for every service (default from the "
                   "config, else sed): round-robin, weighted-round-robin, least-outstanding, "
                   "p2c, sed")
    r.add_argument("--slo-ms", type=float, help="latency SLO for admission control (overrides "
                   "the services' slo_ms)")
    r.add_argument("--no-admission", action="store_true",
                   help="never answer 429: queue every request")
    r.add_argument("--access-log", default="-", help="'-' stdout (default), a file, or 'off'")
    r.add_argument("--export", choices=("istio", "envoy"),
                   help="print Istio DestinationRule/VirtualService or Envoy endpoint weights "
                   "for the plan or config and exit")
    r.add_argument("--namespace", default="default", help="namespace of exported Istio objects")


def _router(args: argparse.Namespace, console: Console) -> int:
    import json

    from gpuslice.adapters.http.config import read_config
    from gpuslice.services import mesh_export
    from gpuslice.services.router import ServeOptions, parse_hostport, run

    if args.export:
        path = args.plan or args.config
        if path is None:
            raise ValidationError("--plan", "a plan or config to export weights from", None)
        cfg = read_config(path, need_urls=args.export == "envoy",
                          field="--plan" if args.plan else "--config")
        doc = mesh_export.istio(cfg, args.namespace) if args.export == "istio" \
            else mesh_export.envoy(cfg)
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0
    if args.slo_ms is not None and not args.slo_ms > 0:
        raise ValidationError("--slo-ms", "a positive number of milliseconds", args.slo_ms)
    if args.policy is not None:
        from gpuslice.core.routing import make_routing_policy

        make_routing_policy(args.policy)
    opts = ServeOptions(
        listen=parse_hostport("--listen", args.listen),
        admin=None if args.admin == "off" else parse_hostport("--admin", args.admin),
        policy=args.policy, slo_ms=args.slo_ms, admission=not args.no_admission,
        access_log=args.access_log, config=args.config, plan=args.plan,
        endpointslices=args.endpointslices, kube_api=args.kube_api, port_name=args.port_name,
    )
    if opts.config is None and opts.plan is None and opts.endpointslices is None:
        raise ValidationError("--config", "a router config, a --plan or --endpointslices", None)
    try:
        run(opts)
    except OSError as exc:
        raise ValidationError("--listen", "a free address to listen on", str(exc)) from None
    return 0


def _add_demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser(
        "demo", help="every gpuslice component on this machine, on a simulated cluster",
        description="Bring up the real node agents (device plugin over gRPC), extender, "
        "planner and router on this machine, with the API server, kubelet, scheduler and GPUs "
        "simulated; run a scripted scenario (plan, deploy, serve load, crash a replica, re-slice "
        "a GPU under load, add a node) and write a one-page HTML report.")
    d.add_argument("--out", type=Path, default=Path("demo-report"),
                   help="folder for index.html, summary.json and the plots (default "
                   "demo-report)")
    d.add_argument("--short", action="store_true", help="a shortened scenario (about 35 s)")
    d.add_argument("--seed", type=int, default=1)
    d.add_argument("--no-live", action="store_true",
                   help="print events line by line instead of a live display")
    d.add_argument("--no-local-gpus", action="store_true",
                   help="do not add this machine's NVIDIA GPUs (real NVML and MPS) as a node")


def _demo(args: argparse.Namespace, console: Console) -> int:
    import signal

    from gpuslice.demo.scenario import DemoOptions, run_demo

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)  # stop everything the demo started, as on Ctrl-C
    result = run_demo(DemoOptions(out=args.out, short=args.short, seed=args.seed,
                                  live=False if args.no_live else None,
                                  local_gpus=not args.no_local_gpus))
    console.print(f"GPUs in use: {result['gpus_used']} (exclusive allocation: "
                  f"{result['gpus_exclusive']})")
    for name, s in result["latency_total"].items():
        console.print(f"{name}: p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms (SLO {s['slo_ms']:g}"
                      f" ms), {s['ok']}/{s['sent']} answered, {s['rejected']} rejected, "
                      f"{s['failed']} failed")
    console.print(f"report: {result['files'][0]}")
    return 0


def _add_local_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    def common(p: argparse.ArgumentParser, gpus: bool = True) -> None:
        p.add_argument("--state-dir", type=Path,
                       help="local mode's state (default $GPUSLICE_STATE_DIR, else "
                       "$XDG_STATE_HOME/gpuslice or ~/.local/state/gpuslice)")
        if gpus:
            p.add_argument("--fake-gpus", type=Path,
                           help="GPUs from a fake NVML inventory (YAML) instead of NVML")

    up = sub.add_parser(
        "up", help="local mode: run inference services as GPU slices on this machine",
        description="Place a slice per replica on the local GPUs, start MPS daemons, launch "
        "each replica's command with its slice's environment, and serve them all through the "
        "router on one port, restarting replicas that crash. Ctrl-C (or gpuslice down) stops "
        "everything.")
    up.add_argument("services", type=Path, help="services file (the planner's format plus "
                    "command, replicas, compute, memory)")
    up.add_argument("--port", type=int, default=8080, help="router port (default 8080)")
    up.add_argument("--admin-port", type=int, default=0,
                    help="router admin port for /metrics (default: any free port)")
    up.add_argument("--no-mps", action="store_true",
                    help="no MPS daemons: replicas time-slice the GPU (no caps enforced)")
    up.add_argument("--mps-binary", default="nvidia-cuda-mps-control", help=argparse.SUPPRESS)
    up.add_argument("--detach", action="store_true",
                    help="run in the background; return once every replica answers")
    common(up)
    st = sub.add_parser("status", help="local mode: slices, caps and measured throughput")
    st.add_argument("--window", type=float, default=2.0,
                    help="seconds over which throughput is measured (default 2)")
    st.add_argument("--json", action="store_true", help="print JSON")
    common(st, gpus=False)
    sw = sub.add_parser("switch", help="local mode: switch to a slice profile (layout) now",
                        description="Ask the running local mode for one of its services file's "
                        "layouts now (replicas move one at a time without dropping requests), "
                        "or with --auto go back to following the file's windows.")
    sw.add_argument("layout", nargs="?")
    sw.add_argument("--auto", action="store_true", help="follow the windows again")
    common(sw, gpus=False)
    dn = sub.add_parser("down", help="local mode: stop replicas, router and MPS daemons")
    dn.add_argument("--timeout", type=float, default=20.0)
    common(dn, gpus=False)
    se = sub.add_parser(
        "select", help="print the local GPU (or MIG instance) that best fits a workload",
        description="Print the UUID of the local GPU or MIG instance with room for --memory "
        "and --compute, by free memory and utilisation measured through NVML less the slices "
        "local mode has handed out; a value for CUDA_VISIBLE_DEVICES.")
    se.add_argument("--memory", default="0", help="GPU memory needed, e.g. 8G (default 0)")
    se.add_argument("--compute", default="0", help="percent of a GPU needed (default 0)")
    se.add_argument("--index", action="store_true", help="print the GPU index, not the UUID")
    common(se)


def _local_nvml(args: argparse.Namespace) -> NvmlPort:
    from gpuslice.adapters.nvml.port import FakeNvml
    from gpuslice.adapters.nvml.real import load

    return FakeNvml.from_yaml(args.fake_gpus, "local") if args.fake_gpus else load()


def _up(args: argparse.Namespace, console: Console) -> int:
    import asyncio

    from gpuslice.services.local import (
        LocalRuntime,
        alive,
        default_state_dir,
        read_local_services,
        read_state,
        run_local,
    )

    state_dir = args.state_dir or default_state_dir()
    cfg = read_local_services(args.services)
    old = read_state(state_dir)
    if old is not None and alive(int(old.get("pid", 0))):
        raise ValidationError("--state-dir", "no local mode already running there (gpuslice "
                              "down first)", f"{state_dir}: pid {old.get('pid')}")
    if not 0 <= args.port <= 65535:
        raise ValidationError("--port", "a port from 0 to 65535", args.port)
    if args.detach:
        return _up_detached(args, state_dir, console)
    rt = LocalRuntime(cfg, _local_nvml(args), state_dir, port=args.port,
                      admin_port=args.admin_port, mps=not args.no_mps,
                      mps_binary=args.mps_binary)
    asyncio.run(run_local(rt))
    return 0


def _up_detached(args: argparse.Namespace, state_dir: Path, console: Console) -> int:
    import subprocess
    import time

    from gpuslice.services.local import alive, read_state

    argv = [a for a in sys.argv[1:] if a != "--detach"] if sys.argv[1:2] == ["up"] else None
    if argv is None:
        argv = ["up", str(args.services), "--port", str(args.port), "--admin-port",
                str(args.admin_port), "--state-dir", str(state_dir)]
        argv += ["--no-mps"] if args.no_mps else []
        argv += ["--fake-gpus", str(args.fake_gpus)] if args.fake_gpus else []
    if "--state-dir" not in argv:
        argv += ["--state-dir", str(state_dir)]
    state_dir.mkdir(parents=True, exist_ok=True)
    log = state_dir / "up.log"
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "gpuslice.cli", *argv], stdout=out,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        st = read_state(state_dir)
        if st and st.get("pid") == p.pid and st.get("status") == "running":
            console.print(f"gpuslice up: serving on {st['router']['url']} (pid {p.pid}); "
                          f"gpuslice status, gpuslice down")
            return 0
        if p.poll() is not None or not alive(p.pid):
            tail = log.read_text()[-2000:]
            raise GpusliceError(f"gpuslice up exited with status {p.returncode}:\n{tail}")
        time.sleep(0.2)
    raise GpusliceError(f"gpuslice up did not come up in 600 s; see {log}")


def _status(args: argparse.Namespace, console: Console) -> int:
    import asyncio
    import json

    from rich.table import Table

    from gpuslice.services.local import alive, default_state_dir, read_state, replica_throughput

    state_dir = args.state_dir or default_state_dir()
    st = read_state(state_dir)
    if st is None or not alive(int(st.get("pid", 0))):
        console.print(f"local mode is not running (state: {state_dir})")
        return 3
    rates: dict[str, float] = {}
    if st.get("router"):
        admin = f"http://127.0.0.1:{st['router']['admin_port']}"
        rates = asyncio.run(replica_throughput(admin, args.window))
    for r in st["replicas"]:
        r["throughput_rps"] = round(rates.get(r.get("router_name", r["name"]), 0.0), 2)
    if args.json:
        sys.stdout.write(json.dumps(st, indent=1) + "\n")
        return 0
    t = Table(title=f"gpuslice local mode: {st['status']}, router "
              f"{(st.get('router') or {}).get('url', '-')}, pid {st['pid']}")
    for col in ("replica", "GPU", "compute", "mem cap", "pid", "status", "restarts", "req/s"):
        t.add_column(col, no_wrap=True)
    if not console.is_terminal:
        console = Console(width=max(console.width, 120))  # a pipe: no column cut short
    for r in st["replicas"]:
        t.add_row(r["name"], str(r["gpu_index"]), f"{r['compute_pct']}%",
                  f"{r['memory_mib']} MiB", str(r["pid"]), r["status"], str(r["restarts"]),
                  f"{r['throughput_rps']:.1f}")
    console.print(t)
    gpus = sorted({(r["gpu_index"], r["gpu_uuid"]) for r in st["replicas"]})
    console.print("GPUs: " + ", ".join(f"{i} = {u}" for i, u in gpus), soft_wrap=True)
    lay = st.get("layout") or {}
    if lay.get("layouts"):
        console.print(f"slice profile: {lay.get('active')} of {', '.join(lay['layouts'])}"
                      f"{'; ' + lay['status'] if lay.get('status') else ''}", soft_wrap=True,
                      highlight=False)
    for m in st.get("mps", []):
        console.print(f"MPS daemon for {m['uuid']}: pipe {m['pipe_dir']}", soft_wrap=True)
    return 0


def _switch(args: argparse.Namespace, console: Console) -> int:
    from gpuslice.services.local import OVERRIDE_FILE, alive, default_state_dir, read_state

    state_dir = args.state_dir or default_state_dir()
    st = read_state(state_dir)
    if st is None or not alive(int(st.get("pid", 0))):
        raise ValidationError("--state-dir", "a running local mode", str(state_dir))
    layouts = (st.get("layout") or {}).get("layouts") or []
    target = state_dir / OVERRIDE_FILE
    if args.auto:
        target.unlink(missing_ok=True)
        console.print("following the services file's windows again")
        return 0
    if args.layout not in layouts:
        raise ValidationError("layout", f"one of {layouts} (or --auto)", args.layout)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(args.layout)
    tmp.replace(target)
    console.print(f"asked for slice profile {args.layout}; gpuslice status shows the switch")
    return 0


def _down(args: argparse.Namespace, console: Console) -> int:
    from gpuslice.services.local import default_state_dir, stop_local

    for line in stop_local(args.state_dir or default_state_dir(), args.timeout):
        console.print(line)
    return 0


def _select(args: argparse.Namespace, console: Console) -> int:
    from gpuslice.core.local import parse_memory, parse_percent, select_gpu
    from gpuslice.services.local import default_state_dir, held_slices, local_gpus, read_state

    memory = 0 if str(args.memory) == "0" else parse_memory("--memory", args.memory)
    compute = 0 if str(args.compute) in ("0", "0%") else parse_percent("--compute",
                                                                       args.compute)
    nvml = _local_nvml(args)
    gpus = local_gpus(nvml)
    held = held_slices(read_state(args.state_dir or default_state_dir()))
    g = select_gpu(gpus, held, memory, compute)
    console.print(str(g.index) if args.index else g.uuid, highlight=False)
    return 0


def _add_reconfig_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser(
        "reconfig", help="change GPU slicing by SliceSchedule without dropping traffic",
        description="'run' follows SliceSchedule objects and moves each selected GPU to the "
        "layout wanted now, one GPU at a time (cordon, move replicas, drain, apply, reopen); "
        "'plan' shows what a schedule would change now, changing nothing.")
    r.add_argument("action", choices=("run", "plan"))
    r.add_argument("schedule", nargs="?", type=Path,
                   help="with plan: a SliceSchedule YAML file (default: the cluster's)")
    src = r.add_mutually_exclusive_group()
    src.add_argument("--kubeconfig", help=KUBECONFIG_HELP)
    src.add_argument("--fake-cluster", type=Path,
                     help="nodes, pods and sliceschedules from a YAML file (to try it out)")
    r.add_argument("--context", help="kubeconfig context")
    r.add_argument("--router-admin", help="router admin URL: drain until it reports no "
                   "request in flight (default: wait the schedule's drain timeout)")
    r.add_argument("--every", type=float, default=2.0, help="seconds between passes")
    r.add_argument("--once", action="store_true", help="run: one pass, then exit")
    r.add_argument("--at", help="plan: as if it were this time of day (HH:MM, UTC)")
    r.add_argument("--json", action="store_true", help="plan: print JSON")


def _reconfig(args: argparse.Namespace, console: Console) -> int:
    import json

    import yaml

    from gpuslice.adapters.http.router_admin import HttpRouter
    from gpuslice.adapters.kube.fake import ClusterPort, load_fake_cluster
    from gpuslice.services.reconfig import PLURAL, ReconfigController

    api: ClusterPort
    if args.fake_cluster is not None:
        api = load_fake_cluster(args.fake_cluster)
    else:
        from gpuslice.adapters.kube.client import KubeClient

        api = KubeClient(args.kubeconfig, args.context)
    minute = None
    if args.at is not None:
        from gpuslice.core.reconfig import minutes_of_day

        at = minutes_of_day("--at", args.at)
        minute = lambda: at  # noqa: E731
    router = HttpRouter(args.router_admin) if args.router_admin else None
    ctl = ReconfigController(api, router=router, minute_of_day=minute)
    if args.action == "run":
        if args.every <= 0:
            raise ValidationError("--every", "a positive number of seconds", args.every)
        if args.once:
            ctl.step()
        else:
            ctl.run(lambda: False, args.every)
        for line in ctl.log:
            console.print(line, highlight=False, soft_wrap=True)
        return 0
    if args.schedule is not None:
        try:
            objs = [yaml.safe_load(args.schedule.read_text())]
        except (OSError, yaml.YAMLError) as exc:
            raise ValidationError("schedule", "a readable SliceSchedule YAML file",
                                  str(exc)) from None
    else:
        objs = api.list_custom(PLURAL)
    results = [ctl.dry_run(o) for o in objs]
    if args.json:
        sys.stdout.write(json.dumps(results, indent=1) + "\n")
        return 0
    for res in results:
        console.print(f"{res['schedule']}: target layout {res['target']}; "
                      f"{len(res['changes'])} of {res['gpus']} GPUs would change")
        t = Table()
        for col in ("node", "GPU", "from", "to", "replicas to move", "blocked"):
            t.add_column(col)
        for ch in res["changes"]:
            t.add_row(ch["node"], ch["gpu"], ch["from"], ch["to"],
                      str(len(ch["moves"])), ch["blocked"] or "-")
        console.print(t)
    return 0


def _add_replan_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser(
        "replan", help="re-plan from observed request rates: the smallest set of slice changes",
        description="Read the current plan (gpuslice plan --json), take each service's request "
        "rate from the router's metrics (or the services file), and propose the fewest slice "
        "changes that restore every SLO or free GPUs, checked by replay; a full re-plan is "
        "shown beside it for comparison. Nothing is applied: --json/--export write the new "
        "plan for the usual path (manifests, SliceSchedule layouts).")
    r.add_argument("--current", type=Path, required=True, help="the plan in force (JSON)")
    r.add_argument("--profiles", type=Path, required=True, help="profiles (folder or CSV)")
    r.add_argument("--services", type=Path, required=True,
                   help="services file (models, SLOs, and rates unless --rates-from)")
    r.add_argument("--rates-from", metavar="URL",
                   help="router admin URL: offered rates measured over --window")
    r.add_argument("--window", type=float, default=10.0)
    r.add_argument("--fleet", type=Path, help="fleet file (GPU types, counts, costs)")
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--json", type=Path, help="write the new plan as JSON here")
    r.add_argument("--export", type=Path, help="write plan.json, mig-parted.yaml, manifests")
    r.add_argument("--apply", action="store_true",
                   help="apply the change to the cluster: added slices' Deployments first, "
                   "ready, then the removed slices' pods drained and their Deployments deleted")
    r.add_argument("--namespace", default="default", help="with --apply: the plan's namespace")
    r.add_argument("--image", default="REPLACE-WITH-YOUR-MODEL-SERVER-IMAGE",
                   help="with --apply: the model server image of the Deployments")
    r.add_argument("--router-admin", help="with --apply: ask this router when the removed "
                   "pods have drained (default: wait --drain-s)")
    r.add_argument("--drain-s", type=float, default=60.0)
    src = r.add_mutually_exclusive_group()
    src.add_argument("--kubeconfig", help="with --apply: " + KUBECONFIG_HELP)
    src.add_argument("--fake-cluster", type=Path, help=argparse.SUPPRESS)


def _replan(args: argparse.Namespace, console: Console) -> int:
    import asyncio
    import json

    import numpy as np

    from gpuslice.adapters.http.config import read_document
    from gpuslice.core.planner import FleetType, PlanOptions, Service, validate
    from gpuslice.core.replay import plan_and_check, plan_diff, replan
    from gpuslice.planning.export import write_exports
    from gpuslice.planning.run import (
        PlanRun,
        load_profiles,
        plan_from_json,
        read_fleet,
        read_services,
        to_json,
    )

    current = plan_from_json(read_document(args.current, "--current"), str(args.current))
    profiles = load_profiles(args.profiles)
    services = read_services(args.services)
    if args.rates_from:
        from gpuslice.adapters.http.metrics import request_rates

        if args.window <= 0:
            raise ValidationError("--window", "a positive number of seconds", args.window)
        seen = asyncio.run(request_rates(args.rates_from, args.window, by="service",
                                         ok_only=False))
        services = [Service(s.name, s.model, round(seen.get(s.name, 0.0), 3), s.slo_ms)
                    for s in services]
    fleet = read_fleet(args.fleet) if args.fleet else [
        FleetType(g) for g in sorted({g.gpu for g in current.gpus})]
    opts = PlanOptions()
    inc = replan(profiles, current, services, opts, rng=np.random.default_rng(args.seed),
                 fleet=fleet)
    full = plan_and_check(profiles, services, fleet, opts,
                          rng=np.random.default_rng(args.seed + 1)).plan
    t = Table(title=f"re-plan: {len(inc.changes)} slice change(s), GPUs {current.n_gpus} -> "
              f"{inc.plan.n_gpus}")
    for col in ("action", "GPU", "slice", "service", "req/s"):
        t.add_column(col)
    for ch in inc.changes:
        t.add_row(ch.action, f"{ch.gpu} ({ch.gpu_type})", f"{ch.profile}@{ch.start}",
                  ch.service, f"{ch.throughput:.1f}")
    console.print(t)
    for r in inc.replay:
        console.print(f"{r.service}: replayed p99 {r.p99_ms:.1f} ms (SLO {r.slo_ms:g}) "
                      f"{'ok' if r.ok else 'MISSED'}", highlight=False)
    if inc.freed_gpus:
        console.print(f"frees GPU(s) {', '.join(map(str, inc.freed_gpus))}")
    console.print(f"a full re-plan would use {full.n_gpus} GPUs and change "
                  f"{len(plan_diff(current, full))} slices", highlight=False)
    if args.apply:
        from gpuslice.adapters.http.router_admin import HttpRouter
        from gpuslice.adapters.kube.fake import ClusterPort, load_fake_cluster
        from gpuslice.planning.apply import apply_plan

        if not all(r.ok for r in inc.replay):
            raise ValidationError("--apply", "a re-plan whose replay meets every SLO",
                                  [r.service for r in inc.replay if not r.ok])
        api: ClusterPort
        if args.fake_cluster is not None:
            api = load_fake_cluster(args.fake_cluster)
        else:
            from gpuslice.adapters.kube.client import KubeClient

            api = KubeClient(args.kubeconfig)
        for line in apply_plan(api, current, inc.plan, namespace=args.namespace,
                               image=args.image, drain_timeout_s=args.drain_s,
                               router=HttpRouter(args.router_admin) if args.router_admin
                               else None):
            console.print(line, highlight=False)
    if args.json or args.export:
        doc = to_json(PlanRun(inc.plan, list(services), list(inc.replay), 0.0, 0.0, 1, {},
                              validate(inc.plan, services, opts.latency_factor), {}))
        if args.json:
            args.json.write_text(json.dumps(doc, indent=2))
            console.print(f"wrote {args.json}", highlight=False)
        if args.export:
            for path in write_exports(args.export, inc.plan, doc):
                console.print(f"wrote {path}", highlight=False)
    return 0 if all(r.ok for r in inc.replay) else 1


def _add_profile_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "profile", help="measure a model on the local GPU into the planner's profile format",
        description="Measure a model across MPS thread caps (and the MIG instances that exist "
        "where MIG is already enabled), batch sizes and process counts, with warm-up and fixed "
        "windows; rows go to the CSV as they are measured (an interrupted run resumes), and a "
        "plot of throughput against slice size is written beside it. Workloads: resnet50, "
        "mobilenet_v3, vit_b_16, efficientnet_b0, encoder, tiny, cmd:PROGRAM (RUN <batch> / "
        "OK lines on stdin/stdout) or an http:// URL (POST per batch, X-Batch-Size).")
    p.add_argument("workload")
    p.add_argument("--out", type=Path, default=Path("profiles.csv"))
    p.add_argument("--name", default="", help="model name in the CSV (default: the workload)")
    p.add_argument("--caps", default="10,20,30,50,70,100", help="MPS thread percentages")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--procs", default="1,2,3", help="processes sharing the slice")
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--window-s", type=float, default=5.0)
    p.add_argument("--device", type=int, default=0, help="GPU index")
    p.add_argument("--no-mig", action="store_true", help="skip the MIG instances")
    p.add_argument("--fake-timer", metavar="MODEL@GPU", help=argparse.SUPPRESS)
    p.add_argument("--mps-binary", default="nvidia-cuda-mps-control", help=argparse.SUPPRESS)


def _profile(args: argparse.Namespace, console: Console) -> int:
    from gpuslice.bench.profile import ProfileOptions, parse_ints, plot_knee, run_profile

    opts = ProfileOptions(
        workload=args.workload, out=args.out, model_name=args.name,
        caps=parse_ints("--caps", args.caps), batches=parse_ints("--batches", args.batches),
        procs=parse_ints("--procs", args.procs), warmup_s=args.warmup_s,
        window_s=args.window_s, mig=not args.no_mig, fake_timer=args.fake_timer,
        device_index=args.device, mps_binary=args.mps_binary)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task("profiling", total=None)

        def progress(label: str, i: int, n: int) -> None:
            bar.update(task, description=label, completed=i, total=n)

        points = run_profile(opts, progress)
    console.print(f"measured {len(points)} configuration(s) into {args.out}"
                  + ("" if points else " (all were there already)"), highlight=False)
    if args.out.is_file():
        png = plot_knee(args.out, args.out.with_suffix(".png"))
        console.print(f"wrote {png}", highlight=False)
    return 0


def _add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    b = sub.add_parser("bench", help="GPU sharing benchmarks on the local GPU")
    bs = b.add_subparsers(dest="bench", required=True)
    s = bs.add_parser(
        "sharing", help="time-slicing vs MPS vs gpuslice slices, noisy neighbour, memory cap",
        description="N replicas under exclusive-sequential, time-slicing, MPS without limits "
        "and gpuslice slices (caps from --profile, else an even split); a latency-critical "
        "replica next to best-effort ones; a replica allocating past its memory cap. Prints a "
        "table with the acceptance gates and writes JSON and a plot to --out.")
    s.add_argument("--workload", default="resnet50")
    s.add_argument("--replicas", type=int, default=7)
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--lc-batch", type=int, default=1)
    s.add_argument("--be-batch", type=int, default=64)
    s.add_argument("--be-replicas", type=int, default=3)
    s.add_argument("--warmup-s", type=float, default=3.0)
    s.add_argument("--window-s", type=float, default=10.0)
    s.add_argument("--profile", type=Path, help="profile CSV (gpuslice profile) for the caps")
    s.add_argument("--gpu", default="", help="GPU model in the profile (default: the only one)")
    s.add_argument("--mem-cap-mib", type=int, default=4096)
    s.add_argument("--alloc-mib", type=int, default=6144)
    s.add_argument("--parts", default="throughput,noisy,memory")
    s.add_argument("--device", type=int, default=0, help="GPU index (NVML) to run on")
    s.add_argument("--out", type=Path, default=Path("bench-out"))
    s.add_argument("--fake-timer", metavar="MODEL@GPU", help=argparse.SUPPRESS)
    s.add_argument("--mps-binary", default="nvidia-cuda-mps-control", help=argparse.SUPPRESS)


def _bench(args: argparse.Namespace, console: Console) -> int:
    import json

    from gpuslice.bench.sharing import SharingOptions, plot_sharing, run_sharing

    prof = None
    gpu = args.gpu
    if args.profile is not None:
        from gpuslice.adapters.profiles.files import read_own_profiles

        prof = read_own_profiles(args.profile)
        if not gpu:
            gpus = prof.gpus()
            if len(gpus) != 1:
                raise ValidationError("--gpu", f"one of {gpus}", gpu)
            gpu = gpus[0]
    opts = SharingOptions(
        workload=args.workload, replicas=args.replicas, batch=args.batch,
        lc_batch=args.lc_batch, be_batch=args.be_batch, be_replicas=args.be_replicas,
        warmup_s=args.warmup_s, window_s=args.window_s, profile=prof, gpu=gpu,
        fake_timer=args.fake_timer, mps_binary=args.mps_binary, mem_cap_mib=args.mem_cap_mib,
        alloc_mib=args.alloc_mib, parts=tuple(p.strip() for p in args.parts.split(",")),
        device_index=args.device)
    res = run_sharing(opts, lambda text: console.print(f"[dim]{text}[/]"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sharing.json").write_text(json.dumps(res, indent=1))
    plot_sharing(res, args.out / "sharing.png")
    gates: list[tuple[str, bool]] = []
    if "throughput" in res:
        t = Table(title=f"{args.replicas} x {args.workload} batch {args.batch}")
        for col in ("mode", "req/s", "x one replica", "x time-slicing", "spread"):
            t.add_column(col, justify="right")
        for m, v in res["throughput"].items():
            t.add_row(m, f"{v['total_rps']:.1f}", f"{v['vs_one_replica']:.2f}",
                      f"{v['vs_time_slicing']:.2f}", f"{100 * v['spread']:.1f}%")
        console.print(t)
        g = res["throughput"]["gpuslice"]
        gates += [("gpuslice >= 1.7x time-slicing", g["vs_time_slicing"] >= 1.7),
                  ("per-replica spread <= 5%", g["spread"] <= 0.05)]
    if "noisy" in res:
        t = Table(title=f"noisy neighbour (solo p99 {res['noisy']['solo_p99_ms']:.2f} ms, "
                  f"gpuslice caps {res['noisy']['caps']})")
        for col in ("mode", "LC p99 ms", "x solo", "BE req/s", "BE x MPS"):
            t.add_column(col, justify="right")
        for m in ("time-slicing", "mps", "gpuslice-caps", "gpuslice"):
            v = res["noisy"][m]
            t.add_row(m, f"{v['lc_p99_ms']:.2f}", f"{v['lc_p99_vs_solo']:.2f}",
                      f"{v['be_rps']:.1f}", f"{v['be_vs_mps']:.2f}")
        console.print(t)
        g = res["noisy"]["gpuslice"]
        gates += [("LC p99 <= 1.1x solo", g["lc_p99_vs_solo"] <= 1.1),
                  ("BE keeps >= 85% of uncapped MPS", g["be_vs_mps"] >= 0.85)]
    if "memory" in res:
        m = res["memory"]
        over = m["over_cap"] or {}
        console.print(f"memory cap {m['cap_mib']} MiB: allocating {m['alloc_mib']} MiB -> "
                      f"{'allowed' if over.get('ok') else over.get('error', 'no answer')}; "
                      f"neighbours at {m['neighbours_ratio']:.2f}x their throughput",
                      highlight=False, soft_wrap=True)
        gates += [("over-cap allocation fails", over.get("ok") is False),
                  ("neighbours unaffected (>= 0.9x)", m["neighbours_ratio"] >= 0.9)]
    for name, ok in gates:
        console.print(f"{'PASS' if ok else 'FAIL'}  {name}", highlight=False)
    if res.get("fake_timer"):
        console.print("fake timer: these are the speed model's stand-in numbers, not a GPU's")
    console.print(f"wrote {args.out / 'sharing.json'} and {args.out / 'sharing.png'}",
                  highlight=False)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    console = Console(stderr=False)
    err = Console(stderr=True)
    try:
        args = _build_parser().parse_args(argv)
        if args.command == "simulate":
            return _simulate(args, console)
        if args.command == "gpus":
            return _local_gpus(args, console) if args.local else _gpus(console)
        if args.command == "mig":
            return _mig(args, console)
        if args.command == "plan":
            return _plan(args, console)
        if args.command == "extender":
            return _extender(args, console)
        if args.command == "node-agent":
            return _node_agent(args, console)
        if args.command == "mig-apply":
            return _mig_apply(args, console)
        if args.command == "router":
            return _router(args, console)
        if args.command == "demo":
            return _demo(args, console)
        if args.command == "up":
            return _up(args, console)
        if args.command == "status":
            return _status(args, console)
        if args.command == "down":
            return _down(args, console)
        if args.command == "switch":
            return _switch(args, console)
        if args.command == "select":
            return _select(args, console)
        if args.command == "reconfig":
            return _reconfig(args, console)
        if args.command == "replan":
            return _replan(args, console)
        if args.command == "profile":
            return _profile(args, console)
        if args.command == "bench":
            return _bench(args, console)
    except GpusliceError as exc:
        err.print(f"gpuslice: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err.print("gpuslice: interrupted")
        return 130
    return 2


def _simulate(args: argparse.Namespace, console: Console) -> int:
    from gpuslice.adapters.traces.data import published_results, variant_paths
    from gpuslice.adapters.traces.fgd_results import read_published
    from gpuslice.sim.compare import compare
    from gpuslice.sim.default import default_nodes, default_tasks
    from gpuslice.sim.runner import (
        Experiment,
        JobResult,
        load_scenario,
        run_experiment,
        scenario_of,
        write_results,
    )

    policies = parse_policies(args.policy)
    if args.tune <= 0:
        raise ValidationError("--tune", "a positive multiple of GPU capacity", args.tune)
    if args.workers < 0:
        raise ValidationError("--workers", "0 (CPU count) or more", args.workers)
    if args.variant:
        pods, nodes = variant_paths(args.variant)
        scenario = load_scenario(pods, args.nodes or nodes)
    elif args.trace:
        if args.nodes is None:
            raise ValidationError("--nodes", "a node list CSV to go with --trace", None)
        scenario = load_scenario(args.trace, args.nodes)
    else:
        if args.nodes is not None:
            raise ValidationError("--trace", "a pod list CSV to go with --nodes", None)
        scenario = scenario_of("embedded-default", default_nodes(), default_tasks())
    seeds = parse_seeds(args.seeds or ("42-51" if (args.trace or args.variant) else "42-44"))
    exp = Experiment(scenario, policies, seeds, args.tune, args.ties == "order")
    if args.workers:
        exp.workers = args.workers
    console.print(
        f"[bold]{scenario.name}[/]: {scenario.arrays.n_nodes} nodes, {scenario.total_gpus} GPUs, "
        f"{len(scenario.tasks)} tasks, {len(scenario.workload.shapes)} target shapes; "
        f"{len(policies)} policies x {len(seeds)} seeds, tune {args.tune}"
    )
    results: list[JobResult] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        bar = progress.add_task("replaying", total=len(exp.jobs()))

        def done(res: JobResult) -> None:
            results.append(res)
            progress.update(bar, advance=1, description=f"{res.job.policy} seed {res.job.seed}")

        ordered = run_experiment(exp, on_done=done)
    written = write_results(args.out, scenario.name, ordered)
    if not args.no_plot:
        from gpuslice.sim.plot import plot_unallocated

        written.append(plot_unallocated(ordered, args.out / "unallocated.png",
                                        f"{scenario.name}: unallocated GPU vs arrived workload"))
    published = []
    if args.compare is not None:
        path = published_results() if args.compare == "auto" else Path(args.compare)
        published = read_published(path)
    rows = compare(scenario.name, ordered, published)
    table = Table(title=f"unallocated GPU % at 100% arrived ({len(seeds)} seeds)")
    table.add_column("policy")
    table.add_column("ours mean ± sd", justify="right")
    if args.compare is not None:
        table.add_column("published", justify="right")
        table.add_column("published mean ± sd", justify="right")
        table.add_column("diff", justify="right")
    table.add_column("s/seed", justify="right")
    for r in rows:
        cells = [r.policy, f"{r.ours_mean:.2f} ± {r.ours_sd:.2f}"]
        if args.compare is not None:
            if r.published_mean is None or r.published_sd is None or r.diff is None:
                cells += [r.published_as or "-", "-", "-"]
            else:
                cells += [r.published_as or "-", f"{r.published_mean:.2f} ± {r.published_sd:.2f}",
                          f"{r.diff:+.2f}"]
        cells.append(f"{r.seconds_per_seed:.1f}")
        table.add_row(*cells)
    console.print(table)
    for path in written:
        console.print(f"wrote {path}", highlight=False)
    return 0


def _plan(args: argparse.Namespace, console: Console) -> int:
    import json

    from gpuslice.core.planner import FleetType, PlanOptions
    from gpuslice.planning.export import write_exports
    from gpuslice.planning.run import (
        load_profiles,
        parva_baseline,
        read_fleet,
        read_services,
        run_plan,
        scenario_services,
        to_json,
    )

    opts = PlanOptions(latency_factor=args.latency_factor, objective=args.objective,
                       solver=args.solver, time_limit_s=args.time_limit, mix=not args.no_mix)
    profiles = load_profiles(args.profiles)
    baselines: dict[str, int | None] = {}
    if args.services is not None:
        services = read_services(args.services)
    elif args.scenario is not None:
        services = scenario_services(args.profiles, args.slo_rate, args.slo_latency,
                                     args.scenario)
        if args.profiles.is_dir():
            baselines["parvagpu"] = parva_baseline(args.profiles, args.scenario)
    else:
        raise ValidationError("--scenario", "a scenario number, or --services FILE", None)
    fleet = read_fleet(args.fleet) if args.fleet else [
        FleetType(g) for g in profiles.gpus()]
    run = run_plan(profiles, services, fleet, opts, seed=args.seed, check=not args.no_check,
                   baselines=baselines)
    doc = to_json(run)
    table = Table(title=f"plan: {doc['gpus']} GPUs ({doc['solver']}, lower bound "
                  f"{doc['lower_bound']:.2f}, planned in {doc['seconds']['plan']:.2f} s)")
    for col in ("service", "rate", "SLO ms", "capacity", "slices", "replayed p99 ms", "SLO met"):
        table.add_column(col, justify="right")
    for s in doc["services"]:
        slices = ", ".join(f"{x['profile']}@{x['start']}/g{x['gpu']} b{x['batch']}x{x['procs']}"
                           for x in s["segments"])
        table.add_row(s["name"], f"{s['rate_rps']:g}", f"{s['slo_ms']:g}",
                      f"{s['capacity_rps']:.0f}", slices or "-",
                      "-" if s["replayed_p99_ms"] is None else f"{s['replayed_p99_ms']:.1f}",
                      "-" if s["slo_met"] is None else ("yes" if s["slo_met"] else "NO"))
    console.print(table)
    base = doc["baselines"]
    console.print(
        f"GPUs: gpuslice {doc['gpus']} | ParvaGPU {base.get('parvagpu') or '-'} | exclusive "
        f"{base.get('exclusive')} | lower bound {doc['lower_bound']:.2f}", highlight=False)
    if doc["single_type_cost"]:
        best_single = min(doc["single_type_cost"].values())
        console.print(f"cost {doc['cost']:.2f} vs best single GPU type {best_single:.2f} "
                      f"(saving {100 * (1 - doc['cost'] / best_single):.1f}%)", highlight=False)
    for pr in doc["problems"]:
        console.print(f"[yellow]not planned[/] {pr['service']}: {pr['reason']}")
    for e in doc["errors"]:
        console.print(f"[red]invalid[/] {e}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2))
        console.print(f"wrote {args.json}", highlight=False)
    if args.export:
        for path in write_exports(args.export, run.plan, doc):
            console.print(f"wrote {path}", highlight=False)
    return 0 if not doc["errors"] else 1


def _read_key(path: Path) -> bytes:
    """The HMAC key shared by the extender and the node agents, from its file."""
    try:
        key = path.read_bytes().strip()
    except OSError as exc:
        raise ValidationError("--key-file", "a readable file", str(exc)) from None
    if len(key) < 16:
        raise ValidationError("--key-file", "a key of at least 16 bytes", len(key))
    return key


def _extender(args: argparse.Namespace, console: Console) -> int:
    import asyncio

    from gpuslice.adapters.kube.client import KubeClient
    from gpuslice.adapters.kube.fake import KubePort, load_fake_cluster
    from gpuslice.services.extender import ExtenderState, bind_clock, serve, tls_context

    host, _, port_text = args.listen.rpartition(":")
    if not host or not port_text.isdigit():
        raise ValidationError("--listen", "HOST:PORT", args.listen)
    key = _read_key(args.key_file)
    api: KubePort
    if args.fake_cluster is not None:
        api = load_fake_cluster(args.fake_cluster)
    else:
        api = KubeClient(args.kubeconfig, args.context)
    ctx = tls_context(args.tls_cert, args.tls_key, args.client_ca)

    state = ExtenderState(api, key, policy=args.policy, clock=bind_clock)
    if args.leader_elect:
        import os
        import socket
        import time

        from gpuslice.services.extender import LeaderElector

        ns, sep, lease_name = args.lease.partition("/")
        if not sep or not ns or not lease_name:
            raise ValidationError("--lease", "NAMESPACE/NAME", args.lease)
        identity = os.environ.get("POD_NAME") or socket.gethostname()
        state.elector = LeaderElector(api, ns, lease_name, identity, time.time)
    for problem in state.problems:
        console.print(f"[yellow]ignored[/] {problem}", highlight=False)
    scheme = "https" if ctx else "http"

    def ready(port: int) -> None:
        console.print(f"extender serving on {scheme}://{host}:{port} "
                      f"({len(state.inv.names)} nodes, {len(state.ledger.owners)} assignments)",
                      highlight=False)

    try:
        asyncio.run(serve(state, host, int(port_text), ctx, args.resync, ready))
    except OSError as exc:
        raise ValidationError("--listen", "a free address to listen on", str(exc)) from None
    return 0


def _node_agent(args: argparse.Namespace, console: Console) -> int:
    import os
    import signal

    from gpuslice.adapters.kube.client import KubeClient
    from gpuslice.adapters.kube.fake import KubePort, load_fake_cluster
    from gpuslice.adapters.nvml.port import FakeNvml
    from gpuslice.adapters.nvml.real import load
    from gpuslice.services.device_plugin import PluginConfig
    from gpuslice.services.node_agent import NodeAgent

    node = args.node or os.environ.get("NODE_NAME")
    if not node:
        raise ValidationError("--node", "the node's name (or $NODE_NAME)", node)
    if args.replicas < 1:
        raise ValidationError("--replicas", "at least 1 virtual device per GPU", args.replicas)
    key = _read_key(args.key_file)
    if not args.socket_dir.is_dir():
        raise ValidationError("--socket-dir", "the kubelet's device plugin directory",
                              str(args.socket_dir))
    nvml: NvmlPort = FakeNvml.from_yaml(args.fake, node) if args.fake else load()
    api: KubePort = (load_fake_cluster(args.fake_cluster) if args.fake_cluster
                     else KubeClient(args.kubeconfig))
    cfg = PluginConfig(node, args.socket_dir, key, args.replicas,
                       mps_pipe_dir=args.mps_pipe_dir, mig_strategy=args.mig_strategy,
                       pod_resources=None if args.pod_resources_socket == "off"
                       else Path(args.pod_resources_socket))
    # a fake inventory has no real GPU behind it: no MPS daemons to start
    agent = NodeAgent(cfg, nvml, api, quiet_s=args.quiet,
                      mps=not args.no_mps and args.fake is None,
                      quit_mps_on_stop=args.quit_mps_on_exit)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    if args.metrics != "off":
        from prometheus_client import start_http_server

        mhost, _, mport = args.metrics.rpartition(":")
        if not mport.isdigit():
            raise ValidationError("--metrics", "HOST:PORT or off", args.metrics)
        start_http_server(int(mport), mhost or "0.0.0.0", registry=agent.metrics.registry)
    console.print(f"node agent for {node}: {len(nvml.devices())} GPU(s), "
                  f"{args.replicas} virtual devices each; socket dir {args.socket_dir}",
                  highlight=False)
    if not nvml.devices():
        console.print(f"[yellow]serving no device[/]: {nvml.why_empty()}", highlight=False)
    for problem in agent.check_mig_tables():
        console.print(f"[yellow]{problem}[/]", highlight=False)
    agent.run()
    for problem in agent.problems:
        console.print(f"[yellow]{problem}[/]", highlight=False)
    return 0


def _mig_apply(args: argparse.Namespace, console: Console) -> int:
    from gpuslice.adapters.kube.client import KubeClient
    from gpuslice.adapters.kube.fake import KubePort, load_fake_cluster
    from gpuslice.adapters.nvml.port import FakeNvml
    from gpuslice.adapters.nvml.real import load
    from gpuslice.services.mig_executor import MigExecutor, read_config

    nvml: NvmlPort = FakeNvml.from_yaml(args.fake, args.node or "node") if args.fake else load()
    api: KubePort | None = None
    if args.node:
        api = (load_fake_cluster(args.fake_cluster) if args.fake_cluster
               else KubeClient(args.kubeconfig))
    report = MigExecutor(nvml, api, args.node or "").apply(read_config(args.file), args.config,
                                                          dry_run=args.dry_run)
    for uuid, changes in report.changes.items():
        note = f" (skipped: {report.skipped[uuid]})" if uuid in report.skipped else ""
        console.print(f"{uuid}: {', '.join(str(c) for c in changes)}{note}", highlight=False)
    for uuid, why in report.skipped.items():
        if uuid not in report.changes:
            console.print(f"{uuid}: skipped: {why}", highlight=False)
    if not report.changes:
        console.print("nothing to change", highlight=False)
    console.print(f"state: {report.state}", highlight=False)
    return 0 if report.state in ("success", "dry-run") else 1


def _gpus(console: Console) -> int:
    table = Table(title="GPU catalogue")
    for col in ("model", "memory MiB", "SMs", "FP16 TFLOPS", "BF16 TFLOPS", "CC", "MPS caps",
                "MIG profiles"):
        table.add_column(col)
    for m in catalog.known_models():
        cc = f"{m.compute_capability[0]}.{m.compute_capability[1]}" if m.compute_capability else "-"
        table.add_row(
            m.name, str(m.memory_mib), str(m.sms or "-"), str(m.fp16_tflops or "-"),
            str(m.bf16_tflops or "-"), cc, "yes" if m.mps_limits else "no",
            ", ".join(p.name for p in m.mig.profiles) if m.mig else "-",
        )
    console.print(table)
    return 0


def _ranges(values: Sequence[int]) -> str:
    """0,1,2,3,4,5,6 -> 0-6; 0,2,4 stays."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and runs[-1][-1] == v - 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)


def _local_gpus(args: argparse.Namespace, console: Console) -> int:
    """What discovery sees: NVML's devices and MIG tables, and whether the catalogue agrees."""
    nv = _local_nvml(args)
    gpus = nv.devices()
    if not gpus:
        console.print(f"no GPU: {nv.why_empty()}", highlight=False)
        return 1
    console.print(f"driver {nv.driver_version()}", highlight=False)
    disagree = 0
    for gpu in gpus:
        cc = ".".join(map(str, gpu.compute_capability)) if gpu.compute_capability else "-"
        console.print(f"GPU {gpu.index}: {gpu.name} ({gpu.model}), {gpu.uuid}, "
                      f"{gpu.memory_mib} MiB, {gpu.sms or '?'} SMs, CC {cc}, "
                      f"MIG {'enabled' if gpu.mig_enabled else 'disabled'}", highlight=False)
        for m in gpu.mig:
            console.print(f"  instance {m.profile}@{m.start} {m.uuid}", highlight=False)
        profiles = nv.mig_profiles(gpu.uuid)
        if not profiles:
            continue
        table = Table(title=f"GPU {gpu.index}: MIG profiles as NVML reports them")
        for col in ("profile", "ID", "compute", "memory slices", "MiB", "SMs", "max", "starts"):
            table.add_column(col)
        for p in sorted(profiles, key=lambda p: (p.compute_slices, p.memory_slices, p.name)):
            table.add_row(p.name, str(p.profile_id), str(p.compute_slices),
                          str(p.memory_slices), str(p.memory_mib), str(p.sms),
                          str(p.max_instances), _ranges(p.starts))
        console.print(table)
        model = catalog.lookup(gpu.model)
        diff = catalog.mig_table_differences(model, profiles) if model and model.mig else []
        if model is None or model.mig is None:
            console.print(f"  the catalogue has no MIG table for {gpu.name}: the planner and "
                          "extender will not place MIG slices on it", highlight=False)
        elif diff:
            disagree += 1
            console.print(f"  the catalogue's {gpu.model} table differs for: {', '.join(diff)}",
                          highlight=False)
        else:
            console.print(f"  the catalogue's {gpu.model} table agrees", highlight=False)
    return 1 if disagree else 0


def _mig(args: argparse.Namespace, console: Console) -> int:
    model = catalog.resolve(args.model)
    if model.mig is None:
        raise ValidationError("model", "a MIG-capable GPU model (A30, A100, H100, H200)",
                              args.model)
    geo = model.mig
    if args.layout:
        layout = mig.parse_layout(geo, args.layout)
        problems = mig.layout_problems(geo, layout)
        if problems:
            for p in problems:
                console.print(f"invalid: {p}", highlight=False)
            return 1
        console.print(f"valid: {', '.join(str(p) for p in layout)}", highlight=False)
        return 0
    if args.used is not None:
        used = mig.parse_layout(geo, args.used)
        problems = mig.layout_problems(geo, used)
        if problems:
            raise ValidationError("--used", "a valid layout", "; ".join(problems))
        fits = mig.fitting_placements(geo, used)
        console.print(f"still fits next to {args.used or 'nothing'}:", highlight=False)
        for pl in fits:
            console.print(f"  {pl}", highlight=False)
        return 0
    layouts = mig.maximal_layouts(geo)
    console.print(f"{model.name}: {len(layouts)} maximal layouts", highlight=False)
    for lay in layouts:
        console.print("  " + ", ".join(str(p) for p in lay), highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
