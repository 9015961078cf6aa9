"""Where kube-scheduler's and kube-apiserver's own CPU goes during a burst: a CPU profile from
each one's ``/debug/pprof/profile`` (the dev cluster opens kube-scheduler's on its loopback
port, as it does ``/metrics``, and kube-apiserver's with ``apiserver_profiling``), read with
``go tool pprof`` (the Go toolchain that built the cluster; without it the raw profile is kept
and the breakdown skipped).

Used by ``cluster_scale.py --go-profile DIR``: one profile of each per run, started ``delay_s``
after the scheduler is healthy and lasting ``seconds``; the breakdown gives, for a few places
(:data:`WHERE` in pkg/scheduler: schedule_one.go, framework/plugins/noderesources/fit.go,
extender.go; :data:`APISERVER_WHERE` in k8s.io/apiserver and pkg/registry), the share of the
profile's samples spent there or below (pprof's cumulative share).
"""

from __future__ import annotations

import re
import shutil
import ssl
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

# (what, the function whose cumulative share it is); indented rows are part of the row above
WHERE: tuple[tuple[str, str], ...] = (
    ("filter plugins over the candidate nodes (findNodesThatPassFilters)",
     r"pkg/scheduler\.\(\*Scheduler\)\.findNodesThatPassFilters\.func1$"),
    ("  of which NodeResourcesFit (fitsRequest)",
     r"noderesources\.fitsRequest$"),
    ("    of which IsExtendedResourceName (a regular expression per node and extended "
     "resource)", r"core/v1/helper\.IsExtendedResourceName$"),
    ("score plugins (prioritizeNodes)", r"pkg/scheduler\.prioritizeNodes$"),
    ("extender filter calls (HTTPExtender.Filter)", r"\(\*HTTPExtender\)\.Filter$"),
    ("binding cycle (the Binding, or the extender's bind)",
     r"pkg/scheduler\.\(\*Scheduler\)\.bindingCycle$"),
    ("Go garbage collector (gcBgMarkWorker)", r"^runtime\.gcBgMarkWorker$"),
)

# kube-apiserver's: rows are cumulative shares and may overlap (a Binding's etcd write is in
# both its rows; the JSON encoding of watch events is in the watch's); indented rows are part
# of the row above
APISERVER_WHERE: tuple[tuple[str, str], ...] = (
    ("Bindings (BindingREST.Create)", r"pod/storage\.\(\*BindingREST\)\.Create$"),
    ("creates: Events, pods (CreateResource)",
     r"endpoints/handlers\.CreateResource\.createHandler\.func1$"),
    ("updates: Leases, node status (UpdateResource)",
     r"endpoints/handlers\.UpdateResource\.func1$"),
    ("writes to etcd (GuaranteedUpdate, Create)",
     r"storage/etcd3\.\(\*store\)\.(GuaranteedUpdate|Create)$"),
    ("request bodies decoded (versioning codec)",
     r"serializer/versioning\.\(\*codec\)\.Decode$"),
    ("  of which JSON", r"serializer/json\.\(\*Serializer\)\.Decode$"),
    ("watches served (handleWatch)", r"^k8s\.io/apiserver/pkg/endpoints/handlers\.handleWatch$"),
    ("  of which JSON encoding of the objects",
     r"serializer/json\.\(\*Serializer\)\.Encode$"),
    ("client certificates checked (x509, every request)",
     r"request/x509\.\(\*Authenticator\)\.AuthenticateRequest$"),
    ("bearer tokens checked (cached)",
     r"request/bearertoken\.\(\*Authenticator\)\.AuthenticateRequest$"),
    ("TLS handshakes (new connections)", r"crypto/tls\.\(\*Conn\)\.serverHandshake$"),
    ("Go garbage collector (gcBgMarkWorker)", r"^runtime\.gcBgMarkWorker$"),
)


def go_tool() -> str | None:
    for cand in (shutil.which("go"), "/usr/local/go/bin/go"):
        if cand and Path(cand).exists():
            return cand
    return None


class Capture:
    """One profile fetched on a thread: ``delay_s`` after :meth:`start`, ``seconds`` long."""

    def __init__(self, url: str, ctx: ssl.SSLContext, out: Path, delay_s: float = 2.0,
                 seconds: int = 10) -> None:
        self.url, self.ctx, self.out = url, ctx, out
        self.delay_s, self.seconds = delay_s, seconds
        self.error = ""
        self._thread = threading.Thread(target=self._run, daemon=True, name="pprof")

    def start(self) -> Capture:
        self._thread.start()
        return self

    def _run(self) -> None:
        time.sleep(self.delay_s)
        try:
            with urllib.request.urlopen(f"{self.url}/debug/pprof/profile?seconds="
                                        f"{self.seconds}", context=self.ctx,
                                        timeout=self.seconds + 30) as r:
                self.out.write_bytes(r.read())
        except OSError as exc:
            self.error = f"{self.url}/debug/pprof/profile: {exc}"

    def finish(self) -> Path | None:
        """The profile's path once fetched (waits for it), or None (``error`` says why)."""
        self._thread.join(self.delay_s + self.seconds + 40)
        return self.out if self.out.exists() and self.out.stat().st_size else None


Rows = tuple[tuple[str, str], ...]


def breakdown(path: Path, where: Rows = WHERE) -> list[tuple[str, float]] | None:
    """(what, cumulative % of the samples) for each row of ``where``; None without Go."""
    go = go_tool()
    if go is None:
        return None
    return shares(subprocess.run([go, "tool", "pprof", "-top", "-cum", "-nodecount=100000",
                                  str(path)], check=True, capture_output=True, text=True,
                                 timeout=120).stdout, where)


def shares(top: str, where: Rows = WHERE) -> list[tuple[str, float]]:
    """``where``'s rows from ``go tool pprof -top -cum``'s text (columns flat, flat%,
    sum%, cum, cum%, function); a function absent from the profile counts 0."""
    cum: dict[str, float] = {}
    for line in top.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[4].endswith("%"):
            try:
                cum[parts[5]] = float(parts[4].rstrip("%"))
            except ValueError:
                continue
    out = []
    for what, pattern in where:
        rx = re.compile(pattern)
        out.append((what, max((v for name, v in cum.items() if rx.search(name)),
                              default=0.0)))
    return out

def table_lines(ours: list[tuple[str, float]] | None, alone: list[tuple[str, float]] | None,
                ms_ours: float, ms_alone: float, seconds: int, delay: float,
                errors: str, who: str = "kube-scheduler") -> list[str]:
    """The two runs' breakdowns as markdown: share of the samples and ms of CPU per pod (the
    share of ``who``'s CPU per pod)."""
    if ours is None or alone is None:
        return [f"{who} profile: {errors or 'no Go toolchain to read it'}"]
    out = [f"{who}'s CPU by where it went (pprof CPU profile, {seconds} s from "
           f"{delay:g} s into each burst; a row's share includes the rows indented under it; "
           "ms per pod = share x its CPU per pod):", "",
           "| where | with gpuslice % | ms per pod | alone % | ms per pod |",
           "|---|---|---|---|---|"]
    for (what, pa), (_, pb) in zip(ours, alone, strict=True):
        label = "&nbsp;" * (len(what) - len(what.lstrip())) + what.strip()
        out.append(f"| {label} | {pa:.1f} | {pa * ms_ours / 100:.2f} | {pb:.1f} | "
                   f"{pb * ms_alone / 100:.2f} |")
    return out
