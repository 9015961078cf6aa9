"""``gpuslice dra-allocator``: place our DRA driver's claims before kube-scheduler does."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from typing import TYPE_CHECKING

from rich.console import Console

from gpuslice.cli.common import (
    KUBECONFIG_HELP,
    Sub,
    add_lease,
    add_log_format,
    deprecated_alias,
    examples,
    setup_logging,
)
from gpuslice.cli.flagtypes import (
    non_negative_float,
    parse_lease,
    positive_float,
    positive_int,
)
from gpuslice.core.errors import ValidationError

if TYPE_CHECKING:
    from gpuslice.services.dra_allocator import DraAllocator, PassReport

REPEATS_EVERY_S = 60.0  # an identical warning (a claim's refused write) at most this often


def register(sub: Sub) -> None:
    a = sub.add_parser(
        "dra-allocator", help="place DRA claims of our driver with the fragmentation-aware "
        "policy (writes status.allocation before kube-scheduler's first-fit allocator)",
        description="Follows unbound pods whose ResourceClaim asks our driver's classes for "
        "one device (a share or whole GPUs) and writes the claim's allocation chosen by the "
        "policy; kube-scheduler then only checks that the node can reach it. Only devices "
        "tainted for the allocator (our drivers do so while its Lease is fresh) are used. A "
        "pod created with the scheduling gate gpu.gpuslice.io/allocator is released right "
        "after its claim is allocated, so kube-scheduler tries it once; see "
        "docs/dra-placement.md.",
        epilog=examples("gpuslice dra-allocator --kubeconfig ~/.kube/config",
                        "gpuslice dra-allocator --once --lease gpuslice-system/my-allocator"))
    a.add_argument("--kubeconfig", help=KUBECONFIG_HELP)
    a.add_argument("--context", help="kubeconfig context")
    a.add_argument("--driver", default="gpu.gpuslice.io", help="DRA driver name")
    a.add_argument("--policy", default="frag-strand", help="placement policy (default "
                   "frag-strand)")
    a.add_argument("--interval", type=positive_float, default=1.0,
                   help="longest wait (seconds) between passes: passes run on the watch events "
                   "of claims, pods and slices; this periodic one is the safety net (default 1)")
    a.add_argument("--coalesce", type=non_negative_float, default=0.002,
                   help="least seconds between the end of a pass and the next one run on watch "
                   "events, so that a burst of events is one pass; an event after a quiet "
                   "spell runs one at once (default 0.002)")
    a.add_argument("--writers", type=positive_int, default=4,
                   help="claims a pass writes at once (each a finalizer, then its allocation; "
                   "decided one after the other; default 4)")
    a.add_argument("--gate-timeout", type=positive_float, default=30.0,
                   help="longest (seconds) a pod held by the allocator's scheduling gate "
                   "(gpu.gpuslice.io/allocator) waits for its claim's allocation before it is "
                   "released to kube-scheduler with an Event (default 30)")
    a.add_argument("--settle", type=non_negative_float, default=10.0,
                   help="seconds a node's devices must have carried the allocator taint "
                   "before they are used (in-flight scheduler allocations land meanwhile)")
    a.add_argument("--no-require-taint", action="store_true",
                   help="also use untainted devices (race mode: kube-scheduler may allocate "
                   "the same devices at the same time; for clusters without device taints, "
                   "and only where nothing else allocates our devices)")
    a.add_argument("--max-backoff", type=positive_float, default=60.0,
                   help="longest wait (seconds) before placing again a claim the scheduler "
                   "released three times (the wait doubles from 2 s; default 60)")
    lease = add_lease(a, "gpuslice-system/gpuslice-dra-allocator",
                      "the Lease one replica holds to lead, and the DRA drivers watch (their "
                      "--lease)")
    deprecated_alias(a, "--lease-namespace", lease, metavar="NAMESPACE",
                     apply=lambda ns, text: setattr(
                         ns, "lease", f"{text}/{ns.lease.partition('/')[2]}"))
    deprecated_alias(a, "--lease-name", lease, metavar="NAME",
                     apply=lambda ns, text: setattr(
                         ns, "lease", f"{ns.lease.partition('/')[0]}/{text}"))
    a.add_argument("--identity", default=None, help="lease holder identity (default: "
                   "$POD_NAME or the host name)")
    a.add_argument("--once", action="store_true", help="one pass, then exit")
    add_log_format(a)
    a.set_defaults(handler=_run)


def _run(args: argparse.Namespace, console: Console) -> int:
    import threading
    import time

    from gpuslice.adapters.kube import dra as kdra
    from gpuslice.adapters.kube.client import KubeClient
    from gpuslice.adapters.kube.mirror import MirroredLists
    from gpuslice.adapters.signals import StopSignals
    from gpuslice.services.dra_allocator import DraAllocator
    from gpuslice.services.heap import LongLivedHeap
    from gpuslice.services.leader import LeaderElector

    _check(args)
    lease_ns, lease_name = parse_lease(args.lease)
    lease = args.lease
    # a refused write comes back every pass (5 a second): once a minute per claim is enough
    log = setup_logging(args.log_format, "dra-allocator", repeats_every_s=REPEATS_EVERY_S)
    api = KubeClient(args.kubeconfig, args.context)
    identity = args.identity or os.environ.get("POD_NAME") or socket.gethostname()
    elector = LeaderElector(api, lease_ns, lease_name, identity, time.time)
    # the lists every pass reads come from watches (one list per resource, not per pass),
    # and their events wake the passes (issue 58)
    wake = threading.Event()
    lists = MirroredLists(api, wake)
    alloc = DraAllocator(lists, driver=args.driver, policy=args.policy,
                         require_taint=not args.no_require_taint, settle_s=args.settle,
                         max_backoff_s=args.max_backoff, max_hold_s=args.gate_timeout,
                         elector=elector, writers=args.writers)
    classes = sorted(alloc.classes)
    log.info("watching ResourceClaims of unbound pods for driver %s (device classes %s), "
             "policy %s, %s; leader election on Lease %s as %s",
             args.driver, ", ".join(classes), args.policy,
             "devices tainted for the allocator only" if alloc.require_taint
             else "untainted devices too", lease, identity,
             extra={"event": "starting", "driver": args.driver, "classes": classes,
                    "lease": lease, "identity": identity, "taint": kdra.ALLOCATOR_TAINT
                    if alloc.require_taint else None})
    show = _PassLog(log, alloc, lease)
    heap = LongLivedHeap()

    def passed(report: PassReport) -> None:
        show(report)
        heap.settled()  # the watched lists and the ledger out of full collections

    with StopSignals() as signals:  # SIGTERM (the pod deleted) or Ctrl-C: stop, exit 0
        if args.once:
            show(alloc.run_once())
        else:
            lists.start()
            alloc.run(signals.event, args.interval, passed, wake=wake,
                      coalesce_s=args.coalesce)
    alloc.close()
    lists.close()
    released = elector.release()  # a standby takes over at its next pass
    log.info("%s", signals.stopped_line(f"released the Lease {lease}" if released
                                        else f"did not hold the Lease {lease}"),
             extra={"event": "stopped", "released": released})
    return 0


def _check(args: argparse.Namespace) -> None:
    """The timing flags' ranges, each refused naming the flag."""
    if args.interval <= 0:
        raise ValidationError("--interval", "a positive number of seconds", args.interval)
    if args.settle < 0:
        raise ValidationError("--settle", "0 or more seconds", args.settle)
    if args.max_backoff <= 0:
        raise ValidationError("--max-backoff", "a positive number of seconds", args.max_backoff)
    if args.coalesce < 0:
        raise ValidationError("--coalesce", "0 or more seconds", args.coalesce)
    if args.gate_timeout <= 0:
        raise ValidationError("--gate-timeout", "a positive number of seconds",
                              args.gate_timeout)


class _PassLog:
    """Each pass's report in the log: the Lease gained or lost, claims allocated or taken
    first, pods released from the gate (those allocated at debug level), problems."""

    def __init__(self, log: logging.Logger, alloc: DraAllocator, lease: str) -> None:
        self.log, self.alloc, self.lease = log, alloc, lease
        self.leading: bool | None = None

    def __call__(self, report: PassReport) -> None:
        from gpuslice.adapters.kube import dra as kdra

        log, lease = self.log, self.lease
        if report.leading != self.leading:
            self.leading = leading = report.leading
            log.info("%s the Lease %s", "holding" if leading else "waiting for", lease,
                     extra={"event": "leading" if leading else "following", "lease": lease})
        for claim, where in report.allocated.items():
            log.info("allocated %s -> %s", claim, where, extra={"claim": claim, "to": where})
        for claim in report.taken:
            log.info("%s: allocated by someone else first", claim, extra={"claim": claim})
        for pod, why in report.released.items():
            log.log(logging.DEBUG if why == "allocated" else logging.INFO,
                    "released %s from the gate %s (%s)", pod, kdra.ALLOCATOR_GATE, why,
                    extra={"event": "gate-released", "pod": pod, "reason": why})
        for problem in self.alloc.problems:
            log.warning("problem: %s", problem, extra={"event": "problem"})
        self.alloc.problems.clear()
