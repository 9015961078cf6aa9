"""``gpuslice plan`` as a new user meets it (issue 18, first contact): the smallest slice among
the fewest GPUs, bad services files refused naming the field, exit codes, ``-o json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuslice.cli import main
from gpuslice.core.planner import FleetType, PlanOptions, Service, plan, validate
from tests.planner.test_planner import PROF

PARVA = Path("profiles") / "parvagpu-a100-80gb"


def _services(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "services.yaml"
    path.write_text(text)
    return path


@pytest.mark.data
def test_a_small_service_gets_a_small_slice_not_a_whole_gpu(
        shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svc = _services(tmp_path, "- {name: v, model: vgg19, rate: 100, slo_ms: 200}\n")
    rc = main(["plan", "--profiles", str(shared_data / PARVA), "--services", str(svc),
               "-o", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["gpus"] == 1 and doc["valid"]
    (s,) = doc["services"]
    # one 1g slice serves 100 req/s of vgg19 within 0.45 x 200 ms; a 7g.80gb (1,531 req/s)
    # was planned before the second stage
    assert [seg["profile"] for seg in s["segments"]] == ["1g.10gb"]
    assert s["capacity_rps"] >= 100 and s["slo_met"]


def test_second_stage_never_adds_a_gpu_and_takes_less_compute() -> None:
    svcs = [Service("a", "fast", 3000, 40), Service("b", "slow", 500, 60),
            Service("c", "tiny", 40, 30)]
    fleet = [FleetType("A100-80GB")]
    # headroom 1e9: the floor is each service's first-stage capacity, so the second stage
    # can only swap slices for smaller ones that serve as much (the first stage's plan)
    loose = plan(PROF, svcs, fleet, PlanOptions(headroom=1e9))
    tight = plan(PROF, svcs, fleet, PlanOptions())
    assert validate(tight, svcs) == [] and tight.n_gpus == loose.n_gpus

    def compute(p: object) -> int:
        return sum(s.placement.profile.compute_slices for g in p.gpus  # type: ignore[attr-defined]
                   for s in g.slots if s.parts)

    assert compute(tight) <= compute(loose)
    for s in svcs:  # headroom kept: min(first-stage capacity, 1.25 x rate)
        assert tight.capacity(s.name) >= min(loose.capacity(s.name), 1.25 * s.rate) - 1e-6
    small = plan(PROF, [Service("c", "tiny", 40, 30)], fleet)
    assert [s.placement.profile.compute_slices for g in small.gpus for s in g.slots
            if s.parts] == [1]


@pytest.mark.parametrize(("line", "field", "what"), [
    ("{name: v, model: tiny, rate: -5, slo_ms: 200}", "'rate'", "> 0 req/s, got -5"),
    ("{name: v, model: tiny, rate: 0, slo_ms: 200}", "'rate'", "> 0 req/s, got 0"),
    ("{name: v, model: tiny, rate: lots, slo_ms: 200}", "'rate'", "a number, got 'lots'"),
    ("{name: v, model: tiny, rate: 5, slo_ms: 0}", "'slo_ms'", "SLO > 0 ms"),
    ("{name: v, model: tinyy, rate: 5, slo_ms: 200}", "'model'",
     "no profile for model 'tinyy'; the profiles have tiny"),
])
def test_bad_services_are_refused_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, field: str,
        what: str) -> None:
    prof = tmp_path / "p.csv"
    prof.write_text("model,gpu,slice_kind,slice_size,batch,procs,throughput_rps,latency_ms\n"
                    "tiny,A100-80GB,mig,1,1,1,100,5\n")
    svc = _services(tmp_path, f"- {line}\n")
    assert main(["plan", "--profiles", str(prof), "--services", str(svc)]) == 2
    err = capsys.readouterr().err
    assert f"row 1, field {field}" in err and what in err, err


def test_a_service_that_cannot_be_planned_exits_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "p.csv"
    prof.write_text("model,gpu,slice_kind,slice_size,batch,procs,throughput_rps,latency_ms\n"
                    "tiny,A100-80GB,mig,1,1,1,100,5\n")
    svc = _services(tmp_path, "- {name: ok, model: tiny, rate: 10, slo_ms: 200}\n"
                    "- {name: fast, model: tiny, rate: 10, slo_ms: 1}\n")
    assert main(["plan", "--profiles", str(prof), "--services", str(svc)]) == 1
    out = capsys.readouterr().out
    assert "not planned fast" in out and "0.45 x SLO" in out
    # the rest is planned, and -o json says the same
    assert main(["plan", "--profiles", str(prof), "--services", str(svc), "-o", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [p["service"] for p in doc["problems"]] == ["fast"]
    assert [s["name"] for s in doc["services"] if s["segments"]] == ["ok"]
