"""When each object of a collection was first seen in a state: a watch of the API server in a
thread, the monotonic time of the first event showing it. ``cluster_scale.py`` times its
bursts with it (each pod's first event with a node: its bind, as a client sees it), and
``cluster_scale_dra.py`` the claims' allocations."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"


class FirstSeen:
    """``seen[name]``: when the object ``name`` of the collection at ``path`` (an API path with
    its query, e.g. a field selector) first came in an event for which ``done(object)`` holds.
    ``metadata_only``: the events carry the objects' metadata alone (enough when the
    selector says all)."""

    def __init__(self, dev: Any, path: str, done: Callable[[dict[str, Any]], bool],
                 metadata_only: bool = False) -> None:
        self.dev, self.path, self.done = dev, path, done
        self.headers = {"Accept": METADATA_ONLY} if metadata_only else {}
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="first-seen")

    def start(self) -> FirstSeen:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        rv = ""
        sep = "&" if "?" in self.path else "?"
        while not self._stop.is_set():
            url = (f"{self.dev.server}{self.path}{sep}watch=1&allowWatchBookmarks=true"
                   "&timeoutSeconds=30" + (f"&resourceVersion={rv}" if rv else ""))
            try:
                req = urllib.request.Request(url, headers=self.headers)
                with urllib.request.urlopen(req, context=self.dev._ssl(), timeout=60) as r:
                    for line in r:
                        if self._stop.is_set():
                            return
                        ev = json.loads(line)
                        obj = ev.get("object") or {}
                        if ev.get("type") == "ERROR":  # e.g. 410 Gone: watch from now
                            rv = ""
                            break
                        rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                        name = (obj.get("metadata") or {}).get("name")
                        if ev.get("type") in ("ADDED", "MODIFIED") and name and \
                                name not in self.seen and self.done(obj):
                            self.seen[name] = time.monotonic()
            except (OSError, ValueError):
                time.sleep(0.5)


def burst_rate(times: list[float]) -> float:
    """Objects per second from the first to the last time (the burst's own rate: the
    scheduler's start and the poll that noticed the end left out); 0 with fewer than two."""
    if len(times) < 2 or max(times) <= min(times):
        return 0.0
    return (len(times) - 1) / (max(times) - min(times))


SHARES = (0.25, 0.5, 0.75, 0.9)


def burst_quantiles(times: list[float]) -> list[float]:
    """Seconds from the first time until each of :data:`SHARES` of the objects, then all, were
    seen (how the burst spread over time); empty with fewer than two."""
    if len(times) < 2:
        return []
    t = sorted(times)
    return [t[min(len(t) - 1, max(0, round(q * len(t)) - 1))] - t[0] for q in SHARES] + \
        [t[-1] - t[0]]
