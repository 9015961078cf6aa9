"""``gpuslice dra-driver``: the DRA kubelet plugin of driver ``gpu.gpuslice.io`` on one node
(see ``gpuslice.services.dra_driver``)."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from gpuslice.adapters.mps import CONTROL, PIPE_DIR, SHM_DIR
from gpuslice.cli.common import (
    FAKE_INVENTORY_HELP,
    MPS_HOST_HELP,
    Sub,
    add_fake_gpus,
    add_lease,
    add_log_format,
    deprecated_alias,
    examples,
    local_nvml,
    setup_logging,
)
from gpuslice.cli.flagtypes import (
    non_negative_float,
    parse_hostport,
    parse_lease,
    positive_float,
)
from gpuslice.core import dra
from gpuslice.core.errors import ValidationError

if TYPE_CHECKING:
    from gpuslice.adapters.kube.client import KubeClient
    from gpuslice.adapters.nvml.port import NvmlPort
    from gpuslice.services.dra_driver import DraDriver


def register(sub: Sub) -> None:
    p = sub.add_parser(
        "dra-driver", help="the DRA driver (kubelet plugin) of gpu.gpuslice.io on this node",
        description="Serve fractional GPUs (consumable capacity + per-share MPS caps), "
        "partitionable MIG devices and whole GPUs through Dynamic Resource Allocation: "
        "registers with the kubelet, prepares claims into CDI specs, publishes the node's "
        "ResourceSlices.",
        epilog=examples("gpuslice dra-driver --mode share --gpu-mode 1=mig",
                        "gpuslice dra-driver --node n1 --fake-gpus inventory.yaml --kubeconfig "
                        "kubeconfig --kubelet-dir /tmp/kubelet"))
    p.add_argument("--node", help="this node's name (default: $NODE_NAME)")
    p.add_argument("--driver", default=dra.DRIVER, help="driver name (default %(default)s)")
    p.add_argument("--kubelet-dir", type=Path, default=Path("/var/lib/kubelet"),
                   help="the kubelet's root: plugins_registry/ and plugins/ below it")
    p.add_argument("--cdi-dir", type=Path, default=Path("/var/run/cdi"),
                   help="CDI spec directory the container runtime reads")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="where the checkpoint lives (default: the plugin directory)")
    p.add_argument("--mode", default=dra.WHOLE, choices=dra.MODES,
                   help="sharing model of every GPU not named by --gpu-mode")
    p.add_argument("--gpu-mode", action="append", default=[], metavar="GPU=MODE",
                   help="sharing model of one GPU (index or UUID), e.g. 0=share, 1=mig")
    p.add_argument("--no-taints", action="store_true",
                   help="leave unhealthy GPUs out of the slices instead of tainting them")
    p.add_argument("--quiet", type=positive_float, default=60.0,
                   help="seconds without an XID after which a GPU is healthy again")
    p.add_argument("--mps-pipe-dir", default=PIPE_DIR,
                   help="root of the per-GPU MPS pipe directories (the node agent's)")
    p.add_argument("--mps-shm-dir", default=SHM_DIR,
                   help="host directory that is the MPS daemons' /dev/shm, mounted at /dev/shm "
                   "in MPS clients ('' for none: then clients need hostIPC)")
    p.add_argument("--mps-host", action="store_true", help=MPS_HOST_HELP)
    p.add_argument("--mps-binary", default=None,
                   help="the MPS control program (default nvidia-cuda-mps-control; with "
                   "--fake-gpus, the stand-in the demo and the tests use: a fake GPU has no "
                   "MPS)")
    p.add_argument("--dev-dir", default="/dev", help="where the NVIDIA device nodes are")
    add_fake_gpus(p, FAKE_INVENTORY_HELP, old_fake=True)
    p.add_argument("--kubeconfig", help="kubeconfig (default: in-cluster, else kubectl's)")
    p.add_argument("--poll", type=positive_float, default=1.0, help="health poll interval, seconds")
    lease = add_lease(p, "gpuslice-system/gpuslice-dra-allocator",
                      "the claim allocator's Lease (gpuslice dra-allocator --lease): while it "
                      "is fresh, consumable-capacity devices carry its taint "
                      "(docs/dra-placement.md); 'none' never taints", none=True)
    deprecated_alias(p, "--allocator-lease", lease)
    p.add_argument("--gate-grace", type=non_negative_float, default=5.0, metavar="SECONDS",
                   help="once the allocator's Lease has been stale this long, the drivers (one "
                   "at a time, elected on the Lease gpuslice-dra-gate-keeper beside it) release "
                   "the pods its scheduling gate gpu.gpuslice.io/allocator still holds, each "
                   "with an Event (default %(default)s)")
    p.add_argument("--health-timeout", type=int, default=120,
                   help="health_check_timeout_seconds reported to the kubelet (the list is "
                   "resent every quarter of it)")
    p.add_argument("--resync", type=positive_float, default=10.0,
                   help="seconds between comparisons of the pool with the API server's")
    p.add_argument("--claim-read-timeout", type=positive_float, default=20.0, metavar="SECONDS",
                   help="a prepare's claim reads from the API server, connection, reads and "
                   "retries together, answer within this; a claim not read by then gets an "
                   "error the kubelet retries (its own deadline is 45 s; default %(default)s)")
    p.add_argument("--max-prepares", type=int, default=16,
                   help="prepares at a time (waiting on the API server); one more is "
                   "answered 'busy' at once, and unprepares and health never wait "
                   "(default %(default)s)")
    p.add_argument("--metrics", default="0.0.0.0:9403",
                   help="HOST:PORT of the Prometheus endpoint: what each pod uses of the "
                   "shares this driver prepared ('off' to disable; default %(default)s)")
    p.add_argument("--proc-root", type=Path, default=Path("/proc"),
                   help="the host's /proc as the driver sees it, where each GPU process's "
                   "cgroup names its pod (default /proc: the driver runs with hostPID)")
    add_log_format(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from gpuslice.adapters.kube.client import KubeClient
    from gpuslice.services.dra_driver import DraConfig, DraDriver, parse_modes
    from gpuslice.services.dra_driver import run as serve

    node = args.node or os.environ.get("NODE_NAME")
    if not node:
        raise ValidationError("--node", "the node's name (or $NODE_NAME)", node)
    if args.quiet <= 0 or args.poll <= 0 or args.resync <= 0 or args.health_timeout <= 0:
        raise ValidationError("--quiet/--poll/--resync/--health-timeout", "positive seconds",
                              (args.quiet, args.poll, args.resync, args.health_timeout))
    if not 0 < args.claim_read_timeout < 45:
        raise ValidationError("--claim-read-timeout", "seconds, above 0 and below the "
                              "kubelet's 45 s deadline", args.claim_read_timeout)
    if args.max_prepares < 1:
        raise ValidationError("--max-prepares", "at least 1", args.max_prepares)
    lease: tuple[str, str] | None = None
    if args.lease != "none":
        lease = parse_lease(args.lease, "NAMESPACE/NAME or none")
    setup_logging(args.log_format, "dra-driver")
    mps_binary = args.mps_binary or CONTROL
    if args.fake_gpus and args.mps_binary is None:
        # a fake inventory has no GPU behind it: MPS "daemons" are the stand-in's (as the node
        # agent with --fake starts none), so that shares prepare without the NVIDIA driver
        from gpuslice.adapters.mps.fake import write_fake_control

        where = args.state_dir or args.kubelet_dir / "plugins" / args.driver
        where.mkdir(parents=True, exist_ok=True)
        mps_binary = str(write_fake_control(where / "fake-mps-control"))
    cfg = DraConfig(node, kubelet_dir=args.kubelet_dir, driver=args.driver,
                    cdi_dir=args.cdi_dir, state_dir=args.state_dir,
                    mps_pipe_dir=args.mps_pipe_dir, mps_shm_dir=args.mps_shm_dir,
                    mps_binary=mps_binary, mps_host=args.mps_host,
                    claim_read_timeout_s=args.claim_read_timeout,
                    max_prepares=args.max_prepares,
                    default_mode=args.mode, modes=parse_modes(args.gpu_mode),
                    taints=not args.no_taints, quiet_s=args.quiet, dev_dir=args.dev_dir,
                    allocator_lease=lease, health_timeout_s=args.health_timeout,
                    resync_s=args.resync)
    nvml: NvmlPort = local_nvml(args, node)
    api = KubeClient(args.kubeconfig)
    keeper = None
    if lease is not None:  # issue 58: no pod stays behind the gate of an allocator gone
        from gpuslice.services.dra_gate import KEEPER_LEASE, GateKeeper
        from gpuslice.services.leader import LeaderElector

        keeper = GateKeeper(api, lease, "gpuslice-dra-driver", time.time, args.gate_grace,
                            LeaderElector(api, lease[0], KEEPER_LEASE, node, time.time))
    driver = DraDriver(cfg, nvml, api, gate_keeper=keeper)
    if args.metrics != "off":
        _serve_usage(args, driver, api, nvml)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    console.print(f"DRA driver {cfg.driver} on {node}: {len(nvml.devices())} GPU(s); "
                  f"registration {cfg.registration_socket}, service {cfg.dra_socket}",
                  highlight=False)
    try:
        serve(driver, stop, args.poll)
    except KeyboardInterrupt:
        stop.set()
    for problem in driver.problems:
        console.print(f"[yellow]{problem}[/]", highlight=False)
    return 0



def _serve_usage(args: argparse.Namespace, driver: DraDriver, api: KubeClient,
                 nvml: NvmlPort) -> None:
    """What pods use of their shares on ``--metrics`` (with /healthz, and /readyz: 200 once
    the kubelet took the registration)."""
    from prometheus_client import CollectorRegistry

    from gpuslice.adapters.http.probes import serve_metrics
    from gpuslice.adapters.nvml.port import FakeNvml

    if isinstance(nvml, FakeNvml) and args.mps_binary is None:
        # NVML lists an MPS daemon's clients: on stand-in GPUs, the stand-in daemons'
        from gpuslice.adapters.mps.fake import standin_processes

        nvml.process_source = standin_processes(args.mps_pipe_dir)
    registry = CollectorRegistry()
    driver.measure_usage(registry, api, args.proc_root)

    def ready() -> tuple[bool, str]:
        if driver.registration and driver.registration[-1][0]:
            return True, "registered with the kubelet"
        return False, "not registered with the kubelet yet"

    host, port = parse_hostport("--metrics", args.metrics)
    serve_metrics(host, port, registry, ready)
