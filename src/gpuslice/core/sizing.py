"""Slice sizing for co-located replicas: MPS thread caps (and batch sizes) from profiles.

Given the replicas that will share one GPU (or MIG instance) under MPS, each with its model and,
for latency-critical ones, a p99 SLO, :func:`size_slices` chooses per replica an active-thread
percentage and a batch size so that

- every latency-critical replica gets the smallest cap (then the largest batch) whose profiled
  p99 batch latency is within its SLO, with the interference of the number of processes that
  will actually share the GPU (the profile point with that ``procs``, or the nearest measured
  above it);
- the percentage left is split among the best-effort replicas to maximise their total
  throughput (a knapsack over the profile's caps, interpolated linearly between measured caps),
  each best-effort replica getting at least ``min_pct``;
- caps add up to at most 100, so latency-critical replicas are never out-competed;
- best-effort replicas run at below-normal MPS client priority (:attr:`SliceSize.priority`),
  so a latency-critical neighbour's kernels go first.

Profiles are :class:`ProfilePoint` with ``slice_kind == "mps"`` and ``slice_size`` = thread %
(``gpuslice profile`` writes them). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpuslice.core.errors import GpusliceError, ValidationError
from gpuslice.core.profiles import ProfilePoint, ProfileSet


class Unsizable(GpusliceError):
    """No caps satisfy the SLOs on this GPU; the message says which replica and why."""


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    model: str
    slo_ms: float | None = None  # None: best effort
    batches: tuple[int, ...] = ()  # allowed batch sizes (empty: any profiled)

    @property
    def critical(self) -> bool:
        return self.slo_ms is not None


@dataclass(frozen=True, slots=True)
class SliceSize:
    name: str
    thread_pct: int
    batch: int
    throughput: float  # requests/s predicted
    p99_ms: float  # predicted batch latency (p99 where profiled)
    critical: bool

    @property
    def priority(self) -> str:
        """The MPS client priority (``core.model.PRIORITIES``): best-effort replicas yield to
        latency-critical ones next to them."""
        return "latency-critical" if self.critical else "best-effort"


def _points(profiles: ProfileSet, model: str, gpu: str, procs: int,
            batches: tuple[int, ...]) -> dict[tuple[int, int], ProfilePoint]:
    """(thread %, batch) -> the point measured with the fewest processes >= ``procs`` (the
    most co-runners when none is measured with that many)."""
    cands = [p for p in profiles.points if p.model == model and p.gpu == gpu and p.ran
             and p.slice_kind == "mps" and (not batches or p.batch in batches)]
    if not cands:
        return {}
    measured = sorted({p.procs for p in cands})
    above = [n for n in measured if n >= procs]
    use = above[0] if above else measured[-1]
    return {(p.slice_size, p.batch): p for p in cands if p.procs == use}


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0] * x / xs[0]  # below the smallest measured cap: proportional
    for (x0, y0), (x1, y1) in zip(zip(xs, ys, strict=True), zip(xs[1:], ys[1:], strict=True),
                                  strict=False):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def size_slices(tenants: Sequence[Tenant], profiles: ProfileSet, gpu: str, *,
                step: int = 5, min_pct: int = 5) -> list[SliceSize]:
    """Caps and batches for ``tenants`` sharing one GPU of type ``gpu`` (see the module)."""
    if not tenants:
        return []
    if not 1 <= step <= 50 or 100 % step:
        raise ValidationError("step", "a divisor of 100 from 1 to 50", step)
    names = [t.name for t in tenants]
    if len(set(names)) != len(names):
        raise ValidationError("tenants", "distinct names", names)
    n = len(tenants)
    out = {t.name: _size_critical(t, profiles, gpu, n) for t in tenants if t.critical}
    used = sum(s.thread_pct for s in out.values())
    if used > 100:
        raise Unsizable(f"the latency-critical replicas need {used}% of the GPU together: "
                        + ", ".join(f"{s.name} {s.thread_pct}%" for s in out.values()))
    best_effort = [t for t in tenants if not t.critical]
    left = 100 - used
    if best_effort and left < min_pct * len(best_effort):
        raise Unsizable(f"{left}% left after the latency-critical replicas; the "
                        f"{len(best_effort)} best-effort ones need {min_pct}% each")
    curves = [(t, _curve(t, profiles, gpu, n, range(min_pct, left + 1, step)))
              for t in best_effort]
    if curves:
        picks = _split(curves, list(range(min_pct, left + 1, step)), left)
        for (t, curve), pct in zip(curves, picks, strict=True):
            thr, b, lat = curve[pct]
            out[t.name] = SliceSize(t.name, pct, b, thr, lat, False)
    return [out[t.name] for t in tenants]


def _size_critical(t: Tenant, profiles: ProfileSet, gpu: str, n: int) -> SliceSize:
    """A latency-critical tenant's smallest profiled cap meeting its SLO with ``n`` processes
    on the GPU (then the highest throughput, then the smallest batch)."""
    assert t.slo_ms is not None
    pts = _points(profiles, t.model, gpu, n, t.batches)
    if not pts:
        raise Unsizable(f"{t.name}: no MPS profile of {t.model} on {gpu}")
    ok = [p for p in pts.values() if p.tail_latency_s * 1000 <= t.slo_ms]
    if not ok:
        fastest = min(pts.values(), key=lambda p: p.tail_latency_s)
        raise Unsizable(f"{t.name}: no profiled cap meets its {t.slo_ms:g} ms SLO with {n} "
                        f"processes on the GPU (best: {fastest.tail_latency_s * 1000:.1f} "
                        f"ms at {fastest.slice_size}% batch {fastest.batch})")
    p = min(ok, key=lambda p: (p.slice_size, -p.throughput, p.batch))
    return SliceSize(t.name, p.slice_size, p.batch, p.throughput, p.tail_latency_s * 1000, True)


def _curve(t: Tenant, profiles: ProfileSet, gpu: str, n: int,
           grid: range) -> dict[int, tuple[float, int, float]]:
    """A best-effort tenant's throughput at each cap of ``grid`` (the best batch at that
    cap, interpolated between profiled caps): cap -> (throughput, batch, latency ms)."""
    pts = _points(profiles, t.model, gpu, n, t.batches)
    if not pts:
        raise Unsizable(f"{t.name}: no MPS profile of {t.model} on {gpu}")
    batches = sorted({b for _, b in pts})
    curve: dict[int, tuple[float, int, float]] = {}
    for pct in grid:
        best: tuple[float, int, float] | None = None
        for b in batches:
            caps = sorted(c for c, bb in pts if bb == b)
            thr = _interp(caps, [pts[(c, b)].throughput for c in caps], pct)
            lat = _interp(caps, [pts[(c, b)].tail_latency_s for c in caps], pct) \
                if pct >= caps[0] else pts[(caps[0], b)].tail_latency_s * caps[0] / pct
            if best is None or thr > best[0]:
                best = (thr, b, lat * 1000)
        assert best is not None
        curve[pct] = best
    return curve


def _split(curves: Sequence[tuple[Tenant, dict[int, tuple[float, int, float]]]],
           grid: list[int], left: int) -> tuple[int, ...]:
    """The best-effort caps (one per curve) adding up to at most ``left`` with the highest
    total throughput (a knapsack); among equal totals (a straight stretch of the interpolated
    curves makes many), the least GPU, then the most even caps (smallest sum of squares), so
    identical replicas get identical slices."""
    table: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}

    def rank(v: tuple[float, tuple[int, ...]]) -> tuple[float, int]:
        return round(v[0], 6), -sum(p * p for p in v[1])

    for _, curve in curves:
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for spent, (val, picks) in table.items():
            for pct in grid:
                total = spent + pct
                if total > left:
                    break
                cand = (val + curve[pct][0], (*picks, pct))
                if total not in nxt or rank(cand) > rank(nxt[total]):
                    nxt[total] = cand
        table = nxt
    return max(table.values(), key=lambda v: (round(v[0], 6), -sum(v[1]),
                                              -sum(p * p for p in v[1])))[1]
