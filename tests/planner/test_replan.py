"""Re-planning from new request rates: the smallest set of slice changes, checked by replay."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import yaml

from gpuslice.core.planner import FleetType, Plan, PlanOptions, Service
from gpuslice.core.replay import plan_and_check, plan_diff, replan
from gpuslice.core.speedmodel import profiles

PROFILES = profiles(["A100-80GB"], ["resnet50", "bert-base", "mobilenet-v3"])
SERVICES = [Service("resnet50", "resnet50", 900, 100), Service("bert", "bert-base", 250, 200),
            Service("mobilenet", "mobilenet-v3", 700, 50)]
FLEET = [FleetType("A100-80GB")]


def scaled(f: float) -> list[Service]:
    return [Service(s.name, s.model, s.rate * f, s.slo_ms) for s in SERVICES]


def base() -> Plan:
    return plan_and_check(PROFILES, SERVICES, FLEET, PlanOptions(),
                          rng=np.random.default_rng(1)).plan


def test_less_load_removes_slices_and_frees_gpus() -> None:
    cur = base()
    r = replan(PROFILES, cur, scaled(0.4), rng=np.random.default_rng(2), fleet=FLEET)
    removed = [c for c in r.changes if c.action == "remove"]
    added = [c for c in r.changes if c.action == "add"]
    assert len(removed) > len(added)  # mostly removals; adds fill freed positions
    assert r.added_gpus == 0 and r.freed_gpus
    assert {c.gpu for c in added} <= {g.index for g in cur.gpus}
    assert r.plan.n_gpus == cur.n_gpus - len(r.freed_gpus)
    assert all(x.ok for x in r.replay)
    for s in scaled(0.4):
        assert r.plan.capacity(s.name) >= s.rate
    full = plan_and_check(PROFILES, scaled(0.4), FLEET, PlanOptions(),
                          rng=np.random.default_rng(3)).plan
    assert len(r.changes) < len(plan_diff(cur, full))  # far fewer moves than starting over


def test_more_load_adds_slices_and_moves_none_that_stay() -> None:
    cur = base()
    r = replan(PROFILES, cur, scaled(1.6), rng=np.random.default_rng(2), fleet=FLEET)
    assert r.changes and all(c.action == "add" for c in r.changes)
    assert all(x.ok for x in r.replay)
    assert r.plan.n_gpus >= cur.n_gpus
    gpus = [g.index for g in r.plan.gpus]
    assert len(gpus) == len(set(gpus))  # new GPUs get fresh indices


def test_same_load_changes_nothing() -> None:
    cur = base()
    r = replan(PROFILES, cur, SERVICES, rng=np.random.default_rng(2), fleet=FLEET)
    assert r.changes == () and r.freed_gpus == ()


def test_a_json_plan_reads_back_as_the_same_plan(tmp_path: Path) -> None:
    from gpuslice.planning.run import plan_from_json, run_plan, to_json

    run = run_plan(PROFILES, SERVICES, FLEET, PlanOptions(), check=False)
    again = plan_from_json(json.loads(json.dumps(to_json(run))))
    assert plan_diff(run.plan, again) == []
    assert [g.index for g in again.gpus] == [g.index for g in run.plan.gpus]


def test_cli_replan_from_a_plan_file(shared_data: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from gpuslice.cli import main

    prof = shared_data / "profiles" / "parvagpu-a100-80gb"
    assert main(["plan", "--profiles", str(prof), "--scenario", "3", "--write-json",
                 str(tmp_path / "plan.json")]) == 0
    doc = json.loads((tmp_path / "plan.json").read_text())
    services = [{"name": s["name"], "model": s["model"], "rate": s["rate_rps"] * 0.6,
                 "slo_ms": s["slo_ms"]} for s in doc["services"]]
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"services": services}))
    capsys.readouterr()
    code = main(["replan", "--current", str(tmp_path / "plan.json"), "--profiles", str(prof),
                 "--services", str(tmp_path / "s.yaml"), "--write-json",
                 str(tmp_path / "new.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "re-plan:" in out and "a full re-plan would use" in out
    new = json.loads((tmp_path / "new.json").read_text())
    assert new["gpus"] <= doc["gpus"] and new["valid"]
    assert main(["replan", "--profiles", str(prof)]) == 2  # --current (or --example) required


def test_offered_rates_are_read_from_the_routers_counters() -> None:
    from gpuslice.adapters.http.metrics import request_rates
    from tests.router.harness import backend, config, router, url

    with backend("a") as (pa, _):
        async def go() -> dict[str, float]:
            async with router(config([{"name": "a", "url": url(pa)}])) as (app, s):
                async def traffic() -> None:
                    for _ in range(60):
                        async with s.post(url(app.port) + "/v2/models/m/infer", json={}) as r:
                            await r.read()
                        await asyncio.sleep(0.01)

                t = asyncio.ensure_future(traffic())
                rates = await request_rates(url(app.admin_port), 0.5, by="service",
                                            ok_only=False)
                await t
                return rates

        rates = asyncio.run(go())
    assert rates["m"] > 10
