"""Local mode: ``gpuslice up / status / switch / down / select``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpuslice.adapters.proc import alive
from gpuslice.cli.common import (
    EXIT_NOT_RUNNING,
    Sub,
    add_fake_gpus,
    add_log_format,
    add_output,
    deprecated_alias,
    examples,
    local_gpus_or_fail,
    print_json,
    setup_logging,
    simulated_gpus,
)
from gpuslice.cli.flagtypes import parse_hostport, positive_float
from gpuslice.core.errors import GpusliceError, ValidationError


def register(sub: Sub) -> None:
    def common(p: argparse.ArgumentParser, gpus: bool = True) -> None:
        p.add_argument("--state-dir", type=Path,
                       help="local mode's state (default $GPUSLICE_STATE_DIR, else "
                       "$XDG_STATE_HOME/gpuslice or ~/.local/state/gpuslice)")
        if gpus:
            add_fake_gpus(p)

    up = sub.add_parser(
        "up", help="local mode: run inference services as GPU slices on this machine",
        description="Place a slice per replica on the local GPUs, start MPS daemons, launch "
        "each replica's command with its slice's environment, and serve them all through the "
        "router on one port, restarting replicas that crash. Ctrl-C (or gpuslice down) stops "
        "everything.",
        epilog=examples("gpuslice up examples/local/services.yaml --listen 127.0.0.1:8080",
                        "gpuslice up examples/local/tiny.yaml --fake-gpus 1 --detach"))
    up.add_argument("services", type=Path, help="services file (the planner's format plus "
                    "command, replicas, compute, memory)")
    _listen_options(up)
    up.add_argument("--no-mps", action="store_true",
                    help="no MPS daemons: replicas time-slice the GPU (no caps enforced)")
    up.add_argument("--mps-binary", default="nvidia-cuda-mps-control",
                    help="the MPS control program (default nvidia-cuda-mps-control; tests give "
                    "a stand-in)")
    up.add_argument("--detach", action="store_true",
                    help="run in the background; return once every replica answers")
    add_log_format(up)
    common(up)
    up.set_defaults(handler=_up)
    st = sub.add_parser("status", help="local mode: slices, caps and measured throughput",
                        description="The running local mode's replicas: GPU, compute and "
                        "memory caps, pid, restarts and the throughput measured over --window. "
                        "Exit 3 when local mode is not running.",
                        epilog=examples("gpuslice status", "gpuslice status -o json --window 5"))
    st.add_argument("--window", type=positive_float, default=2.0,
                    help="seconds over which throughput is measured (default 2)")
    add_output(st, json_alias=True)
    common(st, gpus=False)
    st.set_defaults(handler=_status)
    sw = sub.add_parser("switch", help="local mode: switch to a slice profile (layout) now",
                        description="Ask the running local mode for one of its services file's "
                        "layouts now (replicas move one at a time without dropping requests), "
                        "or with --auto go back to following the file's windows. Exit 3 when "
                        "local mode is not running.",
                        epilog=examples("gpuslice switch night", "gpuslice switch --auto"))
    sw.add_argument("layout", nargs="?",
                    help="the name of a layout in the services file (unless --auto)")
    sw.add_argument("--auto", action="store_true", help="follow the windows again")
    common(sw, gpus=False)
    sw.set_defaults(handler=_switch)
    dn = sub.add_parser("down", help="local mode: stop replicas, router and MPS daemons",
                        description="Stop the local mode of --state-dir: replicas, router and "
                        "MPS daemons, and anything they left behind.",
                        epilog=examples("gpuslice down", "gpuslice down --state-dir /tmp/gs "
                                        "--timeout 5"))
    dn.add_argument("--timeout", type=positive_float, default=20.0,
                    help="seconds to wait for local mode to stop before killing it "
                    "(default 20)")
    common(dn, gpus=False)
    dn.set_defaults(handler=_down)
    se = sub.add_parser(
        "select", help="print the local GPU (or MIG instance) that best fits a workload",
        description="Print the UUID of the local GPU or MIG instance with room for --memory "
        "and --compute, by free memory and utilisation measured through NVML less the slices "
        "local mode has handed out; a value for CUDA_VISIBLE_DEVICES.",
        epilog=examples("gpuslice select --memory 8G --compute 30",
                        "CUDA_VISIBLE_DEVICES=$(gpuslice select --memory 8G) python serve.py"))
    se.add_argument("--memory", default="0", help="GPU memory needed, e.g. 8G (default 0)")
    se.add_argument("--compute", default="0", help="percent of a GPU needed (default 0)")
    se.add_argument("--index", action="store_true", help="print the GPU index, not the UUID")
    common(se)
    se.set_defaults(handler=_select)


def _listen_options(up: argparse.ArgumentParser) -> None:
    """``--listen`` and ``--admin HOST:PORT``, as ``gpuslice router`` spells them; the former
    ``--port``/``--admin-port PORT`` (on 127.0.0.1) still work, hidden."""
    listen = up.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT",
                             help="the router's address (default 127.0.0.1:8080; a bare PORT "
                             "listens on every interface, as gpuslice router's --listen)")
    admin = up.add_argument("--admin", default="127.0.0.1:0", metavar="HOST:PORT",
                            help="the router's admin address, /metrics (default 127.0.0.1:0: "
                            "any free port)")
    deprecated_alias(up, "--port", listen, apply=lambda ns, text: setattr(
        ns, "listen", f"127.0.0.1:{text}"), metavar="PORT")
    deprecated_alias(up, "--admin-port", admin, apply=lambda ns, text: setattr(
        ns, "admin", f"127.0.0.1:{text}"), metavar="PORT")


def _up(args: argparse.Namespace, console: Console) -> int:
    import asyncio

    from gpuslice.services.local import LocalRuntime, default_state_dir, run_local
    from gpuslice.services.local_config import read_local_services
    from gpuslice.services.local_state import read_state, up_running

    state_dir = args.state_dir or default_state_dir()
    cfg = read_local_services(args.services)
    old = read_state(state_dir)
    if old is not None and up_running(old):
        raise ValidationError("--state-dir", "no local mode already running there (gpuslice "
                              "down first)", f"{state_dir}: pid {old.get('pid')}")
    host, port = parse_hostport("--listen", args.listen)
    admin_host, admin_port = parse_hostport("--admin", args.admin)
    if port == admin_port != 0:
        raise ValidationError("--admin", "a port other than --listen's", args.admin)
    simulated = simulated_gpus(args)
    nvml = local_gpus_or_fail(args)  # a bad --fake-gpus, or no GPU, stops here, before
    # anything starts
    if args.detach:
        return _up_detached(args, state_dir, console)
    setup_logging(args.log_format, "local")
    # simulated GPUs have no MPS: the replicas share the CPU
    rt = LocalRuntime(cfg, nvml, state_dir, host=host, port=port, admin_host=admin_host,
                      admin_port=admin_port, mps=not args.no_mps and simulated is None,
                      mps_binary=args.mps_binary, simulated=simulated)
    asyncio.run(run_local(rt))
    return 0


def _up_detached(args: argparse.Namespace, state_dir: Path, console: Console) -> int:
    import subprocess
    import time

    from gpuslice.services.local_state import read_state

    argv = [a for a in sys.argv[1:] if a != "--detach"] if sys.argv[1:2] == ["up"] else None
    if argv is None:
        argv = ["up", str(args.services), "--listen", args.listen, "--admin", args.admin,
                "--state-dir", str(state_dir)]
        argv += ["--no-mps"] if args.no_mps else []
        argv += ["--fake-gpus", str(args.fake_gpus)] if args.fake_gpus else []
        argv += ["--log-format", args.log_format]
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
            sim = st.get("simulated")
            console.print(f"gpuslice up: serving on {st['router']['url']} (pid {p.pid}"
                          f"{f', on {sim} SIMULATED GPUs' if sim else ''}); "
                          f"gpuslice status, gpuslice down", highlight=False)
            return 0
        if p.poll() is not None or not alive(p.pid):
            tail = log.read_text()[-2000:]
            raise GpusliceError(f"gpuslice up exited with status {p.returncode}:\n{tail}")
        time.sleep(0.2)
    raise GpusliceError(f"gpuslice up did not come up in 600 s; see {log}")


def _status(args: argparse.Namespace, console: Console) -> int:
    import asyncio

    from gpuslice.services.local import default_state_dir, replica_throughput
    from gpuslice.services.local_state import read_state, up_running

    state_dir = args.state_dir or default_state_dir()
    st = read_state(state_dir)
    if st is None or not up_running(st):
        if args.output == "json":
            print_json({"status": "not running", "state_dir": str(state_dir)})
        else:
            console.print(f"local mode is not running (state: {state_dir})", highlight=False)
        return EXIT_NOT_RUNNING
    rates: dict[str, float] = {}
    if st.get("router"):
        host = st["router"].get("admin_host") or "127.0.0.1"
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        admin = f"http://{host}:{st['router']['admin_port']}"
        rates = asyncio.run(replica_throughput(admin, args.window))
    for r in st["replicas"]:
        r["throughput_rps"] = round(rates.get(r.get("router_name", r["name"]), 0.0), 2)
    if args.output == "json":
        print_json(st)
        return 0
    sim = st.get("simulated")
    t = Table(title=f"gpuslice local mode: {st['status']}, router "
              f"{(st.get('router') or {}).get('url', '-')}, pid {st['pid']}"
              f"{f', SIMULATED GPUs ({sim})' if sim else ''}")
    for col in ("replica", "GPU", "compute", "mem cap", "pid", "status", "restarts", "req/s"):
        t.add_column(col, no_wrap=True)
    for r in st["replicas"]:
        t.add_row(r["name"], str(r["gpu_index"]), f"{r['compute_pct']}%",
                  f"{r['memory_mib']} MiB", str(r["pid"]), r["status"], str(r["restarts"]),
                  f"{r['throughput_rps']:.1f}")
    console.print(t)
    gpus = sorted({(r["gpu_index"], r["gpu_uuid"]) for r in st["replicas"]})
    console.print("GPUs: " + ", ".join(f"{i} = {u}" for i, u in gpus), soft_wrap=True)
    if sim:
        console.print(f"the GPUs are SIMULATED (--fake-gpus {sim}): no CUDA, no MPS caps; the "
                      "replicas run on the CPU", soft_wrap=True, highlight=False)
    lay = st.get("layout") or {}
    if lay.get("layouts"):
        console.print(f"slice profile: {lay.get('active')} of {', '.join(lay['layouts'])}"
                      f"{'; ' + lay['status'] if lay.get('status') else ''}", soft_wrap=True,
                      highlight=False)
    for m in st.get("mps", []):
        console.print(f"MPS daemon for {m['uuid']}: pipe {m['pipe_dir']}", soft_wrap=True)
    return 0


def _switch(args: argparse.Namespace, console: Console) -> int:
    from gpuslice.services.local import OVERRIDE_FILE, default_state_dir
    from gpuslice.services.local_state import read_state, up_running

    state_dir = args.state_dir or default_state_dir()
    st = read_state(state_dir)
    if st is None or not up_running(st):  # as gpuslice status says it, with its exit code
        Console(stderr=True).print(f"gpuslice: error: local mode is not running (state: "
                                   f"{state_dir}); gpuslice up starts it", highlight=False,
                                   soft_wrap=True)
        return EXIT_NOT_RUNNING
    layouts = (st.get("layout") or {}).get("layouts") or []
    target = state_dir / OVERRIDE_FILE
    if args.auto:
        target.unlink(missing_ok=True)
        console.print("following the services file's windows again")
        return 0
    if args.layout not in layouts:
        have = ", ".join(layouts) or "none: the services file names no slice profiles"
        raise ValidationError("layout", f"one of {have} (or --auto)", args.layout)
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
    from gpuslice.services.local import default_state_dir, held_slices, local_gpus
    from gpuslice.services.local_state import read_state

    memory = 0 if str(args.memory) == "0" else parse_memory("--memory", args.memory)
    compute = 0 if str(args.compute) in ("0", "0%") else parse_percent("--compute",
                                                                       args.compute)
    nvml = local_gpus_or_fail(args)
    gpus = local_gpus(nvml)
    held = held_slices(read_state(args.state_dir or default_state_dir()))
    g = select_gpu(gpus, held, memory, compute)
    console.print(str(g.index) if args.index else g.uuid, highlight=False)
    return 0
