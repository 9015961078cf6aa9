"""``gpuslice node-agent``: NVML discovery, device plugin, health, labels."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from gpuslice.adapters.mps import CONTROL, PIPE_DIR, SHM_DIR
from gpuslice.cli.common import (
    FAKE_INVENTORY_HELP,
    KUBECONFIG_HELP,
    MPS_HOST_HELP,
    PREVIOUS_KEY_HELP,
    Sub,
    add_fake_gpus,
    add_log_format,
    examples,
    fake_nvml,
    read_key,
    read_previous_keys,
    setup_logging,
)
from gpuslice.cli.flagtypes import non_negative_float, parse_hostport, positive_float
from gpuslice.core.errors import ValidationError

# virtual devices per GPU at most: a few per milli-GPU share is plenty, and the kubelet lists,
# checkpoints and sends every one
MAX_REPLICAS = 1000

if TYPE_CHECKING:
    from gpuslice.adapters.kube.client import KubeClient
    from gpuslice.adapters.kube.fake import FakeApiServer
    from gpuslice.adapters.nvml.port import NvmlPort
    from gpuslice.services.node_agent import NodeAgent


def register(sub: Sub) -> None:
    na = sub.add_parser(
        "node-agent", help="node agent: NVML discovery, kubelet device plugin, health, labels",
        description="Serve gpuslice.io/gpu to the kubelet (device plugin API v1beta1), execute "
        "the extender's signed assignments, publish the GPU inventory and GFD labels on the "
        "node, and follow GPU health. --fake-gpus runs it on a YAML inventory (or N simulated "
        "GPUs) instead of NVML. Stopped while its DaemonSet is gone or being deleted (an "
        "uninstall; $POD_NAMESPACE/$POD_NAME name its pod), it removes what it put on the "
        "node (labels, annotations, the gpu-milli and gpu-memory resources) and its MPS "
        "daemons and folders; a rolling update or a restart keeps them. --cleanup does the "
        "node's part once, for nodes whose agent is gone.",
        epilog=examples("gpuslice node-agent --node n1 --key-file key --fake-gpus inventory.yaml "
                        "--socket-dir /tmp/dp --fake-cluster examples/fake-cluster.yaml",
                        "gpuslice node-agent --cleanup --all-nodes"))
    na.add_argument("--node", help="this node's name (default $NODE_NAME)")
    na.add_argument("--key-file", type=Path,
                    help="file holding the HMAC key shared with the extender (required, "
                    "except with --cleanup)")
    na.add_argument("--previous-key-file", type=Path, help=PREVIOUS_KEY_HELP)
    na.add_argument("--cleanup", action="store_true",
                    help="one-shot: remove from the node (--node) or from every node with a "
                    "GPU inventory (--all-nodes) the labels, annotations and gpu-milli / "
                    "gpu-memory resources gpuslice put there, then exit (no GPU, no device "
                    "plugin)")
    na.add_argument("--all-nodes", action="store_true",
                    help="with --cleanup: every node carrying the gpuslice.io/inventory "
                    "annotation")
    na.add_argument("--stop-daemonset", metavar="NAMESPACE/NAME",
                    help="with --cleanup: first delete the node agents' DaemonSet (foreground) "
                    "and wait until its pods are gone, each agent cleaning its own node, MPS "
                    "folders included (the Helm chart's pre-delete hook)")
    na.add_argument("--stop-wait", type=positive_float, default=120.0, metavar="SECONDS",
                    help="with --stop-daemonset: how long to wait for the agents (default 120)")
    add_fake_gpus(na, FAKE_INVENTORY_HELP, old_fake=True)
    na.add_argument("--socket-dir", type=Path, default=Path("/var/lib/kubelet/device-plugins"),
                    help="the kubelet's device plugin directory")
    na.add_argument("--replicas", type=int, default=10, help="virtual devices per GPU")
    na.add_argument("--mig-strategy", choices=("none", "single", "mixed"), default="none",
                    help="none: the extender names GPUs and MIG instances (default); single: "
                    "every MIG instance is one gpuslice.io/gpu; mixed: gpuslice.io/mig-<profile>")
    na.add_argument("--device-list-strategy", default="envvar",
                    help="how Allocate names devices to the runtime, comma-separated: envvar "
                    "(default), volume-mounts, cdi-annotations, cdi-cri (NVIDIA's names)")
    na.add_argument("--cdi-root", type=Path, default=Path("/var/run/cdi"),
                    help="where the CDI spec (kind gpuslice.io/gpu) is written for cdi-*")
    na.add_argument("--dev-dir", type=Path, default=Path("/dev"),
                    help="where the NVIDIA device nodes are on the host (default /dev): the CDI "
                    "spec's hostPath, e.g. stand-in nodes for --fake-gpus GPUs")
    na.add_argument("--quiet", type=non_negative_float, default=60.0,
                    help="seconds without errors before a faulty GPU is healthy again")
    na.add_argument("--metrics", default="0.0.0.0:9402",
                    help="HOST:PORT of the Prometheus endpoint ('off' to disable)")
    _mps_flags(na)
    na.add_argument("--proc-root", type=Path, default=Path("/proc"),
                    help="the host's /proc as the agent sees it, where each GPU process's "
                    "cgroup names its pod (default /proc: the agent runs with hostPID; "
                    "/host/proc where the host's is mounted there instead)")
    na.add_argument("--pod-resources-socket",
                    default="/var/lib/kubelet/pod-resources/kubelet.sock",
                    help="the kubelet's PodResources API ('off' not to ask): pods it gave "
                    "devices to are not waiting for Allocate, even while Pending")
    nsrc = na.add_mutually_exclusive_group()
    nsrc.add_argument("--kubeconfig", help=KUBECONFIG_HELP)
    nsrc.add_argument("--fake-cluster", type=Path, help="YAML with 'nodes' and 'pods'")
    add_log_format(na)
    na.set_defaults(handler=_node_agent)


def _mps_flags(na: argparse.ArgumentParser) -> None:
    """The node agent's MPS flags."""
    na.add_argument("--no-mps", action="store_true",
                    help="do not start MPS control daemons (MPS slices then share the GPU "
                    "without caps)")
    na.add_argument("--mps-host", action="store_true", help=MPS_HOST_HELP)
    na.add_argument("--fake-mps", action="store_true",
                    help="with --fake-gpus: MPS slices get stand-in MPS daemons "
                    "(gpuslice.adapters.mps.standin: clients, caps and daemon lifetimes as the "
                    "real ones; the same stand-in `gpuslice mps-host --fake` starts)")
    na.add_argument("--quit-mps-on-exit", action="store_true",
                    help="quit the MPS daemons when the agent stops (default: leave them to "
                    "the pods using them; a restarted agent adopts them)")
    na.add_argument("--mps-pipe-dir", default=PIPE_DIR,
                    help="host directory of the MPS pipe directories")
    na.add_argument("--mps-shm-dir", default=SHM_DIR,
                    help="host directory that is the MPS daemons' /dev/shm, mounted at /dev/shm "
                    "in MPS clients ('' for none: then clients need hostIPC)")


def _cleanup(args: argparse.Namespace, console: Console) -> int:
    """``--cleanup``: the node's part of an uninstall, for nodes whose agent is gone."""
    import os

    from gpuslice.adapters.kube.client import KubeClient
    from gpuslice.adapters.kube.fake import load_fake_cluster
    from gpuslice.services.node_cleanup import clean_nodes, stop_daemonset

    log = setup_logging(args.log_format, "node-agent")
    node = args.node or (None if args.all_nodes else os.environ.get("NODE_NAME"))
    if args.all_nodes == bool(node):
        raise ValidationError("--cleanup", "one node (--node NAME, or $NODE_NAME) or "
                              "--all-nodes", "both" if node else "neither")
    stop_ns, _, stop_name = (args.stop_daemonset or "").rpartition("/")
    if args.stop_daemonset is not None and not (stop_ns and stop_name):
        raise ValidationError("--stop-daemonset", "NAMESPACE/NAME", args.stop_daemonset)
    api: KubeClient | FakeApiServer = (load_fake_cluster(args.fake_cluster)
                                       if args.fake_cluster else KubeClient(args.kubeconfig))
    if args.stop_daemonset:
        log.info("deleting DaemonSet %s (foreground): each agent cleans its own node",
                 args.stop_daemonset, extra={"event": "stop-daemonset"})
        if stop_daemonset(api, stop_ns, stop_name, args.stop_wait):
            log.info("DaemonSet %s and its pods are gone", args.stop_daemonset,
                     extra={"event": "stopped-daemonset"})
        else:
            log.warning("DaemonSet %s still has pods after %g s (a node not ready?): "
                        "cleaning the nodes from here", args.stop_daemonset, args.stop_wait,
                        extra={"event": "stop-daemonset-timeout"})
    done = clean_nodes(api, None if args.all_nodes else [str(node)])
    for plan in done:
        console.print(f"{plan.node}: {'removed ' if plan else ''}{plan.summary()}",
                      markup=False, highlight=False)
    if not done:
        console.print("no node carries a gpuslice inventory", markup=False, highlight=False)
    return 0


def _node_agent(args: argparse.Namespace, console: Console) -> int:
    import os

    from gpuslice.adapters.kube.client import KubeClient
    from gpuslice.adapters.kube.fake import load_fake_cluster
    from gpuslice.adapters.signals import StopSignals
    from gpuslice.services.device_plugin import PluginConfig, device_list_strategy
    from gpuslice.services.node_agent import NodeAgent

    if args.cleanup:
        return _cleanup(args, console)
    for flag, given in (("--all-nodes", args.all_nodes),
                        ("--stop-daemonset", args.stop_daemonset is not None)):
        if given:
            raise ValidationError(flag, "only with --cleanup", "without it")
    log = setup_logging(args.log_format, "node-agent")
    node = _check(args, args.node or os.environ.get("NODE_NAME"))
    key = read_key(args.key_file)
    from gpuslice.adapters.nvml.real import LateNvml

    # without a stand-in inventory: NVML, tried again while the NVIDIA driver has not loaded
    # (it may load after the agent, an operator-managed driver after a reboot)
    fake = fake_nvml(args, node)
    nvml: NvmlPort = fake if fake is not None else LateNvml()
    api: KubeClient | FakeApiServer = (load_fake_cluster(args.fake_cluster)
                                       if args.fake_cluster else KubeClient(args.kubeconfig))
    cfg = PluginConfig(node, args.socket_dir, key, args.replicas,
                       previous_keys=read_previous_keys(args.previous_key_file),
                       mps_pipe_dir=args.mps_pipe_dir, mps_shm_dir=args.mps_shm_dir,
                       mig_strategy=args.mig_strategy,
                       pod_resources=None if args.pod_resources_socket == "off"
                       else Path(args.pod_resources_socket),
                       device_list_strategy=device_list_strategy(args.device_list_strategy),
                       cdi_root=args.cdi_root, dev_dir=args.dev_dir)
    mps_binary = _mps_binary(args, nvml)
    agent = NodeAgent(cfg, nvml, api, quiet_s=args.quiet,
                      mps=not args.no_mps and (args.fake_gpus is None or args.fake_mps),
                      mps_binary=mps_binary, quit_mps_on_stop=args.quit_mps_on_exit,
                      mps_host=args.mps_host, proc_root=args.proc_root)
    with StopSignals(agent.stop) as signals:  # SIGTERM (the pod deleted) or Ctrl-C: stop, exit 0
        if args.metrics != "off":
            from gpuslice.adapters.http.probes import serve_metrics

            mhost, mport = parse_hostport("--metrics", args.metrics)
            serve_metrics(mhost, mport, agent.metrics.registry, agent.readiness)
        log.info("node agent for %s: %d GPU(s), %d virtual devices each; socket dir %s", node,
                 len(nvml.devices()), args.replicas, args.socket_dir,
                 extra={"event": "starting", "node": node, "gpus": len(nvml.devices())})
        if not nvml.devices():
            log.warning("serving no device: %s%s", nvml.why_empty(),
                        "; NVML is tried again every 10 s (the driver may load later)"
                        if args.fake_gpus is None else "", extra={"event": "no-device"})
        for problem in agent.check_mig_tables():
            log.warning("%s", problem, extra={"event": "mig-table"})
        agent.run()
        if signals.received:
            _uninstall(agent, api, node, log)
        for problem in agent.problems:
            log.warning("%s", problem, extra={"event": "problem"})
    if agent.restart_needed:
        log.warning("stopping to be started again: %s", agent.restart_needed,
                    extra={"event": "restart"})
        return 1
    log.info("%s", signals.stopped_line(), extra={"event": "stopped"})
    return 0


def _check(args: argparse.Namespace, node: str | None) -> str:
    """The flags the agent cannot start without, each refused naming it; the node."""
    if not node:
        raise ValidationError("--node", "the node's name (or $NODE_NAME)", node)
    if not 1 <= args.replicas <= MAX_REPLICAS:
        raise ValidationError("--replicas", f"1..{MAX_REPLICAS} virtual devices per GPU (the "
                              "kubelet tracks each one)", args.replicas)
    if args.key_file is None:
        raise ValidationError("--key-file", "the file holding the HMAC key shared with the "
                              "extender", None)
    if not args.socket_dir.is_dir():
        raise ValidationError("--socket-dir", "the kubelet's device plugin directory",
                              str(args.socket_dir))
    if args.cdi_root.exists() and not args.cdi_root.is_dir():  # made when missing
        raise ValidationError("--cdi-root", "a folder for the CDI specs (made if missing)",
                              f"{args.cdi_root}: not a folder")
    if args.fake_mps and args.fake_gpus is None:
        raise ValidationError("--fake-mps", "only with --fake-gpus (real GPUs get real MPS)",
                              "without it")
    return node


def _mps_binary(args: argparse.Namespace, nvml: NvmlPort) -> str:
    """The MPS control program: the real one, or with ``--fake-mps`` (a fake inventory has
    no real GPU behind it) the stand-in, whose clients the fake NVML then lists."""
    if not args.fake_mps:
        return CONTROL
    import tempfile

    from gpuslice.adapters.mps.fake import standin_processes, write_fake_control
    from gpuslice.adapters.nvml.port import FakeNvml

    binary = str(write_fake_control(Path(tempfile.mkdtemp(prefix="gpuslice-mps-"))
                                    / "nvidia-cuda-mps-control"))
    if isinstance(nvml, FakeNvml):  # NVML lists a daemon's clients: the stand-in's
        nvml.process_source = standin_processes(args.mps_pipe_dir)
    return binary


def _uninstall(agent: NodeAgent, api: KubeClient | FakeApiServer, node: str,
               log: logging.Logger) -> None:
    """After a stop signal: when the agent's DaemonSet is gone or being deleted, take what
    the agent put on the node off it (API side, then MPS daemons and folders); else (a
    rolling update, a restart) leave everything."""
    import os

    from gpuslice.core.errors import GpusliceError
    from gpuslice.services.node_cleanup import check_uninstall, clean_node

    ns, pod = os.environ.get("POD_NAMESPACE"), os.environ.get("POD_NAME")
    if not (ns and pod):
        log.info("not in a pod ($POD_NAMESPACE/$POD_NAME unset): the node keeps its labels "
                 "and resources", extra={"event": "kept"})
        return
    uninstalling, why = check_uninstall(api, ns, pod)
    if not uninstalling:
        log.info("%s: node %s keeps its labels and resources", why, node,
                 extra={"event": "kept"})
        return
    log.info("%s: uninstalling, removing what gpuslice put on node %s", why, node,
             extra={"event": "uninstalling"})
    try:
        plan = clean_node(api, node)
        log.info("node %s: %s%s", node, "removed " if plan else "", plan.summary(),
                 extra={"event": "cleaned", "node": node})
    except GpusliceError as exc:
        log.warning("node %s keeps what gpuslice put there (%s): run `gpuslice node-agent "
                    "--cleanup --node %s`", node, exc, node, extra={"event": "cleanup-failed"})
    removed = agent.remove_mps_state()
    if removed:
        log.info("removed the MPS daemons' folders: %s", ", ".join(removed),
                 extra={"event": "mps-removed"})
