"""``gpuslice extender``: the kube-scheduler extender."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from gpuslice.cli.common import (
    KUBECONFIG_HELP,
    PREVIOUS_KEY_HELP,
    Sub,
    add_log_format,
    examples,
    read_key,
    read_previous_keys,
    setup_logging,
)
from gpuslice.cli.flagtypes import non_negative_int, parse_hostport, positive_float
from gpuslice.core.errors import ValidationError

if TYPE_CHECKING:
    from gpuslice.adapters.kube.client import KubeClient
    from gpuslice.adapters.kube.fake import FakeApiServer
    from gpuslice.services.extender import ExtenderState
    from gpuslice.services.leader import LeaderLabel


def register(sub: Sub) -> None:
    e = sub.add_parser(
        "extender", help="kube-scheduler extender: filter, prioritize and bind over HTTP(S)",
        description="Serve kube-scheduler's extender verbs (POST /filter, /prioritize, /bind) "
        "with GPU-level accounting and signed assignments. Talks to the API server from "
        "--kubeconfig (else in-cluster), or runs on a local --fake-cluster file to try it out.",
        epilog=examples("gpuslice extender --key-file key --fake-cluster "
                        "examples/fake-cluster.yaml --listen 127.0.0.1:8443 "
                        "--insecure-no-client-auth",
                        "gpuslice extender --key-file key --tls-cert tls.crt --tls-key tls.key "
                        "--client-ca ca.crt --leader-elect --lease "
                        "gpuslice-system/gpuslice-extender"))
    e.add_argument("--listen", default="0.0.0.0:8443", help="HOST:PORT (default 0.0.0.0:8443)")
    e.add_argument("--key-file", type=Path, required=True,
                   help="file holding the HMAC key shared with the node agents (>= 16 bytes)")
    e.add_argument("--previous-key-file", type=Path, help=PREVIOUS_KEY_HELP)
    e.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    e.add_argument("--tls-key", help="the certificate's private key (PEM)")
    e.add_argument("--client-ca",
                   help="mutual TLS (required unless --insecure-no-client-auth): filter, "
                   "prioritize, bind and preempt answer only clients whose certificate this CA "
                   "signed (kube-scheduler's extender tlsConfig certFile/keyFile); /healthz, "
                   "/readyz and /metrics need none")
    e.add_argument("--insecure-no-client-auth", action="store_true",
                   help="development only: serve without client certificates (plain HTTP "
                   "without --tls-cert, or HTTPS without --client-ca); anyone who reaches the "
                   "port can then bind pending pods to any node")
    e.add_argument("--policy", default="frag-strand",
                   help="core placement policy (default frag-strand, the simulator's best, "
                   "scoring against the workload learned from the pods it sees)")
    e.add_argument("--filter-keeps", choices=("best", "all"), default="best",
                   help="best (default): filter keeps only the policy's choice, so "
                   "kube-scheduler's own scores cannot spread the pods (the nodes that cannot "
                   "hold the pod are refused with a reason either way; only the feasible ones "
                   "passed over go unnamed); all: every node that fits, ranked by prioritize "
                   "(0..10 x the extender's weight, added to the scheduler's scores)")
    src = e.add_mutually_exclusive_group()
    src.add_argument("--kubeconfig", help=KUBECONFIG_HELP)
    src.add_argument("--fake-cluster", type=Path,
                     help="YAML with 'nodes' and 'pods' lists: an in-memory API server")
    e.add_argument("--context", help="kubeconfig context")
    e.add_argument("--leader-elect", action="store_true",
                   help="several replicas: only the holder of the Lease binds, and labels "
                   "its pod gpuslice.io/extender-role=leader (from $POD_NAMESPACE/$POD_NAME) "
                   "for the Service to select")
    e.add_argument("--lease", default="gpuslice-system/gpuslice-extender",
                   help="NAMESPACE/NAME of the Lease (default gpuslice-system/gpuslice-extender)")
    e.add_argument("--resync", type=positive_float, default=300.0,
                   help="seconds between full re-reads of nodes and pods, besides the watch "
                   "(default 300)")
    e.add_argument("--binds-in-flight", type=non_negative_int, default=None,
                   help="binds under way past which a filter call waits for one to finish "
                   "(at most 1 s), so binds do not queue for the API server in a burst "
                   "(default 8, services/extender/flow.BINDS_IN_FLIGHT; 0: never wait; see "
                   "docs/extender.md, 'Binds in flight')")
    add_log_format(e)
    e.set_defaults(handler=_extender)


def _extender(args: argparse.Namespace, console: Console) -> int:
    import asyncio

    from gpuslice.adapters import eventloop
    from gpuslice.adapters.kube.client import KubeClient
    from gpuslice.adapters.kube.fake import KubePort, load_fake_cluster
    from gpuslice.adapters.signals import StopSignals
    from gpuslice.services.extender import (
        ExtenderState,
        bind_clock,
        serve,
        tls_context,
    )
    from gpuslice.services.heap import LongLivedHeap

    log = setup_logging(args.log_format, "extender")
    host, port = parse_hostport("--listen", args.listen)
    key = read_key(args.key_file)
    ctx = tls_context(args.tls_cert, args.tls_key, args.client_ca)
    if args.client_ca is None and not args.insecure_no_client_auth:
        raise ValidationError(
            "--client-ca", "mutual TLS: --tls-cert, --tls-key and --client-ca (or "
            "--insecure-no-client-auth, for development: then anyone who reaches the port can "
            "bind pods)", None)
    client: KubeClient | FakeApiServer
    if args.fake_cluster is not None:
        client = load_fake_cluster(args.fake_cluster)
    else:
        client = KubeClient(args.kubeconfig, args.context)
    api: KubePort = client

    state = ExtenderState(api, key, policy=args.policy, clock=bind_clock,
                          narrow=args.filter_keeps == "best",
                          previous_keys=read_previous_keys(args.previous_key_file))
    label = _elect(args, state, client, log) if args.leader_elect else None
    for problem in state.problems:
        log.warning("ignored: %s", problem, extra={"event": "ignored"})
    scheme = "https" if ctx else "http"
    if args.client_ca is None:
        log.warning("serving %s without client authentication (--insecure-no-client-auth): "
                    "anyone who reaches the port can bind pods", scheme.upper(),
                    extra={"event": "insecure"})

    def ready(port: int) -> None:
        log.info("serving on %s://%s:%s (%d nodes, %d assignments)", scheme, host, port,
                 len(state.inv.names), len(state.ledger.owners),
                 extra={"event": "serving", "port": port, "nodes": len(state.inv.names),
                        "assignments": len(state.ledger.owners)})

    stop = asyncio.Event()  # SIGTERM (the pod deleted) or Ctrl-C: stop serving, then exit 0
    signals = StopSignals(stop.set)

    async def main() -> None:
        signals.install(asyncio.get_running_loop())
        try:
            await serve(state, host, port, ctx, args.resync, ready, stop,
                        tls_files=(args.tls_cert, args.tls_key) if ctx else None,
                        leader_label=label, binds_in_flight=args.binds_in_flight,
                        heap=LongLivedHeap())  # the inventory and ledger out of full GCs
        finally:
            signals.restore()

    try:
        eventloop.run(main())  # uvloop's: its TLS transport is compiled, asyncio's is Python
    except OSError as exc:
        raise ValidationError("--listen", "a free address to listen on", str(exc)) from None
    el = state.elector
    log.info("%s", signals.stopped_line(
        "not leader-elected" if el is None else
        f"released the Lease {args.lease}" if el.released else
        f"did not hold the Lease {args.lease}"),
        extra={"event": "stopped", "released": el is not None and el.released})
    return 0


def _elect(args: argparse.Namespace, state: ExtenderState, client: KubeClient | FakeApiServer,
           log: logging.Logger) -> LeaderLabel | None:
    """Leader election on ``--lease`` (the elector set on ``state``), and the label the
    leader puts on its own pod (from the downward API) for the Service to select; None when
    the pod is not known."""
    import os
    import socket
    import time

    from gpuslice.services.extender import LEADER_LABEL
    from gpuslice.services.leader import LeaderElector, LeaderLabel

    ns, sep, lease_name = args.lease.partition("/")
    if not sep or not ns or not lease_name:
        raise ValidationError("--lease", "NAMESPACE/NAME", args.lease)
    identity = os.environ.get("POD_NAME") or socket.gethostname()
    state.elector = LeaderElector(client, ns, lease_name, identity, time.time)
    pod_ns, pod_name = os.environ.get("POD_NAMESPACE"), os.environ.get("POD_NAME")
    if pod_ns and pod_name:
        return LeaderLabel(client, pod_ns, pod_name, LEADER_LABEL)
    log.warning("POD_NAME and POD_NAMESPACE are not both set (the downward API, as "
                "deploy/ sets them): the leader does not label its pod %s, so a "
                "Service that selects it finds no endpoint", f"{LEADER_LABEL}=leader",
                extra={"event": "no-leader-label"})
    return None
