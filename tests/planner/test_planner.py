from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from gpuslice.adapters.profiles.files import read_own_profiles, read_scenario
from gpuslice.adapters.traces.alibaba import InputError
from gpuslice.cli import main
from gpuslice.core.catalog import resolve
from gpuslice.core.mig import is_valid_layout
from gpuslice.core.planner import (
    FleetType,
    PlanOptions,
    Service,
    best_configs,
    plan,
    validate,
)
from gpuslice.core.profiles import ProfilePoint, ProfileSet, batch_latency
from gpuslice.core.replay import plan_and_check, replay_plan
from gpuslice.planning.export import manifests, mig_parted

GPU = "A100-80GB"
HEADER = "model,gpu,slice_kind,slice_size,batch,procs,throughput_rps,latency_ms,latency_p99_ms\n"


def synthetic_profiles(models: dict[str, float]) -> ProfileSet:
    """A model of speed ``s``: per process, a batch of b on a slice of g compute slices with k
    processes takes (2 + b / s) * k / g ms."""
    pts = []
    for model, speed in models.items():
        for g in (1, 2, 3, 4, 7):
            for k in (1, 2, 3):
                for b in (1, 2, 4, 8, 16, 32):
                    lat = (2.0 + b / speed) * k / g / 1000.0
                    pts.append(ProfilePoint(model, GPU, "mig", g, b, k, b / lat, lat))
    return ProfileSet.of(pts)


PROF = synthetic_profiles({"fast": 4.0, "slow": 1.0, "tiny": 8.0})
ACC = resolve(GPU).mig
assert ACC is not None


def test_best_config_respects_the_latency_rule() -> None:
    svc = Service("s", "slow", 100, slo_ms=20)
    for size, cfg in best_configs(PROF, svc, GPU, 0.45).items():
        assert cfg.latency_s <= 0.45 * 0.020 + 1e-12
        assert cfg.size == size


def test_plan_is_valid_meets_rates_and_uses_legal_mig_layouts() -> None:
    svcs = [Service("a", "fast", 3000, 40), Service("b", "slow", 500, 60),
            Service("c", "tiny", 200, 30)]
    p = plan(PROF, svcs)
    assert validate(p, svcs) == []
    for g in p.gpus:
        assert is_valid_layout(ACC, [s.placement for s in g.slots])
    for s in svcs:
        assert p.capacity(s.name) >= s.rate
    assert p.lower_bound <= p.n_gpus + 1e-9


def test_mixing_two_small_services_saves_a_slice() -> None:
    svcs = [Service(f"s{i}", "tiny", 150, 40) for i in range(8)]
    mixed = plan(PROF, svcs, opts=PlanOptions(mix=True))
    alone = plan(PROF, svcs, opts=PlanOptions(mix=False))
    slices = lambda p: sum(s.placement.profile.compute_slices for g in p.gpus for s in g.slots  # noqa: E731
                           if s.parts)
    assert slices(mixed) < slices(alone)
    assert any(len(s.parts) == 2 for g in mixed.gpus for s in g.slots)
    for g in mixed.gpus:
        for s in g.slots:
            for c in s.parts:
                assert c.thread_pct == 100 // c.colocated
    assert validate(mixed, svcs) == []


def test_heuristic_is_valid_and_not_better_than_the_bound() -> None:
    svcs = [Service(f"s{i}", m, r, 50) for i, (m, r) in
            enumerate([("fast", 5000), ("slow", 900), ("tiny", 300), ("fast", 1200)])]
    greedy = plan(PROF, svcs, opts=PlanOptions(solver="greedy"))
    exact = plan(PROF, svcs, opts=PlanOptions(solver="milp", mix=False))
    assert validate(greedy, svcs) == [] and validate(exact, svcs) == []
    assert greedy.solver == "greedy" and exact.solver == "milp"
    assert greedy.lower_bound <= exact.n_gpus <= greedy.n_gpus


def test_bad_services_are_reported_and_the_rest_is_planned() -> None:
    svcs = [Service("ok", "fast", 500, 40), Service("nomodel", "bert", 10, 100),
            Service("tooquick", "slow", 10, 0.5), Service("neg", "fast", -5, 40)]
    p = plan(PROF, svcs)
    reasons = {pr.service: pr.reason for pr in p.problems}
    assert "no profile for model 'bert'" in reasons["nomodel"]
    assert "no configuration meets" in reasons["tooquick"]
    assert "rate must be" in reasons["neg"]
    assert p.capacity("ok") >= 500


def test_cost_objective_picks_the_cheaper_gpu_type() -> None:
    pts = [ProfilePoint(pt.model, "H100-SXM", pt.slice_kind, pt.slice_size, pt.batch, pt.procs,
                        pt.throughput * 2, pt.latency_s / 2) for pt in PROF.points]
    both = ProfileSet.of([*PROF.points, *pts])
    svcs = [Service("a", "fast", 40000, 40)]
    cheap_h100 = plan(both, svcs, [FleetType(GPU, cost_per_hour=3.0),
                                   FleetType("H100-SXM", cost_per_hour=4.0)],
                      PlanOptions(objective="cost"))
    assert {g.gpu for g in cheap_h100.gpus} == {"H100-SXM"}
    dear_h100 = plan(both, svcs, [FleetType(GPU, cost_per_hour=1.0),
                                  FleetType("H100-SXM", cost_per_hour=5.0)],
                     PlanOptions(objective="cost"))
    assert {g.gpu for g in dear_h100.gpus} == {GPU}


def test_fleet_limit_is_reported_when_too_small() -> None:
    svcs = [Service("a", "slow", 20000, 60)]
    p = plan(PROF, svcs, [FleetType(GPU, count=1)], PlanOptions(solver="greedy"))
    assert any("fleet has 1" in pr.reason for pr in p.problems)


def test_batch_latency_uses_the_next_measured_batch_and_never_extrapolates() -> None:
    fam = [pt for pt in PROF.points if pt.model == "fast" and pt.slice_size == 1 and pt.procs == 1]
    assert batch_latency(fam, 3) == batch_latency(fam, 4)
    with pytest.raises(ValueError, match="largest measured batch"):
        batch_latency(fam, 64)


def test_replay_meets_slo_with_headroom_and_misses_when_overloaded() -> None:
    svcs = [Service("a", "fast", 2000, 40)]
    checked = plan_and_check(PROF, svcs, rng=np.random.default_rng(0), requests=20_000)
    assert not checked.violations
    load = 1.3 * checked.plan.capacity("a") / 2000
    over = replay_plan(PROF, checked.plan, svcs, np.random.default_rng(1), 20_000, load=load)
    assert over[0].p99_ms > 40


def test_exports() -> None:
    svcs = [Service("a", "fast", 3000, 40), Service("b", "tiny", 100, 40)]
    p = plan(PROF, svcs)
    mp = mig_parted(p)
    assert mp["version"] == "v1"
    first = next(iter(mp["mig-configs"].values()))[0]
    assert first["mig-enabled"] is True and sum(first["mig-devices"].values()) >= 1
    docs = manifests(p)
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert deployments
    limits = deployments[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["gpuslice.io/gpu"] == "1" and 1 <= int(limits["gpuslice.io/gpu-milli"]) <= 1000
    weights = json.loads(docs[-1]["data"]["weights.json"])
    assert set(weights) == {"a", "b"}
    # they run unedited (issue 51): the gpuslice scheduler, the GPU model as the label the
    # router's Istio subsets select, the processes, and a Service per service to route to
    for d in deployments:
        tpl = d["spec"]["template"]
        assert tpl["spec"]["schedulerName"] == "gpuslice-scheduler"
        assert tpl["metadata"]["labels"]["gpuslice.io/gpu-model"] == \
            tpl["metadata"]["annotations"]["gpuslice.io/gpu-model"]
        assert int(tpl["metadata"]["annotations"]["gpuslice.io/processes"]) >= 1
        assert tpl["spec"]["containers"][0]["ports"] == [{"name": "http",
                                                          "containerPort": 8000}]
    services = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Service"}
    assert set(services) == {"a", "b"}
    assert services["a"]["selector"] == {"gpuslice.io/service": "a"}
    assert services["a"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http"}]
    named = manifests(p, "ml", "vllm/vllm-openai:v0.6", 9000)
    dep = next(d for d in named if d["kind"] == "Deployment")
    assert dep["metadata"]["namespace"] == "ml"
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "vllm/vllm-openai:v0.6" and c["ports"][0]["containerPort"] == 9000


def test_own_profile_format_and_errors(tmp_path: Path) -> None:
    good = tmp_path / "p.csv"
    good.write_text(HEADER + "m,A100-80GB,mig,1,8,1,400,20,25\nm,A100-80GB,mig,7,32,2,900,35,\n")
    ps = read_own_profiles(good)
    assert len(ps.points) == 2 and ps.points[0].latency_p99_s == pytest.approx(0.025)
    bad = tmp_path / "bad.csv"
    bad.write_text(HEADER + "m,A100-80GB,gpu,1,8,1,400,20,\n")
    with pytest.raises(InputError, match="row 2, field 'slice_kind'"):
        read_own_profiles(bad)
    neg = tmp_path / "neg.csv"
    neg.write_text(HEADER + "m,A100-80GB,mig,1,0,1,400,20,\n")
    with pytest.raises(InputError, match="row 2"):
        read_own_profiles(neg)


def test_scenario_files_with_na(tmp_path: Path) -> None:
    rate = tmp_path / "r.csv"
    lat = tmp_path / "l.csv"
    rate.write_text("19,353,N/A,N/A,460,677,N/A,N/A,829,N/A,354\n")
    lat.write_text("6434,183,N/A,N/A,418.5,167,N/A,N/A,204.5,N/A,396.5\n")
    specs = read_scenario(rate, lat, 1)
    assert [s.model for s in specs] == ["bert", "densenet121", "inceptionv3", "mobilenetv2",
                                        "resnet50", "vgg19"]
    with pytest.raises(InputError, match="scenario"):
        read_scenario(rate, lat, 2)


def test_cli_plan_with_own_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "p.csv"
    rows = [f"{pt.model},{pt.gpu},mig,{pt.slice_size},{pt.batch},{pt.procs},{pt.throughput},"
            f"{pt.latency_s * 1000},\n" for pt in PROF.points]
    prof.write_text(HEADER + "".join(rows))
    services = tmp_path / "s.yaml"
    services.write_text(yaml.safe_dump([
        {"name": "a", "model": "fast", "rate": 1500, "slo_ms": 40},
        {"name": "b", "model": "fast", "rate": 5, "slo_ms": 0.5},  # no configuration that fast
    ]))
    out = tmp_path / "plan.json"
    code = main(["plan", "--profiles", str(prof), "--services", str(services), "--write-json",
                 str(out), "--out", str(tmp_path / "exp")])
    assert code == 1  # a service could not be planned; the rest is, and the files are written
    doc = json.loads(out.read_text())
    assert doc["gpus"] >= 1 and doc["valid"]
    svc = {s["name"]: s for s in doc["services"]}
    assert svc["a"]["segments"] and svc["a"]["replayed_p99_ms"] <= 40
    assert doc["problems"][0]["service"] == "b"
    assert (tmp_path / "exp" / "mig-parted.yaml").is_file()
    assert "not planned" in capsys.readouterr().out


def test_cli_plan_needs_a_scenario_or_services(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "p.csv"
    prof.write_text(HEADER + "m,A100-80GB,mig,1,8,1,400,20,\n")
    assert main(["plan", "--profiles", str(prof)]) == 2
    assert "--scenario" in capsys.readouterr().err


def test_exported_slices_of_one_gpu_never_ask_for_more_than_the_gpu() -> None:
    from gpuslice.core import catalog
    from gpuslice.core.mig import parse_layout
    from gpuslice.core.planner import Config, Plan, PlannedGpu, Slot
    from gpuslice.planning.export import manifests

    geo = catalog.lookup("A100-80GB").mig  # type: ignore[union-attr]
    layout = parse_layout(geo, ",".join(f"1g.10gb@{i}" for i in range(7)))
    slots = tuple(Slot(pl, (Config("s", "m", "A100-80GB", 1, "1g.10gb", 1, 1, 10.0, 0.01, 1),))
                  for pl in layout)
    plan_ = Plan((PlannedGpu(0, "A100-80GB", slots),), "gpus", 1.0, 1.0, "test")
    docs = [d for d in manifests(plan_) if d["kind"] == "Deployment"]
    milli = [int(d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
                 ["gpuslice.io/gpu-milli"]) for d in docs]
    assert len(milli) == 7 and sum(milli) <= 1000
