"""Unit tier for generative routing (issue 52): the token cost model and its learning
(``core/routing_llm.py``) inside the SED policy and admission, what the router reads from an
OpenAI request body, the SSE meter, and vLLM's gauges parsed from a metrics page."""

from __future__ import annotations

import pytest

from gpuslice.adapters.http import openai
from gpuslice.adapters.http.engine_metrics import parse_engine_metrics
from gpuslice.adapters.http.sse import SseMeter
from gpuslice.core.errors import ValidationError
from gpuslice.core.routing import (
    ReplicaView,
    ShortestExpectedDelay,
    admit,
    completed,
    dispatched,
    predicted_ttft,
)
from gpuslice.core.routing_llm import (
    EngineLoad,
    TokenDemand,
    TokenLoad,
    TokenOutcome,
    TokenSpeed,
    learn,
    mean_output,
    predict,
    prefill_share,
    service_time,
)

WHOLE = TokenSpeed(prefill_tps=8000, tpot_s=0.02)
SLICE_1G = TokenSpeed(prefill_tps=1000, tpot_s=0.15)


def view(name: str, speed: TokenSpeed, **kw: object) -> ReplicaView:
    return ReplicaView(name, concurrency=kw.pop("concurrency", 64),  # type: ignore[arg-type]
                       tokens=speed, **kw)  # type: ignore[arg-type]


def test_prediction_is_prefill_then_decode_at_the_slice_speed() -> None:
    d = TokenDemand(prompt_tokens=800, output_tokens=100)
    idle = TokenLoad(0, 0.0, 0, 64)
    fast, slow = predict(WHOLE, idle, d), predict(SLICE_1G, idle, d)
    assert fast.wait_s == 0.0
    assert fast.ttft_s == pytest.approx(800 / 8000 + 0.02)
    assert slow.ttft_s == pytest.approx(800 / 1000 + 0.15)
    assert service_time(WHOLE, d) == pytest.approx(0.1 + 100 * 0.02)
    emb = TokenDemand(800, 0, embedding=True)
    assert service_time(WHOLE, emb) == pytest.approx(0.1)
    assert predict(WHOLE, idle, emb).tpot_s == 0.0


def test_a_full_kv_cache_or_a_waiting_queue_makes_a_replica_wait() -> None:
    d = TokenDemand(500, 200)
    free = predict(WHOLE, TokenLoad(2, 5.0, 1400, 64), d)
    assert free.wait_s == 0.0
    queued = predict(WHOLE, TokenLoad(2, 5.0, 1400, 64, EngineLoad(8, 4, 0.99)), d)
    assert queued.wait_s > 0 and queued.ttft_s > free.ttft_s
    # a queue on the replica: it runs all it can, so its running count is its slots
    one_slot = predict(WHOLE, TokenLoad(0, 0.0, 0, 64, EngineLoad(1, 2, 0.01)), d)
    assert one_slot.wait_s == pytest.approx(3 * service_time(WHOLE, d))
    full = predict(WHOLE, TokenLoad(2, 5.0, 1400, 64, EngineLoad(8, 0, 0.99)), d)
    assert full.wait_s > 0
    # a KV cache that holds about two requests queues the third even with 64 slots
    small = TokenSpeed(prefill_tps=8000, tpot_s=0.02, kv_tokens=1500)
    assert predict(small, TokenLoad(2, 5.0, 1400, 64), d).wait_s > 0


def test_sed_sends_a_long_prompt_to_the_fast_replica_and_short_ones_spread() -> None:
    policy = ShortestExpectedDelay()
    reps = [view("whole", WHOLE), view("1g", SLICE_1G)]
    assert policy.choose(reps, 1, 0.5, TokenDemand(2000, 300)).index == 0
    # the whole GPU with more requests than slots: a short one goes to the idle slice
    busy = reps[0]
    for _ in range(100):
        busy, _t = dispatched(busy, 1, TokenDemand(2000, 500))
    assert policy.choose([busy, reps[1]], 1, 0.5, TokenDemand(10, 2)).index == 1


def test_completion_learns_the_measured_speed_and_releases_the_reservation() -> None:
    v = view("r", WHOLE)
    d = TokenDemand(800, 50)
    v2, ticket = dispatched(v, 1, d)
    assert v2.outstanding == 1 and v2.token_count == 850 and v2.work_s > 0
    assert ticket.tokens is not None
    measured = TokenOutcome(ttft_s=ticket.tokens.ttft_base_s * 2, tpot_s=0.04,
                            output_tokens=50, latency_s=2.0)
    v3 = completed(v2, ticket, 2.0, measured)
    assert v3.outstanding == 0 and v3.token_count == 0 and v3.work_s == 0.0
    assert v3.tokens is not None
    assert v3.tokens.samples == 1
    assert v3.tokens.ttft_ratio == pytest.approx(2.0)  # the first sample weighs fully
    assert v3.tokens.tpot_now_s == pytest.approx(0.04)
    failed = completed(v2, ticket, None, measured)
    assert failed.tokens == v.tokens  # a failure teaches nothing


def test_prompts_in_flight_stretch_the_predicted_tpot_and_are_not_learned_as_slowness() -> None:
    """Continuous batching interleaves other requests' prefill with a request's decode: with
    prompt seconds A in flight over requests of mean light-load time L0, the share is
    A / (L0 + A). A busy replica's measured TPOT, divided by that stretch, teaches its speed."""
    v = view("r", WHOLE)
    assert prefill_share(WHOLE, TokenLoad(0, 0.0, 0, 64)) == 0.0
    for _ in range(4):  # 4 x (8000 prompt tokens = 1 s of prefill, 100 tokens x 20 ms = 2 s)
        v, _t = dispatched(v, 1, TokenDemand(8000, 100))
    assert v.token_prompt == 32000
    share = prefill_share(WHOLE, TokenLoad(v.outstanding, v.work_s, v.token_count, 64,
                                           prompt_tokens=v.token_prompt))
    assert share == pytest.approx(4.0 / (v.work_s / 4 + 4.0))
    d = TokenDemand(100, 50)
    busy, ticket = dispatched(v, 1, d)
    assert ticket.tokens is not None
    stretch = ticket.tokens.tpot_factor
    assert stretch == pytest.approx(1 / (1 - share)) and stretch > 1.5
    idle = predict(WHOLE, TokenLoad(0, 0.0, 0, 64), d)
    assert predict(WHOLE, TokenLoad(4, v.work_s, v.token_count, 64, prompt_tokens=32000),
                   d).tpot_s == pytest.approx(idle.tpot_s * stretch)
    # it measured exactly the stretched TPOT: the replica's own speed is as assumed
    measured = TokenOutcome(ttft_s=ticket.tokens.ttft_base_s, tpot_s=0.02 * stretch)
    after = completed(busy, ticket, 1.0, measured)
    assert after.tokens is not None and after.tokens.tpot_ratio == pytest.approx(1.0)
    assert after.token_prompt == 32000


def test_non_streamed_answers_correct_by_their_latency() -> None:
    d = TokenDemand(100, 10)
    _, ticket = dispatched(view("r", WHOLE), 1, d)
    assert ticket.tokens is not None
    slow = learn(WHOLE, ticket.tokens, TokenOutcome(latency_s=ticket.tokens.e2e_s * 3))
    assert slow.tpot_now_s == pytest.approx(WHOLE.tpot_s * 3)
    assert slow.ttft_ratio == pytest.approx(3.0)
    same = learn(WHOLE, ticket.tokens, TokenOutcome())
    assert same == WHOLE
    assert mean_output(100.0, 300, alpha=0.5) == 200.0
    assert mean_output(100.0, None) == 100.0


def test_admission_by_predicted_time_to_first_token() -> None:
    learned = TokenSpeed(prefill_tps=1000, tpot_s=0.02, samples=50)
    reps = [view("r", learned)]
    short, long_ = TokenDemand(100, 10), TokenDemand(4000, 10)
    assert predicted_ttft(reps[0], short) == pytest.approx(0.12)
    assert admit(reps, 1, 0.5, demand=short).admitted
    no = admit(reps, 1, 0.5, demand=long_)
    assert not no.admitted
    assert "time to first token" in no.reason and no.retry_after_s >= 1
    cold = [view("r", TokenSpeed(prefill_tps=1000, tpot_s=0.02))]
    assert admit(cold, 1, 0.5, demand=long_).admitted  # still learning


def test_bad_speeds_and_demands_name_their_field() -> None:
    with pytest.raises(ValidationError) as exc:
        TokenSpeed(prefill_tps=0)
    assert exc.value.field == "prefill_tokens_per_s"
    with pytest.raises(ValidationError) as exc:
        TokenSpeed(kv_tokens=-1)
    assert exc.value.field == "kv_cache_tokens"
    with pytest.raises(ValidationError):
        TokenDemand(-1, 0)
    with pytest.raises(ValidationError):
        EngineLoad(float("nan"), 0, 0)


def test_openai_bodies_give_model_prompt_and_output_tokens() -> None:
    req = openai.parse_request("chat", b'{"model": " m ", "stream": true, "max_tokens": 9, "n": 2,'
                               b' "messages": [{"role": "user", "content": "abcdefgh"},'
                               b' {"role": "user", "content": [{"type": "text", "text": "abcd"},'
                               b' {"type": "image_url", "image_url": {"url": "x"}}]}]}')
    assert (req.model, req.stream, req.max_tokens, req.choices) == ("m", True, 9, 2)
    assert req.prompt_tokens == 2 * openai.MESSAGE_OVERHEAD + 2 + 1 + openai.IMAGE_TOKENS
    comp = openai.parse_request("completion", b'{"model": "m", "prompt": [1, 2, 3]}')
    assert comp.prompt_tokens == 3 and comp.max_tokens == openai.COMPLETION_DEFAULT_MAX
    emb = openai.parse_request("embedding", b'{"model": "m", "input": ["abcd", "abcdefgh"]}')
    assert emb.prompt_tokens == 3 and emb.max_tokens == 0
    newer = openai.parse_request("chat", b'{"model": "m", "max_completion_tokens": 4}')
    assert newer.max_tokens == 4
    for body, param in ((b'{"model": 3}', "model"), (b"[]", None), (b"{", None)):
        with pytest.raises(openai.OpenAIError) as err:
            openai.parse_request("chat", body)
        assert err.value.status == 400 and err.value.param == param
    assert openai.completion_tokens(b'{"usage": {"completion_tokens": 7}}') == 7
    assert openai.completion_tokens(b"not json") is None


def test_the_sse_meter_times_token_events_only() -> None:
    m = SseMeter(start=10.0)
    m.feed(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n', 10.1)
    m.feed(b": keep-alive\n\n", 10.2)
    m.feed(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: {"choi', 10.5)
    m.feed(b'ces":[{"delta":{"content":"b"}}]}\r\n\r\n', 10.7)
    m.feed(b'data: {"choices":[{"delta":{"content":"c"}}]}\n\n', 10.9)
    ttft, tpot, tokens = m.outcome()
    assert ttft == pytest.approx(0.5) and tokens == 3
    assert tpot == pytest.approx(0.2)
    m.feed(b'data: {"choices":[],"usage":{"completion_tokens":5}}\n\ndata: [DONE]\n\n', 11.0)
    ttft, tpot, tokens = m.outcome()
    assert tokens == 5 and tpot == pytest.approx(0.1) and m.done
    assert SseMeter(0.0).outcome() == (None, None, None)


def test_vllm_gauges_are_read_from_a_metrics_page() -> None:
    page = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="m"} 0.0
"""
    load = parse_engine_metrics(page)
    assert load is not None
    assert (load.running, load.waiting, load.kv_usage) == (5.0, 4.0, pytest.approx(0.6))
    v0 = parse_engine_metrics(b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
                              b"vllm:gpu_cache_usage_perc 0.25\n")
    assert v0 == EngineLoad(1.0, 0.0, 0.25)
    assert parse_engine_metrics(b"# another server\nrequests_running 3\n") is None
    assert parse_engine_metrics(b"vllm:num_requests_running 1\n") is None
