"""The demo's report as a reader sees it (issue 18, first contact): plot labels that do not
overlap, legends off the data, the measured window stated, no Python reprs in the page."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from PIL import Image

from gpuslice.core.planner import Service
from gpuslice.demo.report import _latency_plot, write_report
from gpuslice.demo.scenario import Sample

SERVICES = [Service("resnet50", "resnet50", 200.0, 100.0), Service("bert", "bert-base", 60.0,
                                                                    200.0)]
# the set-up phases are short and come before any load, as in the demo
PHASES = [("bring-up: node agents", 0.0, 0.2), ("plan: services", 0.2, 1.1),
          ("deploy: replicas", 1.1, 11.7), ("serve: load", 11.7, 16.7),
          ("crash: a replica", 16.7, 20.7), ("reconfigure: an H100", 20.7, 40.3),
          ("scale-out: a job", 40.3, 48.6), ("done", 48.6, None)]


def _result() -> dict[str, object]:
    return {
        "phases": [{"name": n, "start": a, "end": b} for n, a, b in PHASES],
        "gpus_used": 5, "gpus_exclusive": 13,
        "plan": {"gpus": 1, "cost_per_hour": 2.0, "seconds": 0.808, "slices": [
            {"gpu": 0, "model": "H100-SXM", "profile": "1g.10gb", "service": "bert",
             "batch": 4, "throughput_rps": 45.9}]},
        "killed": "demo/resnet50-0",
        "reconfig": {"moves": 7, "seconds_per_gpu": [2.04, 13.87]},
        "latency_by_phase": [{"phase": "serve: load", "services": {"bert": {
            "sent": 10, "ok": 9, "rejected": 1, "failed": 0, "p50_ms": 100.0, "p99_ms": None,
            "slo_ms": 200.0, "slo_met": True}}}],
        "placements": [{"pod": "demo/bert-0", "node": "h100-0", "gpus": ["GPU-0"],
                        "gpu_model": "H100-SXM", "milli": 142, "mode": "mps",
                        "why_pending": None}],
        "events": [{"t": 0.01, "kind": "phase", "text": "bring-up"}],
    }


def _samples() -> list[Sample]:
    rng = np.random.default_rng(1)
    return [Sample(s.name, float(t), float(rng.exponential(0.05)), 200 if t % 3 else 429)
            for s in SERVICES for t in np.arange(11.7, 48.4, 0.05)]


def test_the_latency_plot_is_readable() -> None:
    fig = _latency_plot(_result(), _samples(), SERVICES)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    top, bottom = fig.axes
    labels = [t for t in top.texts]
    assert [t.get_text() for t in labels] == ["serve", "crash", "reconfigure", "scale-out"]
    boxes = [t.get_window_extent(r) for t in labels]
    for i, a in enumerate(boxes):  # no two phase names overlap
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), (a, b)
    for ax in (top, bottom):  # legends beside the plot, not over its data
        assert not ax.get_legend().get_window_extent(r).overlaps(ax.get_window_extent(r))
    # the x axis is the measured window (the set-up phases carry no data), and it is said
    lo, hi = top.get_xlim()
    assert 11 <= lo < 11.7 and 48.4 < hi <= 49
    assert "measured from 11.7 s to 48.4 s" in fig._suptitle.get_text()  # type: ignore[union-attr]
    # y ticks in plain numbers, not 10^2
    assert all("^" not in t.get_text() for t in top.get_yticklabels())


def test_the_page_has_no_python_reprs(tmp_path: Path) -> None:
    files = write_report(tmp_path, _result(), _samples(), SERVICES)
    page = files[0].read_text()
    page = re.sub(r"<style>.*?</style>", "", page, flags=re.S)
    text = re.sub(r"<[^>]+>", "|", page)
    for raw in ("True", "False", "None", "[", "{", "200.0"):
        assert raw not in text, raw
    assert "7 replica move(s); 2.0 s, 13.9 s per GPU" in text
    assert "Measured window: 11.7 s to 48.4 s after the start (37 s" in text
    assert "|yes|" in text and "|200|" in text
    assert Image.open(tmp_path / "latency.png").size[0] > 1000


def test_minor_ticks_of_a_narrow_latency_axis_are_plain_numbers() -> None:
    """Issue 54: p99 between 60 and 200 ms spans less than a decade, so matplotlib labels minor
    ticks, which its own log formatter writes as 2x10^2 and 6x10^1."""
    rng = np.random.default_rng(2)
    samples = [Sample(s.name, float(t), float(rng.uniform(0.06, 0.2)), 200)
               for s in SERVICES for t in np.arange(11.7, 48.4, 0.05)]
    fig = _latency_plot(_result(), samples, SERVICES)
    fig.canvas.draw()
    top = fig.axes[0]
    shown = [t.get_text() for t in [*top.get_yticklabels(), *top.get_yticklabels(minor=True)]
             if t.get_text()]
    assert len(shown) >= 3, shown
    for text in shown:
        assert re.fullmatch(r"\d+(\.\d+)?", text), shown
