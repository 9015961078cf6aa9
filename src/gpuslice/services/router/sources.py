"""Where the router's replicas come from (``gpuslice router``'s options): a config file, the
planner's plan, or a Service's EndpointSlices (weights from a plan), and, with EndpointSlices,
which of the Service's pods the reconfiguration controller marked draining."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.routing_config import ReplicaSpec, RouterConfig, ServiceSpec

log = logging.getLogger("gpuslice.router")

ConfigLoader = Callable[[], Awaitable[RouterConfig]]


@dataclass(frozen=True)
class ServeOptions:
    """What ``gpuslice router`` was asked to do."""

    listen: tuple[str, int] = ("0.0.0.0", 8080)
    admin: tuple[str, int] | None = ("0.0.0.0", 9901)
    policy: str | None = None
    slo_ms: float | None = None
    admission: bool = True
    access_log: str = "-"
    config: Path | None = None
    plan: Path | None = None
    endpointslices: str | None = None
    kube_api: str | None = None  # an API server URL without credentials (kubectl proxy)
    kubeconfig: str | None = None
    port_name: str | None = None
    poll_s: float = 5.0
    models: tuple[str, ...] = ()  # EndpointSlices alone: the models served (none: any)
    # SIGTERM: keep accepting this long (answering Connection: close) while the endpoint
    # removal reaches kube-proxy and the clients, then stop accepting and give the requests in
    # flight (streams included) up to shutdown_grace_s to finish
    shutdown_delay_s: float = 0.0
    shutdown_grace_s: float = 30.0


def _service_of(cfg: RouterConfig, name: str, path: Path | None) -> ServiceSpec:
    """The service of a config or plan that the EndpointSlices of Service ``name`` serve: the
    one of that name (or model), or the only one."""
    for spec in cfg.services:
        if spec.name == name:
            return spec
    for spec in cfg.services:
        if name in spec.models:
            return spec
    if len(cfg.services) == 1:
        return cfg.services[0]
    raise ValidationError("--endpointslices", f"a Service named like one of the services of "
                          f"{path}: {', '.join(s.name for s in cfg.services)}", name)


class DrainingPods:
    """The names of the Service namespace's pods marked ``gpuslice.io/draining``, read at
    each reload. A replica once draining stays so while its endpoint (name and address) is
    listed: the pod is gone from the pod list as soon as it is deleted, while the
    EndpointSlices still list it for a moment (or a read of the pods fails: then the last set
    read is kept, and the first failure in a row is a warning naming what is needed); a new
    request must not go to it then, the controller may have evicted it already."""

    def __init__(self, fetch: Callable[[aiohttp.ClientSession], Awaitable[object]],
                 where: str) -> None:
        self.fetch, self.where = fetch, where
        self.names: frozenset[str] = frozenset()
        self.failing = False
        self.sticky: frozenset[tuple[str, str | None]] = frozenset()  # (name, url) drained

    def keep(self, reps: tuple[ReplicaSpec, ...]) -> tuple[ReplicaSpec, ...]:
        """``reps`` with every replica that was draining at the last reload draining still;
        remembers the draining ones for the next."""
        out = tuple(replace(r, draining=True) if (r.name, r.url) in self.sticky else r
                    for r in reps)
        self.sticky = frozenset((r.name, r.url) for r in out if r.draining)
        return out

    async def read(self, session: aiohttp.ClientSession) -> frozenset[str]:
        from gpuslice.adapters.http.endpointslices import draining_pods

        try:
            self.names = draining_pods(await self.fetch(session))
        except (GpusliceError, OSError, TimeoutError, aiohttp.ClientError) as exc:
            if not self.failing:
                log.warning("cannot read the pods of %s marked gpuslice.io/draining (%s): "
                            "keeping the last %d known; the router needs 'list pods' in that "
                            "namespace (deploy/examples/router.yaml's Role), else a "
                            "reconfiguration waits its drain timeout", self.where, exc,
                            len(self.names), extra={"event": "draining-unknown"})
            self.failing = True
            return self.names
        self.failing = False
        return self.names


def make_loader(opts: ServeOptions) -> tuple[ConfigLoader, Path | None]:
    """The config source: a config file, a plan, or EndpointSlices (weights from a plan)."""
    from gpuslice.adapters.http.config import read_config

    if opts.endpointslices is not None:
        return _slices_loader(opts), None
    path = opts.config or opts.plan
    if path is None:
        raise ValidationError("--config", "a router config, a --plan or --endpointslices", None)
    field_name = "--config" if opts.config is not None else "--plan"

    async def load_file() -> RouterConfig:
        return read_config(path, field=field_name)

    return load_file, path


def _slices_loader(opts: ServeOptions) -> ConfigLoader:
    from gpuslice.adapters.http.config import read_config
    from gpuslice.adapters.http.endpointslices import (
        SliceSource,
        fetchers,
        replicas_from_slices,
    )
    from gpuslice.core.routing_config import parse_router_config

    assert opts.endpointslices is not None
    src = SliceSource.parse(opts.endpointslices, opts.kube_api, opts.port_name)
    fetch_slices, fetch_draining = fetchers(src, opts.kubeconfig)
    draining = DrainingPods(fetch_draining, f"namespace {src.namespace}")
    base = opts.config or opts.plan
    template = read_config(base, need_urls=False, field="--config" if opts.config
                           else "--plan") if base is not None else None
    spec0 = None
    if template is not None:
        spec0 = _service_of(template, src.service, base)
        template = replace(template, services=(spec0,))
    by_name = {r.name: r for r in spec0.replicas} if spec0 is not None else {}

    async def load_slices() -> RouterConfig:
        async with aiohttp.ClientSession() as session:
            doc = await fetch_slices(session)
            marked = await draining.read(session)
        reps = draining.keep(replicas_from_slices(doc, src.port_name, by_name, marked))
        if not reps:
            raise ValidationError(f"EndpointSlices of {src.namespace}/{src.service}",
                                  "at least one ready endpoint", 0)
        svc = (replace(spec0, replicas=reps) if spec0 is not None
               else ServiceSpec(src.service, reps, models=opts.models))
        cfg = template or parse_router_config(
            {"services": [{"name": src.service, "replicas": []}]}, need_urls=False)
        return replace(cfg, services=(svc,))

    return load_slices
