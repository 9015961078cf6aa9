"""Unit tier: the pure routing core (policies, service-time model, admission, weights)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest

from gpuslice.core.errors import ValidationError
from gpuslice.core.routing import (
    N_BUCKETS,
    LeastOutstanding,
    PowerOfTwo,
    ReplicaView,
    RoundRobin,
    ServiceModel,
    ShortestExpectedDelay,
    WeightedRoundRobin,
    admit,
    completed,
    dispatched,
    integer_weights,
    make_routing_policy,
    predicted_delay,
    routing_policy_names,
    scaled_weights,
    size_bucket,
)
from gpuslice.core.routing_config import is_idempotent, parse_router_config


def R(name: str, *, w: float = 1.0, c: int = 1, out: int = 0, work: float = 0.0,
      healthy: bool = True, service: float | None = None, samples: int = 0) -> ReplicaView:
    """Builder: a replica view with a learned service time ``service`` (seconds, size 1)."""
    model = ServiceModel()
    if service is not None:
        model = ServiceModel(prior_s=service)
        for _ in range(max(1, samples)):
            model = model.observe(1, service)
    return ReplicaView(name, w, c, healthy, out, work, model)


def run(policy, replicas, n, size=1, us=None):  # type: ignore[no-untyped-def]
    """Choose ``n`` times without changing load; returns the chosen names in order."""
    names = []
    for k in range(n):
        u = us[k % len(us)] if us else (k * 0.6180339887) % 1.0
        ch = policy.choose(replicas, size, u)
        policy = ch.policy
        names.append(None if ch.index is None else replicas[ch.index].name)
    return names


# name, policy, replicas, draws, expected sequence of picks
SEQUENCES = [
    ("round-robin cycles in order", RoundRobin(), [R("a"), R("b"), R("c")], 5,
     ["a", "b", "c", "a", "b"]),
    ("round-robin skips unhealthy", RoundRobin(), [R("a"), R("b", healthy=False), R("c")], 4,
     ["a", "c", "a", "c"]),
    ("weighted round-robin 3:1 interleaves", WeightedRoundRobin(),
     [R("fast", w=3), R("slow", w=1)], 8,
     ["fast", "fast", "slow", "fast", "fast", "fast", "slow", "fast"]),
    ("weighted round-robin ignores unhealthy", WeightedRoundRobin(),
     [R("fast", w=3, healthy=False), R("slow", w=1)], 3, ["slow", "slow", "slow"]),
    ("least-outstanding takes the idle one", LeastOutstanding(),
     [R("a", out=2), R("b", out=0), R("c", out=1)], 3, ["b", "b", "b"]),
    ("least-outstanding counts per unit of weight", LeastOutstanding(),
     [R("a", out=2, w=4), R("b", out=1)], 2, ["a", "a"]),
    ("sed prefers the fast replica while its queue is short", ShortestExpectedDelay(),
     [R("fast", service=0.01, out=1, work=0.01), R("slow", service=0.03)], 2,
     ["fast", "fast"]),
    ("sed spills to the slow replica when the fast queue is long", ShortestExpectedDelay(),
     [R("fast", service=0.01, out=4, work=0.04), R("slow", service=0.03)], 2,
     ["slow", "slow"]),
    ("sed uses all slots of a concurrent replica", ShortestExpectedDelay(),
     [R("wide", service=0.02, c=4, out=3, work=0.06), R("narrow", service=0.01, out=1,
                                                        work=0.01)], 1, ["wide"]),
    ("no healthy replica gives no choice", ShortestExpectedDelay(),
     [R("a", healthy=False)], 1, [None]),
]


@pytest.mark.parametrize(("name", "policy", "replicas", "n", "expected"), SEQUENCES,
                         ids=[c[0] for c in SEQUENCES])
def test_policy_sequences(name, policy, replicas, n, expected):  # type: ignore[no-untyped-def]
    assert run(policy, replicas, n) == expected


def test_weighted_round_robin_proportions() -> None:
    reps = [R("a", w=5), R("b", w=3), R("c", w=2)]
    counts = Counter(run(WeightedRoundRobin(), reps, 1000))
    assert counts == {"a": 500, "b": 300, "c": 200}


def test_p2c_draws_two_distinct_and_prefers_fewer_in_flight() -> None:
    reps = [R("a", out=5), R("b", out=0), R("c", out=5), R("d", out=5)]
    us = [(k + 0.5) / 400 for k in range(400)]
    picks = Counter(run(PowerOfTwo(), reps, 400, us=us))
    # b is in half of all pairs (first draw 1/4, second 3/4 x 1/3) and wins each of them
    assert abs(picks["b"] - 200) <= 2
    assert set(picks) == {"a", "b", "c", "d"}


@pytest.mark.parametrize("u", [0.0, 0.1, 0.49, 0.5, 0.75, 0.999999])
def test_p2c_never_picks_the_same_replica_twice(u: float) -> None:
    reps = [R("a", out=1), R("b", out=1)]
    ch = PowerOfTwo().choose(reps, 1, u)
    assert ch.index in (0, 1)
    assert "a and b" in ch.reason or "b and a" in ch.reason


def test_p2c_weights_scale_outstanding() -> None:
    reps = [R("big", w=4, out=2), R("small", w=1, out=0)]
    assert run(PowerOfTwo(), reps, 4) == ["big"] * 4


@pytest.mark.parametrize(("size", "bucket"), [(0, 0), (1, 0), (2, 1), (3, 2), (4, 2), (5, 3),
                                              (8, 3), (9, 4), (1 << 30, N_BUCKETS - 1)])
def test_size_buckets(size: int, bucket: int) -> None:
    assert size_bucket(size) == bucket


def test_service_model_learns_by_size_and_scales_unseen_sizes() -> None:
    m = ServiceModel(prior_s=0.5)
    assert m.predict(4) == pytest.approx(2.0)
    for _ in range(50):
        m = m.observe(1, 0.010).observe(8, 0.040)
    assert m.predict(1) == pytest.approx(0.010)
    assert m.predict(8) == pytest.approx(0.040)
    assert m.predict(16) == pytest.approx(0.080)  # nearest bucket (8) scaled by size
    assert m.samples == 100
    assert m.observe(1, math.nan) is m


def test_ewma_moves_towards_new_times() -> None:
    m = ServiceModel(alpha=0.5).observe(1, 0.010).observe(1, 0.030)
    assert m.predict(1) == pytest.approx(0.020)


def test_predicted_delay_counts_queued_work_over_slots() -> None:
    assert predicted_delay(R("a", service=0.01), 1) == pytest.approx(0.01)
    assert predicted_delay(R("a", service=0.01, out=1, work=0.01)) == pytest.approx(0.02)
    assert predicted_delay(R("a", service=0.01, c=2, out=1, work=0.01)) == pytest.approx(0.01)
    assert predicted_delay(R("a", service=0.01, c=2, out=3, work=0.03)) == pytest.approx(0.02)


def test_dispatch_then_complete_learns_service_time_from_queueing() -> None:
    v = R("a", service=0.01)
    v, t1 = dispatched(v, 1)
    v, t2 = dispatched(v, 1)
    assert (v.outstanding, v.work_s) == (2, pytest.approx(0.02))
    assert t2.delay_s == pytest.approx(0.02)
    v = completed(v, t1, 0.02)  # twice as slow as believed
    assert v.model.predict(1) > 0.01
    v = completed(v, t2, None)  # failed: no learning, load released
    assert (v.outstanding, v.work_s) == (0, 0.0)


@pytest.mark.parametrize(("replicas", "slo", "admitted", "retry"), [
    ([R("a", service=0.05, samples=30)], 0.1, True, 0),
    ([R("a", service=0.05, samples=30, out=3, work=0.15)], 0.1, False, 1),
    ([R("a", service=2.0, samples=30, out=1, work=2.0)], 0.5, False, 4),
    ([R("a", service=0.05, samples=3, out=9, work=0.45)], 0.1, True, 0),  # still learning
    ([R("a", service=0.5, samples=30), R("b", service=0.01, samples=30)], 0.1, True, 0),
    ([R("a", service=0.5, samples=30)], None, True, 0),
    ([R("a", healthy=False)], 0.1, False, 1),
])
def test_admission(replicas, slo, admitted, retry):  # type: ignore[no-untyped-def]
    adm = admit(replicas, 1, slo, min_samples=20)
    assert (adm.admitted, adm.retry_after_s) == (admitted, retry)
    if not admitted and adm.predicted_s is not None:
        assert "exceeds the SLO" in adm.reason


def test_an_idle_replica_gets_a_probe_once_nothing_was_admitted_for_a_while() -> None:
    """Without probes a service time learned over the SLO would shut the service out for
    good: rejected requests teach the router nothing."""
    slow = [R("a", service=0.5, samples=30)]
    assert not admit(slow, 1, 0.1, since_admitted_s=0.2).admitted
    probe = admit(slow, 1, 0.1, since_admitted_s=1.0)
    assert probe.admitted and probe.reason.startswith("probe")
    busy = [R("a", service=0.5, samples=30, out=1, work=0.5)]
    assert not admit(busy, 1, 0.1, since_admitted_s=5.0).admitted  # only an idle one


def test_registry_and_aliases() -> None:
    assert routing_policy_names() == ["round-robin", "weighted-round-robin",
                                      "least-outstanding", "p2c", "sed"]
    for alias, name in [("rr", "round-robin"), ("wrr", "weighted-round-robin"),
                        ("lor", "least-outstanding"), ("least-request", "p2c"),
                        ("shortest-expected-delay", "sed")]:
        assert make_routing_policy(alias).name == name
    with pytest.raises(ValidationError, match="policy: expected a routing policy"):
        make_routing_policy("fastest")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"weight": 0.0}, "weight: expected a positive number"),
    ({"weight": math.inf}, "weight: expected a positive number"),
    ({"concurrency": 0}, "concurrency: expected an integer >= 1"),
])
def test_replica_view_validation(kwargs, message):  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError, match=message):
        replace(R("a"), **kwargs)


@pytest.mark.parametrize(("caps", "total", "expected"), [
    ([3, 1, 1, 1], 100, (49, 17, 17, 17)),
    ([1, 1, 1], 100, (34, 33, 33)),
    ([1000, 1], 100, (99, 1)),
    ([], 100, ()),
])
def test_integer_weights_sum_and_minimum(caps, total, expected):  # type: ignore[no-untyped-def]
    got = integer_weights(caps, total)
    assert got == expected
    assert sum(got) == (total if caps else 0)


def test_scaled_weights() -> None:
    assert scaled_weights([300, 100, 100]) == (128, 43, 43)
    assert scaled_weights([1e6, 1]) == (128, 1)
    with pytest.raises(ValidationError, match=r"capacity\[1\]"):
        scaled_weights([1, -1])


def test_router_config_parses_plan_fields_and_names_bad_fields() -> None:
    cfg = parse_router_config({"services": [{"name": "m", "slo_p99_ms": 80, "replicas": [
        {"name": "a", "url": "http://10.0.0.1:8000/", "throughput_rps": 300, "gpu": "A100-80GB",
         "concurrency": 2, "service_time_ms": 5}]}]})
    r = cfg.services[0].replicas[0]
    assert (r.url, r.weight, r.concurrency, r.service_time_s, r.labels["gpu"]) == (
        "http://10.0.0.1:8000", 300.0, 2, 0.005, "A100-80GB")
    assert cfg.services[0].slo_s == pytest.approx(0.08)
    bad = [
        ({"services": []}, "services: expected at least one service"),
        ({"services": [{"name": "m", "replicas": [{"name": "a"}]}]}, r"replicas\[a\].url"),
        *[({"services": [{"name": "m", "replicas": [{"url": u}]}]},
           "expected an http:// URL with a host and a port of 1..65535")
          for u in ("ftp://x", "https://10.0.0.1:8443", "http://h:notaport", "http://h:99999",
                    "http://h:0", "http://[::1", "http://", "http:///x", "http://a b")],
        ({"services": [{"name": "m", "replicas": [{"url": "http://x", "weight": "3"}]}]},
         r"replicas\[0\].weight: expected a number"),
        ({"policy": "best", "services": [{"name": "m", "replicas": [{"url": "http://x"}]}]},
         "policy: expected a routing policy"),
        ({"services": [{"name": "m", "replicas": [{"url": "http://x", "name": "a"},
                                                  {"url": "http://y", "name": "a"}]}]},
         "distinct replica names"),
        ({"health": {"interval_s": 0}, "services": [{"name": "m", "replicas": [
            {"url": "http://x"}]}]}, "health.interval_s"),
    ]
    for doc, message in bad:
        with pytest.raises(ValidationError, match=message):
            parse_router_config(doc)


@pytest.mark.parametrize(("method", "key", "retry_post", "expected"), [
    ("GET", False, False, True), ("PUT", False, False, True), ("POST", False, False, False),
    ("POST", True, False, True), ("POST", False, True, True), ("PATCH", False, True, False),
])
def test_idempotency(method, key, retry_post, expected):  # type: ignore[no-untyped-def]
    assert is_idempotent(method, key, retry_post) is expected
