"""The router's admin API as other services use it: how many requests are in flight on some
replicas, once the router has them all draining."""

from __future__ import annotations

import json
from typing import Protocol


class RouterPort(Protocol):
    def outstanding(self, replicas: list[str]) -> int | None:
        """In-flight requests on these replicas, once the router has them all draining (or no
        longer has them); None while it cannot tell yet."""
        ...


class HttpRouter:
    """The router's admin ``/replicas`` over HTTP."""

    def __init__(self, admin_url: str) -> None:
        self.url = admin_url.rstrip("/")

    def outstanding(self, replicas: list[str]) -> int | None:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/replicas", timeout=5) as r:
                doc = json.loads(r.read())
        except (OSError, ValueError, urllib.error.URLError):
            return None
        names = set(replicas)
        mine = [x for svc in doc.values() for x in svc.get("replicas", [])
                if x.get("name") in names]
        if any(not x.get("draining") for x in mine):
            return None  # the router has not seen the draining mark yet: it may still send
        return sum(int(x.get("outstanding", 0)) for x in mine)


__all__ = ["HttpRouter", "RouterPort"]
