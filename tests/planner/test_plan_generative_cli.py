"""``gpuslice plan`` with generative services (issue 52, point 5): a services file that gives
TTFT and TPOT SLOs and token lengths, a generative profile (``--gen-profiles``) of token speeds
per slice; SLOs no slice holds and bad values refused naming the row and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuslice.adapters.traces.alibaba import InputError
from gpuslice.cli import main
from gpuslice.planning.run import read_services

GEN = ("model,gpu,slice_kind,slice_size,prefill_tokens_per_s,decode_tokens_per_s,max_seqs\n"
       "llm,A100-80GB,mig,1,4000,400,16\n"
       "llm,A100-80GB,mig,2,8000,800,16\n")
CHAT = "{name: chat, model: llm, rate: 4, slo_ttft_ms: 3000, slo_tpot_ms: 50, " \
    "prompt_tokens: 1000, output_tokens: 200}"


def _files(tmp_path: Path, services: str, profiles: str = GEN) -> tuple[Path, Path]:
    prof, svc = tmp_path / "gen.csv", tmp_path / "services.yaml"
    prof.write_text(profiles)
    svc.write_text(services)
    return prof, svc


def test_a_generative_service_is_planned_from_its_token_speeds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof, svc = _files(tmp_path, f"services:\n  - {CHAT}\n")
    rc = main(["plan", "--gen-profiles", str(prof), "--services", str(svc), "-o", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["valid"] and doc["gpus"] == 1, doc["problems"]
    (s,) = doc["services"]
    # its own copy of the model's profile; its slo_ms is the TTFT SLO; every slice a replica
    assert (s["name"], s["model"], s["slo_ms"]) == ("chat", "llm@chat", 3000)
    assert s["capacity_rps"] >= 4 and s["slo_met"]
    assert {(seg["batch"], seg["procs"]) for seg in s["segments"]} == {(1, 1)}
    # what the router needs: the API, the model clients name, the SLOs, each replica's speeds
    assert (s["api"], s["models"], s["slo_ttft_ms"], s["slo_tpot_ms"],
            s["mean_output_tokens"]) == ("openai", ["llm"], 3000, 50, 200)
    speeds = {seg["profile"]: (seg["prefill_tokens_per_s"], seg["decode_tokens_per_s"],
                               seg["max_num_seqs"]) for seg in s["segments"]}
    assert set(speeds.values()) <= {(4000, 25.0, 16), (8000, 50.0, 16)}, speeds
    from gpuslice.core.routing_config import parse_router_config

    (spec,) = parse_router_config(doc, need_urls=False).services
    assert (spec.api, spec.models, spec.slo_ttft_s) == ("openai", ("llm",), 3.0)
    assert {r.prefill_tps for r in spec.replicas} <= {4000, 8000}


def test_generative_and_batch_services_plan_together(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof, svc = _files(tmp_path, f"- {CHAT}\n- {{name: v, model: tiny, rate: 50, slo_ms: 200}}\n")
    batch = tmp_path / "p.csv"
    batch.write_text("model,gpu,slice_kind,slice_size,batch,procs,throughput_rps,latency_ms\n"
                     "tiny,A100-80GB,mig,1,1,1,100,5\n")
    rc = main(["plan", "--profiles", str(batch), "--gen-profiles", str(prof), "--services",
               str(svc), "-o", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and [s["name"] for s in doc["services"]] == ["chat", "v"]
    assert all(s["capacity_rps"] >= s["rate_rps"] for s in doc["services"])


def test_the_shipped_generative_example_plans(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--gen-profiles", "builtin:llm-a100-80gb", "--services",
               "builtin:generative", "-o", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["valid"] and not doc["slo_violations"]
    assert {s["name"] for s in doc["services"]} == {"chat", "summarize"}


@pytest.mark.parametrize(("line", "field", "what"), [
    (CHAT.replace("slo_tpot_ms: 50", "slo_tpot_ms: 15"), "'slo_tpot_ms'",
     "the fastest, A100-80GB mig 2, takes 20.0 ms per output token"),
    (CHAT.replace("slo_ttft_ms: 3000", "slo_ttft_ms: 200"), "'slo_ttft_ms'",
     "takes at least 145.0 ms (prefill 125.0 ms"),
    (CHAT.replace("prompt_tokens: 1000", "prompt_tokens: -3"), "'prompt_tokens'",
     "expected a finite number > 0, got -3"),
    (CHAT.replace(", output_tokens: 200", ""), "'output_tokens'", "missing"),
    (CHAT.replace("rate: 4", "rate: 4, slo_ms: 100"), "'slo_ms'", "not both"),
    (CHAT.replace("model: llm", "model: gpt"), "'model'",
     "no generative profile for model 'gpt'; the profiles have llm"),
])
def test_bad_generative_services_are_refused_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, field: str,
        what: str) -> None:
    prof, svc = _files(tmp_path, f"- {line}\n")
    assert main(["plan", "--gen-profiles", str(prof), "--services", str(svc)]) == 2
    err = capsys.readouterr().err
    assert f"row 1, field {field}" in err and what in err, err


@pytest.mark.parametrize(("row", "field"), [
    ("llm,A100-80GB,mig,1,4000,-400,16", "'decode_tokens_per_s'"),
    ("llm,A100-80GB,mig,1,4000,400,0", "'max_seqs'"),
    ("llm,A100-80GB,mig,2,4000,400,16", "'slice_size'"),  # the 2g twice
    ("llm,T9000,mig,1,4000,400,16", "'gpu'"),
])
def test_bad_generative_profile_rows_are_refused_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], row: str, field: str) -> None:
    prof, svc = _files(tmp_path, f"- {CHAT}\n", GEN + row + "\n")
    assert main(["plan", "--gen-profiles", str(prof), "--services", str(svc)]) == 2
    err = capsys.readouterr().err
    assert f"gen.csv, row 4, field {field}" in err, err


def test_a_command_that_plans_batch_services_only_refuses_a_generative_one(
        tmp_path: Path) -> None:
    _, svc = _files(tmp_path, f"- {CHAT}\n")
    with pytest.raises(InputError, match="row 1, field 'slo_ms': missing: a generative service"):
        read_services(svc)
