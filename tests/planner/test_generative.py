"""Generative services on slices (issue 52, point 5; ``core/generative.py``): vLLM's memory
fraction on a slice, and a service's TTFT and TPOT SLOs turned into a replica's request
capacity on a profile of token speeds, which the planner then sizes and places."""

from __future__ import annotations

import math

import pytest

from gpuslice.core.errors import ValidationError
from gpuslice.core.generative import (
    GenerativePoint,
    GenerativeService,
    capacities,
    planner_inputs,
    predict,
    replica_capacity,
    vllm_memory_fraction,
)
from gpuslice.core.planner import FleetType, PlanOptions, plan, validate
from gpuslice.core.profiles import ProfileSet

M = "llm"


def point(size: int = 1, prefill: float = 4000, decode: float = 400, seqs: int = 16
          ) -> GenerativePoint:
    return GenerativePoint(M, "A100-80GB", "mig", size, prefill, decode, seqs)


def service(rate: float = 8, ttft: float = 3000, tpot: float = 100, prompt: float = 1000,
            output: float = 200, name: str = "chat") -> GenerativeService:
    return GenerativeService(name, M, rate, ttft, tpot, prompt, output)


# ---- vLLM's memory fraction -------------------------------------------------------------


@pytest.mark.parametrize(("slice_mib", "gpu_mib", "want"), [
    (12288, 24576, 0.45),  # half an L4: deploy/examples/vllm.yaml
    (6144, 24576, 0.2),  # a quarter: deploy/examples/triton-openai.yaml
    (40960, 81920, 0.48),  # half an A100-80GB
    (24576, 24576, 0.95),  # the whole GPU, less the reserve
])
def test_the_fraction_is_the_slices_share_less_the_reserve_rounded_down(
        slice_mib: int, gpu_mib: int, want: float) -> None:
    got = vllm_memory_fraction(slice_mib, gpu_mib)
    assert got == want
    # never past the cap, never more than a hundredth under the exact share
    assert got * gpu_mib <= slice_mib - 1024
    assert got > (slice_mib - 1024) / gpu_mib - 0.01


@pytest.mark.parametrize(("args", "field"), [
    ((30000, 24576), "slice_mib"),  # more than the GPU
    ((1024, 24576), "slice_mib"),  # nothing left after the reserve
    ((12288, 0), "gpu_mib"),
    ((12288, 24576, -1), "reserve_mib"),
    ((12288.5, 24576), "slice_mib"),
])
def test_a_bad_fraction_input_names_its_field(args: tuple[float, ...], field: str) -> None:
    with pytest.raises(ValidationError) as exc:
        vllm_memory_fraction(*args)  # type: ignore[arg-type]
    assert exc.value.field == field


# ---- a replica's capacity ----------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("prompt_tokens", -5), ("output_tokens", 0), ("rate", -1), ("slo_ttft_ms", math.nan),
    ("slo_tpot_ms", 0),
])
def test_bad_service_values_name_the_field(field: str, value: float) -> None:
    args = {"rate": 8, "ttft": 3000, "tpot": 100, "prompt": 1000, "output": 200}
    key = {"prompt_tokens": "prompt", "output_tokens": "output", "rate": "rate",
           "slo_ttft_ms": "ttft", "slo_tpot_ms": "tpot"}[field]
    args[key] = value
    with pytest.raises(ValidationError) as exc:
        service(**args)
    assert exc.value.field == f"service 'chat': {field}"


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"decode": -1.0}, "decode_tokens_per_s"), ({"prefill": 0.0}, "prefill_tokens_per_s"),
    ({"seqs": 0}, "max_seqs"),
])
def test_bad_profile_values_name_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValidationError) as exc:
        point(**kwargs)  # type: ignore[arg-type]
    assert exc.value.field.endswith(f": {field}")


@pytest.mark.parametrize("svc", [service(), service(tpot=50), service(ttft=700),
                                 service(prompt=3000, ttft=2500), service(output=20)],
                         ids=["max-seqs", "tpot", "ttft", "long-prompt", "short-output"])
def test_at_its_capacity_a_replica_holds_both_slos_and_just_past_it_one_breaks(
        svc: GenerativeService) -> None:
    p = point()
    cap = replica_capacity(svc, p)
    assert cap.rate_rps > 0
    ttft, tpot = predict(svc, p, cap.rate_rps)
    assert (ttft, tpot) == (cap.ttft_p99_ms, cap.tpot_ms)
    assert ttft <= svc.slo_ttft_ms + 1e-6 and tpot <= svc.slo_tpot_ms + 1e-6
    # Little's law: the sequences in flight fit max_seqs
    in_flight = cap.rate_rps * svc.output_tokens * tpot / 1000
    assert in_flight <= p.max_seqs + 1e-6
    more = cap.rate_rps * 1.01
    ttft2, tpot2 = predict(svc, p, more)
    broken = {"slo_ttft_ms": ttft2 > svc.slo_ttft_ms, "slo_tpot_ms": tpot2 > svc.slo_tpot_ms,
              "max_seqs": more * svc.output_tokens * tpot2 / 1000 > p.max_seqs}
    assert broken[cap.bound], (cap, broken)


def test_the_numbers_of_a_tpot_bound_replica() -> None:
    # prefill of 1000 tokens: 0.25 s; a full step: 16 / 400 = 40 ms; TPOT 40 / (1 - rho)
    # <= 50 ms gives rho <= 0.2, 0.8 req/s (max_seqs would allow 1 / (0.5 + 0.25) = 1.33)
    cap = replica_capacity(service(tpot=50), point())
    assert cap.bound == "slo_tpot_ms" and cap.rate_rps == pytest.approx(0.8)
    loose = replica_capacity(service(tpot=100), point())
    assert loose.bound == "max_seqs" and loose.rate_rps == pytest.approx(4 / 3)


def test_a_looser_slo_needs_fewer_replicas_than_a_tighter_one() -> None:
    fleet = [FleetType("A100-80GB")]
    replicas = {}
    for tpot in (50, 100):  # 0.8 and 1.33 req/s per 1g replica (the test above)
        svcs, prof = planner_inputs([service(rate=4, tpot=tpot)], [point()])
        p = plan(ProfileSet.of(prof), svcs, fleet, PlanOptions(solver="milp"))
        assert validate(p, svcs) == [] and p.capacity("chat") >= 4
        replicas[tpot] = len(p.segments("chat"))
    assert replicas[100] < replicas[50], replicas


@pytest.mark.parametrize(("svc", "field", "words"), [
    (service(tpot=30), "slo_tpot_ms", "takes 40.0 ms per output token with its 16 sequences"),
    (service(ttft=400), "slo_ttft_ms", "takes at least 290.0 ms (prefill 250.0 ms"),
])
def test_an_slo_no_slice_can_hold_is_refused_naming_it(
        svc: GenerativeService, field: str, words: str) -> None:
    with pytest.raises(ValidationError) as exc:
        capacities(svc, [point()])
    assert exc.value.field == f"service 'chat': {field}"
    assert words in str(exc.value), str(exc.value)


def test_a_service_of_an_unprofiled_model_is_refused_naming_the_model() -> None:
    svc = GenerativeService("x", "other", 1, 1000, 100, 100, 100)
    with pytest.raises(ValidationError) as exc:
        capacities(svc, [point()])
    assert exc.value.field == "service 'x': model" and "llm" in exc.value.expected


def test_a_slice_that_cannot_hold_is_left_out_the_others_planned() -> None:
    # the 1g's step (40 ms) misses a 35 ms TPOT, the 2g's (20 ms) holds it
    svc = service(tpot=35)
    (cap,) = capacities(svc, [point(1), point(2, prefill=8000, decode=800)])
    assert cap.point.slice_size == 2
    svcs, prof = planner_inputs([svc], [point(1), point(2, prefill=8000, decode=800)])
    assert [(s.name, s.model, s.rate, s.slo_ms) for s in svcs] == [("chat", "llm@chat", 8,
                                                                   3000)]
    (pt,) = prof
    # the planner's latency rule and replay see the prefill of a mean prompt
    assert (pt.model, pt.slice_size, pt.batch, pt.procs) == ("llm@chat", 2, 1, 1)
    assert pt.latency_s == pytest.approx(1000 / 8000) and pt.throughput == cap.rate_rps


def test_a_row_from_measured_levels_reproduces_the_measured_tpot() -> None:
    from gpuslice.core.generative import LevelMeasure, point_from_levels

    levels = [LevelMeasure(1, 20, 500, ttft_p50_ms=60, ttft_p99_ms=70, tpot_ms=10,
                           tpot_p99_ms=11, output_tokens_per_s=90),
              LevelMeasure(16, 200, 500, 400, 900, tpot_ms=20, tpot_p99_ms=30,
                           output_tokens_per_s=610)]
    p = point_from_levels("m", "L4", "mps", 50, levels)
    # prefill: 500 tokens in 60 - 10 ms; decode: 610/s x 20 ms = 12.2 -> 12 sequences, whose
    # step is the 20 ms measured
    assert (p.prefill_tokens_per_s, p.max_seqs, p.decode_tokens_per_s) == (10000, 12, 600)
    assert p.step_s == pytest.approx(0.020)
    with pytest.raises(ValidationError) as exc:
        point_from_levels("m", "L4", "mps", 50, [LevelMeasure(1, 0, 0, 0, 0, 0, 0, 0)])
    assert exc.value.field == "measurements"
