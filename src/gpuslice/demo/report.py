"""The demo's one-page HTML report (plots embedded), its JSON summary and the lines printed at
the end."""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpuslice.core.generative import GenerativeService
from gpuslice.core.planner import Service


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def measured_window(samples: Sequence[Any]) -> tuple[float, float] | None:
    """The seconds (since the demo started) over which load was sent and answers measured."""
    if not samples:
        return None
    ts = [s.t for s in samples]
    return float(min(ts)), float(max(ts))


def _latency_plot(result: dict[str, Any], samples: Sequence[Any],
                  services: Sequence[Service]) -> Any:
    from gpuslice.adapters.optional import pyplot

    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    window = measured_window(samples)
    for i, svc in enumerate(services):
        mine = [s for s in samples if s.service == svc.name]
        if not mine:
            continue
        t = np.array([s.t for s in mine])
        lat = np.array([s.latency_s * 1000 for s in mine])
        ok = np.array([s.status == 200 for s in mine])
        bins = np.arange(np.floor(t.min()), np.ceil(t.max()) + 1, 1.0)
        p99, rate, xs = [], [], []
        for lo in bins[:-1]:
            sel = (t >= lo) & (t < lo + 1)
            good = lat[sel & ok]
            xs.append(lo + 0.5)
            p99.append(np.percentile(good, 99) if len(good) else np.nan)
            rate.append(float(np.sum(sel & ok)))
        c = colors[i % len(colors)]
        ax.plot(xs, p99, color=c, label=f"{svc.name}: p99 per 1 s window")
        ax.axhline(svc.slo_ms, color=c, linestyle="--", linewidth=0.9,
                   label=f"{svc.name}: SLO {svc.slo_ms:g} ms")
        ax2.plot(xs, rate, color=c, label=f"{svc.name}: answered/s (offered {svc.rate:g}/s)")
    _phases(ax, ax2, result, window)
    ax.set_ylabel("p99 latency of answered\nrequests, ms (log scale)")
    _log_axis(ax)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax2.set_ylabel("answered requests/s")
    ax2.set_xlabel("seconds since the demo started")
    ax2.set_ylim(bottom=0)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    title = "Latency and throughput per service, through the gpuslice router"
    if window is not None:
        title += (f"\nmeasured from {window[0]:.1f} s to {window[1]:.1f} s "
                  f"({window[1] - window[0]:.0f} s of open-loop load; before it: bring-up, "
                  "plan, deploy)")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def _phases(ax: Any, ax2: Any, result: dict[str, Any],
            window: tuple[float, float] | None) -> None:
    """The phases under load, shaded in turn on both axes and named above ``ax``; the set-up
    phases before the load (no data) are left out of the x axis (the titles say them)."""
    last = window[1] if window else max((ph["start"] for ph in result["phases"]), default=0.0)
    phases = [ph for ph in result["phases"]
              if window is None or (ph.get("end") or last) > window[0]]
    for k, ph in enumerate(phases):
        start = max(ph["start"], window[0]) if window else ph["start"]
        end = ph.get("end") or max(last, start)
        for a in (ax, ax2):
            a.axvline(start, color="0.5", linewidth=0.6)
            if k % 2:
                a.axvspan(start, end, color="0.93", zorder=0)
        if end - start >= 1.0:
            ax.text((start + end) / 2, 1.02, ph["name"].split(":")[0], ha="center",
                    va="bottom", fontsize=8, color="0.3", transform=ax.get_xaxis_transform())
    if window is not None:
        ax.set_xlim(window[0] - 0.5, window[1] + 0.5)


def _log_axis(ax: Any) -> None:
    """A log y axis in plain numbers (200, 60), not 2x10^2, on the major ticks and on the
    minor ticks that matplotlib labels when the axis spans less than a few decades."""
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(_plain_log_minor())
    ax.grid(alpha=0.3, which="major")


def _token_plot(result: dict[str, Any], samples: Sequence[Any],
                services: Sequence[GenerativeService], every_s: float = 2.0) -> Any:
    """The generative services' p99 time to the first token and per output token in windows
    of ``every_s``, against their SLOs, phase by phase."""
    from gpuslice.adapters.optional import pyplot

    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 5), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    window = measured_window(samples)
    for i, svc in enumerate(services):
        mine = [s for s in samples if s.service == svc.name and s.status == 200]
        c = colors[(i + 3) % len(colors)]
        for a, key, slo, what in ((ax, "ttft_s", svc.slo_ttft_ms, "TTFT"),
                                  (ax2, "tpot_s", svc.slo_tpot_ms, "TPOT")):
            got = [(s.t, getattr(s, key) * 1000) for s in mine if getattr(s, key) is not None]
            xs, p99 = _windowed(got, every_s)
            a.plot(xs, p99, color=c, marker=".", label=f"{svc.name}: {what} p99 per "
                   f"{every_s:g} s window")
            a.axhline(slo, color=c, linestyle="--", linewidth=0.9,
                      label=f"{svc.name}: {what} SLO {slo:g} ms")
    _phases(ax, ax2, result, window)
    ax.set_ylabel("time to first token,\nms (log scale)")
    ax2.set_ylabel("time per output\ntoken, ms (log scale)")
    ax2.set_xlabel("seconds since the demo started")
    for a in (ax, ax2):
        _log_axis(a)
        a.set_ylim(top=a.get_ylim()[1] * 1.3)  # the SLO lines clear of the frame
        a.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.suptitle("Generative services: streamed chat completions through the gpuslice router "
                 "(measured at the client)", fontsize=11)
    fig.tight_layout()
    return fig


def _windowed(points: Sequence[tuple[float, float]], every_s: float
              ) -> tuple[list[float], list[float]]:
    """(window middles, p99 of each window's values; NaN where it has none)."""
    if not points:
        return [], []
    t = np.array([p[0] for p in points])
    v = np.array([p[1] for p in points])
    xs, p99 = [], []
    for lo in np.arange(np.floor(t.min()), t.max() + every_s, every_s):
        sel = (t >= lo) & (t < lo + every_s)
        xs.append(float(lo + every_s / 2))
        p99.append(float(np.percentile(v[sel], 99)) if sel.any() else float("nan"))
    return xs, p99


def _plain_log_minor() -> Any:
    """matplotlib's choice of which minor ticks of a log axis to label, written as plain
    numbers (its own formatter writes them as 2x10^2)."""
    from matplotlib.ticker import LogFormatterSciNotation

    class Plain(LogFormatterSciNotation):
        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    return Plain(labelOnlyBase=False)


def _gpu_plot(result: dict[str, Any]) -> Any:
    from gpuslice.adapters.optional import pyplot

    plt = pyplot()

    rows: dict[str, list[tuple[str, int]]] = {}
    models: dict[str, str] = {}
    for p in result["placements"]:
        if not p.get("node"):
            continue
        for u in p["gpus"]:
            rows.setdefault(u, []).append((p["pod"].split("/")[-1], p["milli"]))
            models[u] = p.get("gpu_model") or ""
    names = sorted(rows)
    fig, ax = plt.subplots(figsize=(10, 0.5 * max(3, len(names)) + 1))
    for y, u in enumerate(names):
        left = 0
        for pod, milli in rows[u]:
            ax.barh(y, milli, left=left, edgecolor="black")
            if milli >= 100:
                ax.text(left + milli / 2, y, pod, ha="center", va="center", fontsize=7)
            left += milli
    ax.set_yticks(range(len(names)), [f"{u} ({models[u]})" for u in names], fontsize=8)
    ax.set_xlim(0, 1000)
    ax.set_xlabel("milli-GPU held (1000 = the whole GPU)")
    ax.set_title(f"{result['gpus_used']} GPUs in use for pods that would take "
                 f"{result['gpus_exclusive']} whole GPUs")
    return fig


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols)
                   + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(v: Any) -> str:
    """A cell as a reader wants it: no Python reprs (None, True, [..], {..}, 100.0)."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list):
        return ", ".join(_fmt(x) for x in v) or "-"
    if isinstance(v, dict):
        return "; ".join(f"{str(k).replace('_', ' ')}: {_fmt(x)}" for k, x in v.items())
    return str(v)


def _reconfig_text(rc: dict[str, Any] | None) -> str:
    if not rc:
        return "-"
    secs = ", ".join(f"{x:.1f} s" for x in rc.get("seconds_per_gpu") or []
                     if isinstance(x, (int, float)))
    return f"{rc.get('moves', 0)} replica move(s); {secs or '?'} per GPU"


def _window_text(samples: Sequence[Any]) -> str:
    window = measured_window(samples)
    if window is None:
        return "No load was sent."
    return (f"Measured window: {window[0]:.1f} s to {window[1]:.1f} s after the start "
            f"({window[1] - window[0]:.0f} s of open-loop Poisson load at the planned rates, "
            f"{len(samples)} requests). Latency percentiles are over the answered requests; "
            "rejected ones got 429 from the router's SLO admission control.")


def write_report(out: Path, result: dict[str, Any], samples: Sequence[Any],
                 services: Sequence[Service],
                 generative: Sequence[GenerativeService] = ()) -> list[Path]:
    """``index.html`` (the plots embedded), ``summary.json`` and the plots as PNG files
    (``tokens.png`` with the generative services' TTFT and TPOT, when there are any)."""
    from gpuslice.adapters.optional import pyplot

    plt = pyplot()
    out.mkdir(parents=True, exist_ok=True)
    figs = {"latency.png": _latency_plot(result, samples, services), "gpus.png": _gpu_plot(result)}
    if generative:
        figs["tokens.png"] = _token_plot(result, samples, generative)
    images = {name: _png(f) for name, f in figs.items()}
    for name, f in figs.items():
        f.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(f)
    index = out / "index.html"
    index.write_text("\n".join(_page(result, samples, images)))
    js = out / "summary.json"
    js.write_text(json.dumps(result, indent=1))
    return [index, js, *(out / name for name in figs)]


def _img(images: dict[str, str], name: str) -> str:
    return f"<img src='data:image/png;base64,{images[name]}' width='100%'>" \
        if name in images else ""


def _page(result: dict[str, Any], samples: Sequence[Any], images: dict[str, str]) -> list[str]:
    lat_rows: list[dict[str, Any]] = []
    gen_rows: list[dict[str, Any]] = []
    for ph in result["latency_by_phase"]:
        for svc, s in ph["services"].items():
            row = {"phase": ph["phase"].split(":")[0], "service": svc, **s}
            (gen_rows if s.get("api") == "openai" else lat_rows).append(row)
    plan = result.get("plan") or {}
    parts = [
        "<!doctype html><meta charset='utf-8'><title>gpuslice demo report</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}"
        "table{border-collapse:collapse;font-size:12px;margin:8px 0}"
        "td,th{border:1px solid #ccc;padding:2px 6px}</style>",
        "<h1>gpuslice demo</h1>",
        f"<p><b>{result['gpus_used']}</b> GPUs in use for pods that would take "
        f"<b>{result['gpus_exclusive']}</b> whole GPUs with exclusive allocation. "
        f"Plan: {plan.get('gpus')} GPU(s) at cost {plan.get('cost_per_hour')}/h, "
        f"solved and replay-checked in {_fmt(plan.get('seconds'))} s. Replica killed: "
        f"{html.escape(result.get('killed') or '-')}. Reconfiguration: "
        f"{html.escape(_reconfig_text(result.get('reconfig')))}.</p>",
        f"<p>{html.escape(_window_text(samples))}</p>",
        _img(images, "latency.png"),
        "<h2>Latency per service and phase</h2>",
        _table(lat_rows, ["phase", "service", "sent", "ok", "rejected", "failed", "p50_ms",
                          "p99_ms", "slo_ms", "slo_met"]),
    ]
    if gen_rows:
        parts += [
            "<h2>Generative services: time to first token and per output token</h2>",
            "<p>Streamed chat completions, timed at the client from the send: TTFT to the "
            "first token, TPOT the mean time per output token after it, p50 and p99 over the "
            "answered streams. The SLOs are met where both p99s are within them and no "
            "request failed.</p>",
            _img(images, "tokens.png"),
            _table(gen_rows, ["phase", "service", "sent", "ok", "rejected", "failed",
                              "ttft_p50_ms", "ttft_p99_ms", "slo_ttft_ms", "tpot_p50_ms",
                              "tpot_p99_ms", "slo_tpot_ms", "slo_met"])]
    parts += [
        "<h2>Where every pod went</h2>",
        _img(images, "gpus.png"),
        _table(result["placements"], ["pod", "node", "gpu_model", "gpus", "mig_instance",
                                      "milli", "memory_mib", "mode", "score", "batch",
                                      "service_ms", "restarts", "why_pending"]),
        "<h2>The plan</h2>",
        _table(plan.get("slices", []), ["gpu", "model", "profile", "service", "batch",
                                        "max_seqs", "throughput_rps"]),
        "<h2>Events</h2>",
        _table(result["events"], ["t", "kind", "text"]),
    ]
    return parts


def summary_lines(result: dict[str, Any]) -> list[str]:
    """What ``gpuslice demo`` prints at the end: the GPUs, each service's latency (a
    generative one's TTFT and TPOT) against its SLOs over the whole run, met or missed."""
    lines = [f"GPUs in use: {result['gpus_used']} (exclusive allocation: "
             f"{result['gpus_exclusive']})"]
    for name, s in result["latency_total"].items():
        counts = (f"{s['ok']}/{s['sent']} answered, {s['rejected']} rejected, "
                  f"{s['failed']} failed")
        if s.get("api") == "openai":
            lines.append(f"{name}: TTFT p99 {_fmt(s['ttft_p99_ms'])} ms (SLO "
                         f"{s['slo_ttft_ms']:g} ms), TPOT p99 {_fmt(s['tpot_p99_ms'])} ms (SLO "
                         f"{s['slo_tpot_ms']:g} ms), SLOs {_met(s)}, {counts}")
        else:
            lines.append(f"{name}: p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms (SLO "
                         f"{s['slo_ms']:g} ms), {counts}")
    lines.append(f"report: {result['files'][0]}")
    return lines


def _met(s: dict[str, Any]) -> str:
    return "met" if s.get("slo_met") else "missed"
