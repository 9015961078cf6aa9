"""Where kube-scheduler's own CPU goes during a burst: a CPU profile from its
``/debug/pprof/profile`` (the dev cluster opens it on its loopback port, as it does
``/metrics``), read with ``go tool pprof`` (the Go toolchain that built the cluster; without it
the raw profile is kept and the breakdown skipped).

Used by ``cluster_scale.py --go-profile DIR``: one profile per run, started ``delay_s`` after the
scheduler is healthy and lasting ``seconds``; the breakdown gives, for a few places in
pkg/scheduler (schedule_one.go, framework/plugins/noderesources/fit.go, extender.go), the share
of the profile's samples spent there or below (pprof's cumulative share).
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


def breakdown(path: Path) -> list[tuple[str, float]] | None:
    """(what, cumulative % of the samples) for each row of :data:`WHERE`; None without Go."""
    go = go_tool()
    if go is None:
        return None
    return shares(subprocess.run([go, "tool", "pprof", "-top", "-cum", "-nodecount=100000",
                                  str(path)], check=True, capture_output=True, text=True,
                                 timeout=120).stdout)


def shares(top: str) -> list[tuple[str, float]]:
    """:data:`WHERE`'s rows from ``go tool pprof -top -cum``'s text (columns flat, flat%,
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
    for what, pattern in WHERE:
        rx = re.compile(pattern)
        out.append((what, max((v for name, v in cum.items() if rx.search(name)),
                              default=0.0)))
    return out

def table_lines(ours: list[tuple[str, float]] | None, alone: list[tuple[str, float]] | None,
                ms_ours: float, ms_alone: float, seconds: int, delay: float,
                errors: str) -> list[str]:
    """The two runs' breakdowns as markdown: share of the samples and ms of CPU per pod (the
    share of the scheduler's CPU per pod)."""
    if ours is None or alone is None:
        return [f"kube-scheduler profile: {errors or 'no Go toolchain to read it'}"]
    out = [f"kube-scheduler's CPU by where it went (pprof CPU profile, {seconds} s from "
           f"{delay:g} s into each burst; a row's share includes the rows indented under it; "
           "ms per pod = share x its CPU per pod):", "",
           "| where | with gpuslice % | ms per pod | alone % | ms per pod |",
           "|---|---|---|---|---|"]
    for (what, pa), (_, pb) in zip(ours, alone, strict=True):
        label = "&nbsp;" * (len(what) - len(what.lstrip())) + what.strip()
        out.append(f"| {label} | {pa:.1f} | {pa * ms_ours / 100:.2f} | {pb:.1f} | "
                   f"{pb * ms_alone / 100:.2f} |")
    return out
