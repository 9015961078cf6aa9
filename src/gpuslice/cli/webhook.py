"""``gpuslice webhook``: the mutating admission webhook."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from gpuslice.cli.common import KUBECONFIG_HELP, Sub, add_log_format, examples, setup_logging
from gpuslice.cli.flagtypes import parse_hostport, parse_lease, positive_float
from gpuslice.core.errors import ValidationError


def register(sub: Sub) -> None:
    w = sub.add_parser(
        "webhook", help="mutating admission webhook: gpuslice's scheduler and explicit GPU "
        "memory for the pods that opt in",
        description="Serve kube-apiserver's mutating admission webhook (POST /mutate, "
        "AdmissionReview v1) over HTTPS. For a pod that asks for gpuslice's resources, or a "
        "plain nvidia.com/gpu request with the fraction in annotations, it sets "
        "schedulerName, writes the GPU memory the pod would get as an explicit resource (so "
        "ResourceQuota counts it) and refuses what no GPU could take, naming the field. Which "
        "pods it sees is the MutatingWebhookConfiguration's: the namespaces labelled "
        "gpuslice.io/webhook=enabled and the pods labelled so (docs/webhook.md).",
        epilog=examples("gpuslice webhook --tls-cert tls.crt --tls-key tls.key",
                        "gpuslice webhook --tls-cert tls.crt --tls-key tls.key --fake-cluster "
                        "examples/fake-cluster.yaml --listen 127.0.0.1:9443"))
    w.add_argument("--listen", default="0.0.0.0:9443", help="HOST:PORT (default 0.0.0.0:9443)")
    w.add_argument("--tls-cert", required=True,
                   help="serving certificate (PEM) for the webhook Service's DNS name "
                   "(kube-apiserver calls webhooks over HTTPS only)")
    w.add_argument("--tls-key", required=True, help="the certificate's private key (PEM)")
    w.add_argument("--scheduler-name", default="gpuslice-scheduler",
                   help="the schedulerName GPU pods get (default gpuslice-scheduler, the "
                   "second scheduler's profile)")
    w.add_argument("--no-translate", action="store_true",
                   help="leave nvidia.com/gpu (and HAMi's nvidia.com/gpucores, gpumem) "
                   "requests as they are instead of translating them into gpuslice's "
                   "resources")
    src = w.add_mutually_exclusive_group()
    src.add_argument("--kubeconfig", help=KUBECONFIG_HELP)
    src.add_argument("--fake-cluster", type=Path,
                     help="YAML with 'nodes' and 'pods' lists: an in-memory API server")
    w.add_argument("--context", help="kubeconfig context")
    w.add_argument("--no-dra-gate", action="store_true",
                   help="do not put the claim allocator's scheduling gate "
                   "(gpu.gpuslice.io/allocator) on pods whose one claim it places; by default "
                   "it is put on while the allocator's Lease is fresh, so kube-scheduler tries "
                   "such a pod once, after its claim is allocated (docs/dra-placement.md)")
    w.add_argument("--gate-cpu-only", action="store_true",
                   help="gate pods that name no claim too (no node selector, affinity or "
                   "spread constraints, default scheduler), so the claim allocator places "
                   "them by its policy and pins each softly to its node (a preferred "
                   "node-affinity term): they no longer take the CPU GPU pods need "
                   "(docs/dra-placement.md, \"Pods without claims\")")
    w.add_argument("--allocator-lease", default="gpuslice-system/gpuslice-dra-allocator",
                   metavar="NAMESPACE/NAME", help="the claim allocator's Lease (default "
                   "gpuslice-system/gpuslice-dra-allocator)")
    w.add_argument("--resync", type=positive_float, default=30.0,
                   help="seconds between reads of the nodes' GPU inventories (default 30)")
    add_log_format(w)
    w.set_defaults(handler=_webhook)


def _webhook(args: argparse.Namespace, console: Console) -> int:
    import asyncio

    from gpuslice.adapters import eventloop
    from gpuslice.adapters.kube.client import KubeClient
    from gpuslice.adapters.kube.fake import FakeApiServer, load_fake_cluster
    from gpuslice.adapters.signals import StopSignals
    from gpuslice.core.admission import Options
    from gpuslice.services.tls import tls_context
    from gpuslice.services.webhook import FleetView, serve
    from gpuslice.services.webhook.gate import DraGate

    log = setup_logging(args.log_format, "webhook")
    host, port = parse_hostport("--listen", args.listen)
    if not args.scheduler_name.strip():
        raise ValidationError("--scheduler-name", "a scheduler profile's name", "")
    lease = parse_lease(args.allocator_lease, flag="--allocator-lease")
    ctx = tls_context(args.tls_cert, args.tls_key, None)
    client: KubeClient | FakeApiServer = load_fake_cluster(args.fake_cluster) \
        if args.fake_cluster is not None else KubeClient(args.kubeconfig, args.context)
    view = FleetView(client)
    if args.no_dra_gate and args.gate_cpu_only:
        raise ValidationError("--gate-cpu-only", "the DRA gate on (not with --no-dra-gate)",
                              "--no-dra-gate")
    gate = None if args.no_dra_gate else DraGate(client, lease, cpu_only=args.gate_cpu_only)
    opts = Options(scheduler_name=args.scheduler_name, translate_plain=not args.no_translate)

    def ready(port: int) -> None:
        gpus = sum(m.gpus for m in view.fleet.models)
        log.info("serving on https://%s:%s (%d GPUs of %d models)", host, port, gpus,
                 len(view.fleet.models),
                 extra={"event": "serving", "port": port, "gpus": gpus})

    stop = asyncio.Event()
    signals = StopSignals(stop.set)

    async def main() -> None:
        signals.install(asyncio.get_running_loop())
        try:
            await serve(view, opts, host, port, ctx, resync_s=args.resync, ready=ready,
                        stop=stop, tls_files=(args.tls_cert, args.tls_key), gate=gate)
        finally:
            signals.restore()

    try:
        eventloop.run(main())
    except OSError as exc:
        raise ValidationError("--listen", "a free address to listen on", str(exc)) from None
    log.info("%s", signals.stopped_line(""), extra={"event": "stopped"})
    close = getattr(client, "close", None)
    if callable(close):
        close()
    return 0
