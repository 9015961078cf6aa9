"""The router's admin API as other services use it: how many requests are in flight on some
replicas, once the router has them all draining, asked of one router (:class:`HttpRouter`) or
of every replica of a router Deployment, found through its Service's EndpointSlices
(:class:`ServiceRouters`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Protocol


class RouterPort(Protocol):
    def outstanding(self, replicas: list[str]) -> int | None:
        """In-flight requests on these replicas, once the router has them all draining (or no
        longer has them); None while it cannot tell yet."""
        ...

    def serving(self, keep: list[str], leaving: list[str]) -> bool | None:
        """Whether every router that sends requests to any of ``leaving`` also has every one
        of ``keep`` healthy and not draining (so marking ``leaving`` draining leaves it
        something to send to); None while it cannot tell."""
        ...


class _Refused(Exception):
    """Nothing listens there: a router that is not running holds no request."""


def _replicas(url: str, timeout_s: float) -> dict[str, dict[str, Any]] | None:
    """A router's replicas by name (its admin ``/replicas``), None when it does not answer
    usefully; :class:`_Refused` when its admin port refuses the connection."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/replicas", timeout=timeout_s) as r:
            doc = json.loads(r.read())
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            raise _Refused(url) from None
        return None
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    return {str(x.get("name")): x for svc in doc.values() if isinstance(svc, dict)
            for x in svc.get("replicas") or [] if isinstance(x, dict)}


def _outstanding(known: dict[str, dict[str, Any]], replicas: list[str]) -> int | None:
    mine = [known[n] for n in replicas if n in known]
    if any(not x.get("draining") for x in mine):
        return None  # the router has not seen the draining mark yet: it may still send
    return sum(int(x.get("outstanding", 0)) for x in mine)


def _serving(known: dict[str, dict[str, Any]], keep: list[str], leaving: list[str]) -> bool:
    if not any(n in known and not known[n].get("draining") for n in leaving):
        return True  # it does not route to them: nothing to hand over
    return all(n in known and known[n].get("healthy", True) and not known[n].get("draining")
               for n in keep)


class HttpRouter:
    """The router's admin ``/replicas`` over HTTP."""

    def __init__(self, admin_url: str, timeout_s: float = 5.0) -> None:
        self.url = admin_url.rstrip("/")
        self.timeout_s = timeout_s

    def _known(self) -> dict[str, dict[str, Any]] | None:
        try:
            return _replicas(self.url, self.timeout_s)
        except _Refused:
            return None  # one router named: it may come back and still hold requests

    def outstanding(self, replicas: list[str]) -> int | None:
        known = self._known()
        return None if known is None else _outstanding(known, replicas)

    def serving(self, keep: list[str], leaving: list[str]) -> bool | None:
        known = self._known()
        return None if known is None else _serving(known, keep, leaving)


class EndpointSliceReader(Protocol):
    def list_endpoint_slices(self, namespace: str, service: str) -> Any:
        """The EndpointSliceList of ``service``, as JSON."""
        ...


def admin_urls(doc: object, port_name: str) -> list[str]:
    """Every endpoint address of an EndpointSliceList, whatever its conditions (a router
    that is terminating or not ready may still finish requests), on the port named
    ``port_name`` (or of that number)."""
    items = doc.get("items") if isinstance(doc, dict) else None
    out: set[str] = set()
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        port = next((p.get("port") for p in item.get("ports") or [] if isinstance(p, dict)
                     and (p.get("name") == port_name or str(p.get("port")) == port_name)),
                    None)
        if not isinstance(port, int) or isinstance(port, bool):
            continue
        for ep in item.get("endpoints") or []:
            for addr in (ep.get("addresses") if isinstance(ep, dict) else None) or []:
                if isinstance(addr, str) and addr:
                    host = f"[{addr}]" if ":" in addr else addr
                    out.add(f"http://{host}:{port}")
    return sorted(out)


class ServiceRouters:
    """Every replica of the router behind ``namespace/service`` (deploy/examples/router.yaml:
    two), asked through the admin port the Service names (``admin``): the requests in flight
    summed over all of them, once every one has the replicas draining. A router whose admin
    port refuses the connection is not running and holds nothing; one that does not answer,
    or no router found at all, leaves it unknown (None: the controller waits, up to the
    schedule's drain timeout)."""

    def __init__(self, slices: EndpointSliceReader, namespace: str, service: str,
                 port_name: str = "admin", timeout_s: float = 5.0) -> None:
        self.slices, self.namespace, self.service = slices, namespace, service
        self.port_name, self.timeout_s = port_name, timeout_s

    def _all(self) -> list[dict[str, dict[str, Any]] | None] | None:
        """Each running router's replicas (None for one that does not answer usefully); None
        when the routers cannot be listed."""
        try:
            urls = admin_urls(self.slices.list_endpoint_slices(self.namespace, self.service),
                              self.port_name)
        except Exception:  # the API server away, or no right to read: cannot tell
            return None
        out = []
        for url in urls:
            try:
                out.append(_replicas(url, self.timeout_s))
            except _Refused:
                continue
        return out

    def outstanding(self, replicas: list[str]) -> int | None:
        routers = self._all()
        if not routers:  # none found (or none running): no answer to wait for
            return None
        total = 0
        for known in routers:
            n = None if known is None else _outstanding(known, replicas)
            if n is None:
                return None
            total += n
        return total

    def serving(self, keep: list[str], leaving: list[str]) -> bool | None:
        routers = self._all()
        if routers is None:
            return None
        if any(known is None for known in routers):
            return None
        return all(_serving(known, keep, leaving) for known in routers if known is not None)


class Routers:
    """Several routers (several ``--routers`` Services, or admin URLs): the sum of their
    answers, unknown if any one cannot tell."""

    def __init__(self, parts: list[RouterPort]) -> None:
        self.parts = parts

    def outstanding(self, replicas: list[str]) -> int | None:
        total = 0
        for p in self.parts:
            n = p.outstanding(replicas)
            if n is None:
                return None
            total += n
        return total

    def serving(self, keep: list[str], leaving: list[str]) -> bool | None:
        answers = [p.serving(keep, leaving) for p in self.parts]
        return None if None in answers else all(answers)


__all__ = ["EndpointSliceReader", "HttpRouter", "RouterPort", "Routers", "ServiceRouters",
           "admin_urls"]
