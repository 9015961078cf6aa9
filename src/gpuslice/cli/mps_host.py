"""``gpuslice mps-host``: start and keep the node's MPS control daemons (its own DaemonSet)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from rich.console import Console

from gpuslice.adapters.mps import CONTROL, PIPE_DIR
from gpuslice.cli.common import Sub, add_log_format, examples, setup_logging
from gpuslice.cli.flagtypes import positive_float
from gpuslice.core.errors import ValidationError


def register(sub: Sub) -> None:
    m = sub.add_parser(
        "mps-host", help="start and keep the node's MPS control daemons (the node agent and "
        "the DRA driver ask for them), so that they outlive those components",
        description="Keeps an MPS control daemon running for every record the node agent or "
        "the DRA driver wrote in the pipe directory (<dir>/<UUID>.want: the GPU or MIG "
        "instance and the server-side ceiling), restarts one that died with its ceiling, and "
        "writes a heartbeat (<dir>/.mps-host.json). The daemons live and die with this "
        "process's pod: run it in a DaemonSet that upgrades do not roll (deploy/, "
        "updateStrategy OnDelete); see docs/node-agent.md.",
        epilog=examples("gpuslice mps-host --mps-pipe-dir /run/gpuslice/mps",
                        "gpuslice mps-host --fake"))
    m.add_argument("--mps-pipe-dir", type=Path, default=Path(PIPE_DIR),
                   help=f"host directory of the MPS pipe directories (default {PIPE_DIR})")
    m.add_argument("--mps-binary", help=f"the MPS control program (default {CONTROL} on PATH)")
    m.add_argument("--fake", action="store_true",
                   help="start stand-in daemons (gpuslice.adapters.mps.standin) instead of "
                   "NVIDIA's: for nodes with stand-in GPUs (the node agent's --fake-gpus)")
    m.add_argument("--poll", type=positive_float, default=0.25,
                   help="seconds between passes over the records (default 0.25)")
    add_log_format(m)
    m.set_defaults(handler=_mps_host)


def _mps_host(args: argparse.Namespace, console: Console) -> int:
    from gpuslice.adapters.signals import StopSignals
    from gpuslice.services.mps_host import MpsHost

    if args.fake and args.mps_binary:
        raise ValidationError("--fake", "either --fake or --mps-binary", "both")
    if args.mps_pipe_dir.exists() and not args.mps_pipe_dir.is_dir():
        raise ValidationError("--mps-pipe-dir", "a folder (made if missing)",
                              f"{args.mps_pipe_dir}: not a folder")
    log = setup_logging(args.log_format, "mps-host")
    binary = args.mps_binary or CONTROL
    if args.fake:
        from gpuslice.adapters.mps.fake import write_fake_control

        binary = str(write_fake_control(Path(tempfile.mkdtemp(prefix="gpuslice-mps-"))
                                        / "nvidia-cuda-mps-control"))
    args.mps_pipe_dir.mkdir(parents=True, exist_ok=True)
    host = MpsHost(args.mps_pipe_dir, binary, poll_s=args.poll)
    with StopSignals(host.stop) as signals:
        log.info("MPS host: daemons for the records in %s (%s)", args.mps_pipe_dir, binary,
                 extra={"event": "starting"})
        host.run()
    log.info("%s; the daemons go with this pod", signals.stopped_line(),
             extra={"event": "stopped"})
    return 0
