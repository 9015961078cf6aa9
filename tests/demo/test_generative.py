"""The demo's generative service (issue 52, point 4): planned on the shipped generative profile,
its replica a ``fake_llm`` sized from the slice the kubelet was handed, routed as an OpenAI
service with its token speeds, driven with streamed chat completions, and reported as TTFT and
TPOT p99 against its SLOs."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import numpy as np
import pytest

from gpuslice.core.errors import ValidationError
from gpuslice.core.generative import GenerativeService
from gpuslice.core.planner import FleetType, Service
from gpuslice.core.routing_config import parse_router_config
from gpuslice.demo.cluster import API, Cluster, NodeSpec, router_config_from_pods
from gpuslice.demo.generative import (
    generative_pods,
    left_over,
    plan_generative,
    plan_slices,
    router_services,
)
from gpuslice.demo.load import Sample, chat_load, chat_stats
from gpuslice.demo.report import _token_plot, summary_lines, write_report
from gpuslice.demo.runtime import Container, EventLog, InProcessRuntime, llm_engine

CHAT = GenerativeService("chat", "llama-3.2-3b", 2.0, 500.0, 50.0, 256.0, 64.0)


@pytest.mark.parametrize(("share", "slice_"), [
    (0.142, "1g"), (0.285, "2g"), (0.28, "2g"), (0.428, "3g"), (0.571, "4g"),
    (0.714, "4g"),  # 5 sevenths: fake_llm has no 5g, the 4g below it
    (1.0, "7g"), (0.05, "1g"),
])
def test_a_generative_replica_runs_the_slice_its_share_is(share: float, slice_: str) -> None:
    e = llm_engine("m", share, 12)
    assert e.slice == slice_
    assert e.spec.max_seqs == 12
    assert e.argv() == ["--model", "m", "--slice", slice_, "--max-num-seqs", "12"]


@pytest.mark.parametrize(("args", "field"), [
    (("", 0.3, 8), "model"), (("m", 0.0, 8), "share"), (("m", 1.5, 8), "share"),
    (("m", 0.3, 0), "max_seqs"), (("m", 0.3, True), "max_seqs"),
])
def test_a_bad_generative_replica_names_its_field(args: tuple[Any, ...], field: str) -> None:
    with pytest.raises(ValidationError) as exc:
        llm_engine(*args)
    assert exc.value.field == field


def test_the_plan_sizes_one_slice_and_the_replica_matches_its_profile_row() -> None:
    log = EventLog()
    fleet = [FleetType("A100-80GB", 2, 1.0), FleetType("H100-SXM", 2, 2.0)]
    p = plan_generative(fleet, 1, log, first_gpu=1)
    (row,) = plan_slices(p)
    assert row == {"gpu": 1, "model": "A100-80GB", "profile": "2g.20gb", "service": "chat",
                   "batch": None, "max_seqs": 46, "throughput_rps": 9.01}
    assert any("GPU 1 A100-80GB: chat 2g.20gb, up to 46 sequences" in e.text
               for e in log.events)
    (pod,) = generative_pods(p)
    ann = pod["metadata"]["annotations"]
    assert ann[API] == "openai" and ann["demo.gpuslice.io/batch"] == "46"
    assert ann["gpuslice.io/gpu-model"] == "A100-80GB"
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits["gpuslice.io/gpu-milli"] == "285"
    # the kubelet's engine for that slice is the profile row's: the same token speeds
    engine = llm_engine("llama-3.2-3b", 285 / 1000, 46)
    seg = p.sized["chat"].by_slice[("A100-80GB", 2)]
    fields = engine.router_fields()
    assert fields["prefill_tokens_per_s"] == pytest.approx(seg.prefill_tokens_per_s, rel=0.01)
    assert fields["decode_tokens_per_s"] == pytest.approx(1 / seg.step_s, rel=0.01)
    (entry,) = router_services(p)
    assert entry["api"] == "openai" and entry["models"] == ["llama-3.2-3b"]
    assert (entry["slo_ttft_ms"], entry["slo_tpot_ms"]) == (500.0, 50.0)


def test_the_generative_plan_takes_what_the_other_plan_left() -> None:
    used = SimpleNamespace(gpus=[SimpleNamespace(gpu="H100-SXM")])
    fleet = [FleetType("A100-80GB", 2, 1.0), FleetType("H100-SXM", 1, 2.0),
             FleetType("L40S", None, 1.5)]
    left = left_over(fleet, used)  # type: ignore[arg-type]
    assert [(f.gpu, f.count) for f in left] == [("A100-80GB", 2), ("L40S", None)]


def test_no_generative_service_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError) as exc:
        plan_generative([FleetType("A100-80GB", 2, 1.0)], 1, EventLog(), services=())
    assert exc.value.field == "services"


def _s(status: int, ttft_ms: float | None, tpot_ms: float | None) -> Sample:
    return Sample("chat", 1.0, 2.0, status, None if ttft_ms is None else ttft_ms / 1000,
                  None if tpot_ms is None else tpot_ms / 1000)


@pytest.mark.parametrize(("samples", "ttft_met", "tpot_met", "met"), [
    ([_s(200, 100, 30)] * 5, True, True, True),
    ([_s(200, 100, 30)] * 4 + [_s(200, 900, 30)], False, True, False),
    ([_s(200, 100, 30)] * 4 + [_s(200, 100, 80)], True, False, False),
    ([_s(200, 100, 30)] * 4 + [_s(0, None, None)], True, True, False),  # one failed
    ([_s(429, None, None)], False, False, False),  # nothing answered: no p99 to meet
])
def test_chat_figures_against_the_slos(samples: list[Sample], ttft_met: bool, tpot_met: bool,
                                       met: bool) -> None:
    st = chat_stats(samples, CHAT)
    assert (st["ttft_slo_met"], st["tpot_slo_met"], st["slo_met"]) == (ttft_met, tpot_met, met)
    assert (st["slo_ttft_ms"], st["slo_tpot_ms"], st["api"]) == (500.0, 50.0, "openai")
    assert st["sent"] == len(samples)


def test_the_cluster_runs_the_planned_llm_and_the_router_gets_its_token_speeds(
        tmp_path: Path) -> None:
    c = Cluster(tmp_path, uuid.uuid4().hex[:8], b"generative-test-key-0123456789",
                EventLog(), runtime=InProcessRuntime(), agent_poll_s=0.1)
    try:
        c.add_node(NodeSpec("a100-0", ("A100-80GB",) * 2))
        c.start_extender()
        p = plan_generative([FleetType("A100-80GB", 2, 1.0)], 1, c.log)
        for pod in generative_pods(p):
            c.api.add_pod(pod)
        end = time.monotonic() + 20
        while c.container_of("demo/chat-0") is None and time.monotonic() < end:
            time.sleep(0.05)
        found = c.container_of("demo/chat-0")
        assert found is not None, [e.text for e in c.log.events]
        box = found[1]
        assert box.llm is not None and (box.llm.slice, box.llm.spec.max_seqs) == ("2g", 46)
        while not router_config_from_pods(c, router_services(p))["services"][0]["replicas"] \
                and time.monotonic() < end:
            time.sleep(0.05)
        doc = router_config_from_pods(c, router_services(p))
        (rep,) = doc["services"][0]["replicas"]
        assert rep["max_num_seqs"] == 46 and rep["prefill_tokens_per_s"] > 6000
        assert "service_time_ms" not in rep
        spec = parse_router_config(doc).service("chat")
        assert spec.generative and spec.slo_ttft_s == 0.5 and spec.slo_tpot_s == 0.05
        assert spec.replicas[0].concurrency == 46 and spec.replicas[0].kv_tokens > 0
    finally:
        c.stop()


def test_streamed_chat_load_measures_ttft_and_tpot_at_the_client() -> None:
    rt = InProcessRuntime()
    engine = llm_engine("llama-3.2-3b", 1.0, 16)
    box = Container("demo/llm-0", "chat", "llama-3.2-3b", "A100-80GB", 1000, 16,
                    engine.step_ms, {}, llm=engine)
    fast = GenerativeService("chat", "llama-3.2-3b", 20.0, 500.0, 50.0, 64.0, 8.0)
    try:
        port = rt.start(box, "run")
        state = SimpleNamespace(samples=[], router_port=port, log=EventLog())

        async def drive() -> None:
            stop = asyncio.Event()
            async with aiohttp.ClientSession() as session:
                task = asyncio.create_task(chat_load(state, session, fast, stop,
                                                     np.random.default_rng(1)))
                await asyncio.sleep(1.0)
                stop.set()
                await task

        asyncio.run(drive())
    finally:
        rt.stop(box)
        rt.close()
    assert len(state.samples) >= 5
    for s in state.samples:
        assert s.status == 200 and s.service == "chat"
        assert s.ttft_s is not None and 0 < s.ttft_s < s.latency_s
        # 8 tokens at about 9 ms a step (7g): TPOT near the engine's step
        assert s.tpot_s is not None and 0.005 < s.tpot_s < 0.1
    st = chat_stats(state.samples, fast)
    assert st["slo_met"] and st["ttft_p99_ms"] is not None


def _result() -> dict[str, Any]:
    chat = chat_stats([_s(200, 100, 30)] * 3, CHAT)
    missed = chat_stats([_s(200, 100, 30), _s(200, 100, 70)], CHAT)
    return {
        "phases": [{"name": "serve: load", "start": 1.0, "end": 9.0},
                   {"name": "crash: a replica", "start": 9.0, "end": 16.0},
                   {"name": "done", "start": 16.0, "end": None}],
        "gpus_used": 2, "gpus_exclusive": 3,
        "plan": {"gpus": 1, "cost_per_hour": 1.0, "seconds": 0.1, "slices": []},
        "killed": "", "reconfig": {},
        "latency_by_phase": [{"phase": "serve: load", "services": {"chat": chat}},
                             {"phase": "crash: a replica", "services": {"chat": missed}}],
        "latency_total": {"chat": missed}, "placements": [], "events": [],
        "files": ["report/index.html"],
    }


BATCH = [Service("r", "resnet50", 10.0, 100.0)]


def _samples() -> list[Sample]:
    rng = np.random.default_rng(3)
    return [Sample("chat", float(t), 2.0, 200, float(rng.uniform(0.05, 0.2)),
                   float(rng.uniform(0.02, 0.04))) for t in np.arange(1.0, 15.9, 0.5)] + \
        [Sample("r", float(t), float(rng.uniform(0.02, 0.09)), 200)
         for t in np.arange(1.0, 15.9, 0.1)]


def test_the_report_shows_ttft_and_tpot_against_the_slos(tmp_path: Path) -> None:
    files = write_report(tmp_path, _result(), _samples(), BATCH, [CHAT])
    assert tmp_path / "tokens.png" in files and (tmp_path / "tokens.png").stat().st_size
    page = files[0].read_text()
    assert "Generative services: time to first token and per output token" in page
    assert "<th>ttft_p99_ms</th>" in page and "<th>slo_tpot_ms</th>" in page
    assert "<td>crash</td><td>chat</td>" in page
    assert "<td>69.6</td><td>50</td><td>no</td>" in page  # TPOT p99 over its SLO: missed
    (line,) = [x for x in summary_lines(_result()) if x.startswith("chat:")]
    assert line.startswith("chat: TTFT p99 100 ms (SLO 500 ms), TPOT p99 ")
    assert "(SLO 50 ms), SLOs missed, 2/2 answered, 0 rejected, 0 failed" in line


def test_the_token_plot_is_readable() -> None:
    fig = _token_plot(_result(), _samples(), [CHAT])
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    top, bottom = fig.axes
    assert [t.get_text() for t in top.texts] == ["serve", "crash"]
    for ax, slo in ((top, 500.0), (bottom, 50.0)):
        assert not ax.get_legend().get_window_extent(r).overlaps(ax.get_window_extent(r))
        assert slo < ax.get_ylim()[1]  # the SLO line inside the frame
        assert all("^" not in t.get_text() for t in ax.get_yticklabels())


def test_the_batch_services_report_is_unchanged_without_generative_ones(
        tmp_path: Path) -> None:
    result = _result()
    result["latency_by_phase"] = []
    files = write_report(tmp_path, result, [s for s in _samples() if s.service == "r"], BATCH)
    assert [f.name for f in files] == ["index.html", "summary.json", "latency.png", "gpus.png"]
    assert "Generative services" not in files[0].read_text()

